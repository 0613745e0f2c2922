"""MTP: fine-tune the native multi-token-prediction layer a target ships (Qwen3-Next's `mtp.*`), as
speculators' MTPDraftModel does (speculators/models/mtp/core.py, 0.9.0).

The draft is that one layer (layer.py): hidden_layernorm, token_layernorm, input_proj (2H -> H),
the target's own decoder layer class, final_layernorm. Embeddings and lm_head are the target's,
frozen and shared, never in the draft's state. A new draft starts as the target's own MTP layer,
read from its checkpoint files (transformers' loader drops `mtp.*`).

Training, teacher-forced and recursive over K = draft.num_speculative_steps steps (speculators'
forward, exactly): with V = T - K - 1 rows (the same for every step), at step k = 0..K-1

    index t (< V), position t:  h^0_t = the target's final hidden state at t (after its final norm:
                                what vLLM's Qwen3NextModel.forward hands its MTP proposer)
                                out^k_t = layer(h^k_t, embed(x_{t+k+1}))   causal over the step's indices
                                h^{k+1}_t = out^k_t
    predicts x_{t+k+2} with the target's lm_head; counted where x_{t+k+2} is loss-masked (and, with
    packed data, in t's own document)
    loss = sum_k w_k * mean_k CE,   w_k = beta^k / sum_j beta^j,   beta = draft.step_weight_beta (0.6)

Step 0 at index n-1 is what decoding runs first: (h_{n-1}, x_n) -> x_{n+1}; each further drafted
token feeds the layer's own output back (decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn

from specdraft.drafts.base import (
    Draft,
    target_text_config,
)
from specdraft.drafts.mtp.decode import MTPDrafter
from specdraft.drafts.mtp.export import (
    FILE_FORMAT,
    read_target_mtp,
    speculators_refusal,
    target_path,
    write_speculators,
    write_stitched,
)
from specdraft.target.attention import PackedDocuments
from specdraft.drafts.mtp.layer import ATTENTION, LAYER_CLASSES, build_mtp_layer, init_layer_weights
from specdraft.drafts.mtp.options import MTPSpec
from specdraft.drafts.mtp.train import MTPTraining, step_weights


@dataclass
class MTPDims:
    target_config: Dict[str, Any]  # the target's text config (model_type + transformers' fields)
    num_speculative_steps: int = 3
    step_weight_beta: float = 0.6

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])


def layer_config(target_config: Dict[str, Any]):
    """The transformers config the layer is built from (sdpa attention, as speculators sets)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in target_config.items() if k != "model_type"}
    config = AutoConfig.for_model(target_config["model_type"], **fields)
    config._attn_implementation = ATTENTION  # sdpa, as speculators sets, and packed documents without a T x T mask
    config._experts_implementation = "eager"  # the plain loop over experts (transformers warns when unset)
    return config


def text_config_dict(target_config) -> Dict[str, Any]:
    text = target_text_config(target_config)
    config = {
        k: v
        for k, v in text.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "architectures", "dtype", "torch_dtype")
    }
    return dict(config, model_type=text.model_type)


class MTPDraft(MTPSpec, MTPTraining, Draft):
    architecture = "MTPDraft"
    dims_type = MTPDims
    serving_formats = {"speculators": write_speculators, "stitched": write_stitched}
    on_request_formats = ("stitched",)  # a copy of the whole target: written when asked for
    file_formats = {"speculators": FILE_FORMAT}
    target_model_types = tuple(LAYER_CLASSES)

    def __init__(self, dims: MTPDims):
        super().__init__()
        self.dims = dims
        self.config = layer_config(dims.target_config)
        self.mtp_layers = nn.ModuleList([build_mtp_layer(self.config)])
        self.init_weights(self.config.initializer_range)

    def init_weights(self, std: float) -> None:
        """A layer of its own when no target file gives one (a config built in memory)."""
        init_layer_weights(self, std, seed=0)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "MTPDraft":
        draft = cls(
            MTPDims(
                target_config=text_config_dict(target_config),
                num_speculative_steps=int(draft_cfg.num_speculative_steps),
                step_weight_beta=float(draft_cfg.step_weight_beta),
            )
        )
        path = target_path(target_config)
        # a new draft starts as the target's own MTP layer (read from its files: not on the meta
        # device, and not for a config built in memory, which has no files: init_weights then)
        if path and torch.empty(0).device.type != "meta":
            draft.load_state_dict(read_target_mtp(path, draft.state_dict()), strict=True)
        return draft

    def serving_refusal(self, fmt: str) -> Optional[str]:
        return speculators_refusal(self) if fmt == "speculators" else None

    def describe(self) -> str:
        beta, steps = self.dims.step_weight_beta, self.dims.num_speculative_steps
        weights = ", ".join(f"{w:.3f}" for w in step_weights(beta, steps))
        return f"the target's MTP layer, {steps} recursive steps weighted {weights} (beta {beta})"

    # -- the layer's passes ----------------------------------------------------------------

    def step(self, hidden, embeds, cos, sin, attention_mask=None, past_key_values=None) -> torch.Tensor:
        """One pass of the layer: hidden, embeds (B, T, H) at rotary tables cos/sin (B, T, D)."""
        return self.run_layer(
            self.mtp_layers[0],
            hidden,
            embeds,
            (cos.to(hidden.dtype), sin.to(hidden.dtype)),
            attention_mask,
            past_key_values,
        )

    def unroll(self, final_hidden, input_embeds, cos, sin, documents: Optional[torch.Tensor] = None):
        """The K teacher-forced steps over rows t < V = T - K - 1 -> K outputs (B, V, H); step k's
        row t predicts x_{t+k+2}. documents (B, T): packed conversations, each attending to itself."""
        T = final_hidden.shape[1]
        steps = min(self.dims.num_speculative_steps, max(0, T - 2))
        V = T - steps - 1
        # causal (None), inside each packed conversation (layer.packed_document_attention)
        mask = None if documents is None else PackedDocuments.of(documents[:, :V])
        hidden, outputs = final_hidden[:, :V], []
        for k in range(steps):
            hidden = self.step(hidden, input_embeds[:, k + 1 : k + 1 + V], cos[:, :V], sin[:, :V], mask)
            outputs.append(hidden)
        return outputs

    # -- decoding --------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        return int(self.dims.num_speculative_steps)

    def make_drafter(self, target: nn.Module) -> MTPDrafter:
        return MTPDrafter(self, target)
