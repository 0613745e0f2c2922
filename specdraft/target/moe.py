"""A mixture-of-experts target's MLP shape, read from its config as transformers builds the layers
(one place for the memory model and the families whose layers are the target's own, MTP).

    Qwen3-MoE, Qwen3-Next  num_experts, num_experts_per_tok, moe_intermediate_size; sparse where
                           layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0
                           (Qwen3-Next: + a shared expert of shared_expert_intermediate_size)
    gpt-oss                num_local_experts, num_experts_per_tok, intermediate_size (each expert's); all sparse
    DeepSeek-V3, GLM-4.5   n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts
                           shared experts of moe_intermediate_size each; sparse from first_k_dense_replace on
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class MoEShape:
    experts: int  # routed experts per sparse layer (all of their weights resident)
    top_k: int  # experts each token is routed to
    expert_intermediate: int  # one routed expert's MLP width
    shared_intermediate: int  # the shared expert(s)' MLP width together; 0: none
    sparse_layers: Tuple[int, ...]  # the layers whose MLP is the mixture (the others are dense)


def moe_shape(text) -> Optional[MoEShape]:
    """The MoE MLP of a target's text config; None for a dense target."""
    layers = range(text.num_hidden_layers)
    top_k = getattr(text, "num_experts_per_tok", None)
    # by the fields each family of configs defines (their attribute_maps alias the expert count's name:
    # Qwen3-MoE answers num_local_experts too, DeepSeek-V3 num_local_experts for n_routed_experts)
    if text.model_type == "gpt_oss":  # every layer, experts of intermediate_size
        return MoEShape(text.num_local_experts, top_k, text.intermediate_size, 0, tuple(layers))
    if hasattr(text, "first_k_dense_replace"):  # DeepSeek-V3, GLM-4.5
        first = text.first_k_dense_replace or 0
        return MoEShape(
            text.n_routed_experts,
            top_k,
            text.moe_intermediate_size,
            (getattr(text, "n_shared_experts", 0) or 0) * text.moe_intermediate_size,
            tuple(i for i in layers if i >= first),
        )
    experts = getattr(text, "num_experts", None)
    if not experts or not top_k:
        return None
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", 1) or 1
    return MoEShape(
        experts,
        top_k,
        text.moe_intermediate_size,
        getattr(text, "shared_expert_intermediate_size", 0) or 0,
        tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
    )
