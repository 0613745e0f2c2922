"""The MTP layer as speculators builds it (speculators/models/mtp/model_definitions.py, 0.9.0): the
target's own decoder layer class, built at the index of its last full-attention layer, plus four
modules around it (speculators' names, which are our state-dict names):

    h   = hidden_layernorm(hidden)             the target's final hidden state, or the previous step's output
    e   = token_layernorm(embed(next token))   the target's embeddings, frozen
    out = final_layernorm(DecoderLayer(input_proj(cat(e, h))))       input_proj: 2H -> H, no bias

The decoder layer is transformers' class for the target's model_type (Qwen3-Next: gated attention
with partial RoPE and an MoE MLP; DeepSeek-V3: MLA and MoE; GLM-4.5: partial RoPE and MoE), so it
computes exactly what the target's checkpoint means. DeepSeek-V3's and GLM-4.5's MTP layer is the
same computation under other names: transformers' MtpLayer (modeling_layers.py: enorm, hnorm,
eh_proj over cat(enorm(e), hnorm(h)), mtp_block, post_norm, built from config.get_mtp_config(),
whose first_k_dense_replace 0 makes its MLP the MoE one), stored as layer num_hidden_layers of the
checkpoint (model.layers.<L>.*, which the main model's loader drops: _keys_to_ignore_on_load_unexpected).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch import nn

from transformers import AttentionInterface

from specdraft.target.attention import PackedDocuments, flex_attention
from specdraft.errors import SpecdraftError


def _qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextDecoderLayer,
        Qwen3NextRMSNorm,
        Qwen3NextRotaryEmbedding,
    )

    return Qwen3NextDecoderLayer, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding


def _deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    return DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding


def _glm4_moe():
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer,
        Glm4MoeRMSNorm,
        Glm4MoeRotaryEmbedding,
    )

    return Glm4MoeDecoderLayer, Glm4MoeRMSNorm, Glm4MoeRotaryEmbedding


# model_type -> (decoder layer, RMSNorm, rotary embedding) classes; the targets with native MTP
# layers in transformers (qwen3_next: mtp.*; deepseek_v3, glm4_moe: MtpModel's model.layers.<L>.*)
# this family is tested on
LAYER_CLASSES = {"qwen3_next": _qwen3_next, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe}


def layer_classes(model_type: str):
    if model_type not in LAYER_CLASSES:
        raise SpecdraftError(
            f"draft.type mtp: model_type {model_type!r} has no MTP layer here (supported: {', '.join(LAYER_CLASSES)})"
        )
    return LAYER_CLASSES[model_type]()


def last_full_attention(config) -> int:
    """speculators' _last_full_attention_idx: the MTP layer is a full-attention layer, built at the
    last such index of the target (hybrid targets alternate linear and full attention)."""
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        return 0
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    if not full:
        raise SpecdraftError(f"draft.type mtp: the target has no full-attention layer (layer_types {types})")
    return full[-1]


ATTENTION = "specdraft_packed_documents"  # the layer's transformers attention implementation


def packed_document_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa for a mask tensor or None (causal); packed documents (PackedDocuments)
    without a (T, T) mask (target/attention.py): one causal call per conversation slice on the CPU,
    flex_attention's block mask on CUDA, the dense mask elsewhere. Returns (B, T, heads, D), None."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling)[0]

    if not isinstance(attention_mask, PackedDocuments):
        return sdpa(query, key, value, attention_mask), None
    if attention_mask.segments is not None:
        rows = [
            torch.cat(
                [
                    sdpa(query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], None)
                    for s, e in row
                ],
                dim=1,
            )
            for b, row in enumerate(attention_mask.segments)
        ]
        return torch.cat(rows, dim=0), None
    if attention_mask.block_mask is not None:
        return flex_attention(query, key, value, attention_mask.block_mask, scale=scaling).transpose(1, 2), None
    return sdpa(query, key, value, attention_mask.dense()), None


AttentionInterface.register(ATTENTION, packed_document_attention)


def build_mtp_layer(config) -> nn.Module:
    decoder_class, norm_class, _ = layer_classes(config.model_type)

    layer_config = copy.copy(config)
    if hasattr(layer_config, "first_k_dense_replace"):  # transformers' get_mtp_config: MTP layers are MoE
        layer_config.first_k_dense_replace = 0

    class MTPLayer(decoder_class):
        def __init__(self):
            super().__init__(layer_config, last_full_attention(config))
            H, eps = config.hidden_size, config.rms_norm_eps
            self.hidden_layernorm = norm_class(H, eps=eps)
            self.token_layernorm = norm_class(H, eps=eps)
            self.input_proj = nn.Linear(2 * H, H, bias=False)
            self.final_layernorm = norm_class(H, eps=eps)

        def forward(
            self, hidden_states, token_embeddings, position_embeddings, attention_mask=None, past_key_values=None
        ):
            x = torch.cat([self.token_layernorm(token_embeddings), self.hidden_layernorm(hidden_states)], dim=-1)
            out = super().forward(
                hidden_states=self.input_proj(x),
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
            )
            return self.final_layernorm(out[0] if isinstance(out, tuple) else out)

    return MTPLayer()


def init_layer_weights(module: nn.Module, std: float, seed: int) -> None:
    """As transformers initialises Qwen3-Next: matrices and expert tensors ~ N(0, std) from a fixed
    seed, the (1 + w) norms at w = 0 (a layer built outside its model is not initialised for us:
    its expert tensors would be uninitialised memory)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            if param.dim() == 1:
                param.zero_()
            else:  # drawn on the host from the seeded generator: the same values on any device
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def rotary_embedding(config) -> nn.Module:
    return layer_classes(config.model_type)[2](config=config)


# -- the names of the target's checkpoint (vLLM's qwen3_next_mtp.py: Qwen3NextMultiTokenPredictor
# holds fc, pre_fc_norm_hidden, pre_fc_norm_embedding, norm and layers.N under the prefix "mtp.")
# <-> ours (speculators' MTPConverter: MTP_EXACT_REMAP, MTP_PREFIX_REMAP, _fuse_moe_experts)

TARGET_PREFIX = "mtp."
EXACT = {"mtp.fc.weight": "mtp_layers.0.input_proj.weight", "mtp.norm.weight": "mtp_layers.0.final_layernorm.weight"}
PREFIXES = (
    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),
    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),
    ("mtp.layers.0.", "mtp_layers.0."),
)
EXPERTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a target's checkpoint keeps its MTP layer: every tensor under `prefix`, renamed to ours
    by `exact` names, else by the first of `prefixes` it starts with; `skipped`: tensors under the
    prefix that are the target's own (DeepSeek-V3 stores copies of its embeddings and head with the
    layer), neither read nor rewritten."""

    prefix: str
    exact: Dict[str, str]
    prefixes: Tuple[Tuple[str, str], ...]
    skipped: Tuple[str, ...] = ()

    def holds(self, key: str) -> bool:
        return key.startswith(self.prefix) and key not in self.skipped


QWEN3_NEXT_LAYOUT = CheckpointLayout(TARGET_PREFIX, EXACT, PREFIXES)


def layer_after_the_stack(num_layers: int) -> CheckpointLayout:
    """DeepSeek-V3's and GLM-4.5's: layer L = num_hidden_layers of the checkpoint (vLLM's
    deepseek_mtp.py / glm4_moe_mtp.py: enorm, hnorm, eh_proj, shared_head.{norm,head}, the decoder
    layer's own names; transformers' conversion_mapping renames shared_head.norm to post_norm)."""
    p = f"model.layers.{num_layers}."
    return CheckpointLayout(
        p,
        {
            p + "eh_proj.weight": "mtp_layers.0.input_proj.weight",
            p + "shared_head.norm.weight": "mtp_layers.0.final_layernorm.weight",
        },
        (
            (p + "hnorm.", "mtp_layers.0.hidden_layernorm."),
            (p + "enorm.", "mtp_layers.0.token_layernorm."),
            (p, "mtp_layers.0."),
        ),
        skipped=(p + "embed_tokens.weight", p + "shared_head.head.weight"),
    )


def checkpoint_layout(model_type: str, num_layers: int) -> CheckpointLayout:
    """The layout of a target of `model_type` with `num_layers` decoder layers (config.json's)."""
    return QWEN3_NEXT_LAYOUT if model_type == "qwen3_next" else layer_after_the_stack(num_layers)


def ours_from_target(
    tensors: Dict[str, torch.Tensor], layout: CheckpointLayout = QWEN3_NEXT_LAYOUT
) -> Dict[str, torch.Tensor]:
    """The target's MTP tensors (mtp.*, or model.layers.<L>.*) -> our state dict: renamed, and
    per-expert weights (mlp.experts.<i>.{gate,up,down}_proj.weight) fused as transformers holds
    them (experts.gate_up_proj (E, 2I, H) = [gate_i; up_i], experts.down_proj (E, H, I))."""
    out: Dict[str, torch.Tensor] = {}
    experts: Dict[str, Dict[int, Dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        if key in layout.skipped:
            continue
        name = _rename(key, layout)
        head, sep, rest = name.partition(".experts.")
        index, _, proj = rest.partition(".")
        if sep and index.isdigit() and proj[: -len(".weight")] in EXPERTS:
            experts.setdefault(head + ".experts", {}).setdefault(int(index), {})[proj[: -len(".weight")]] = value
        else:
            out[name] = value
    for prefix, by_index in experts.items():
        count = len(by_index)
        if sorted(by_index) != list(range(count)) or any(set(e) != set(EXPERTS) for e in by_index.values()):
            raise SpecdraftError(
                f"the target's {prefix}: experts 0..{count - 1} with gate, up and down projections each expected"
            )
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([by_index[i]["gate_proj"], by_index[i]["up_proj"]]) for i in range(count)]
        )
        out[prefix + ".down_proj"] = torch.stack([by_index[i]["down_proj"] for i in range(count)])
    return out


def target_from_ours(
    state: Dict[str, torch.Tensor], layout: CheckpointLayout = QWEN3_NEXT_LAYOUT
) -> Dict[str, torch.Tensor]:
    """Our state dict -> the target checkpoint's names and layout (ours_from_target inverted)."""
    out: Dict[str, torch.Tensor] = {}
    back_exact = {ours: theirs for theirs, ours in layout.exact.items()}
    for name, value in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = _unrename(name[: -len(".gate_up_proj")], layout)
            gate, up = value.chunk(2, dim=1)
            for i in range(value.shape[0]):
                out[f"{prefix}.{i}.gate_proj.weight"], out[f"{prefix}.{i}.up_proj.weight"] = gate[i], up[i]
        elif name.endswith(".experts.down_proj"):
            prefix = _unrename(name[: -len(".down_proj")], layout)
            for i in range(value.shape[0]):
                out[f"{prefix}.{i}.down_proj.weight"] = value[i]
        else:
            out[back_exact.get(name) or _unrename(name, layout)] = value
    return out


def _rename(key: str, layout: CheckpointLayout = QWEN3_NEXT_LAYOUT) -> str:
    if key in layout.exact:
        return layout.exact[key]
    for theirs, ours in layout.prefixes:
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    raise SpecdraftError(f"the target's tensor {key}: not part of a native MTP layer this family knows")


def _unrename(name: str, layout: CheckpointLayout = QWEN3_NEXT_LAYOUT) -> str:
    for theirs, ours in layout.prefixes:
        if name.startswith(ours):  # the two norms come before the whole layer's prefix
            return theirs + name[len(ours) :]
    raise ValueError(f"{name}: not an MTP layer tensor")
