"""DFlash's block backbone, a shared block: DFlash (drafts/dflash/) is this backbone as it is, DSpark
(drafts/dspark/) adds its heads. A block drafter: one forward pass drafts a whole block of tokens.

    ctx    = hidden_norm(fc(cat(target hidden states of draft.target_layers)))     (B, T, H)
    block  = [anchor token, MASK x (S - 1)] at positions a .. a + S - 1            S = block_size
    x      = embeddings of the block: the anchor's is the target's; MASK's is the target's row of
             mask_token_id (+ the draft's own row `mask_delta`, trained iff train_mask_embedding)
    num_layers target-shaped layers (Qwen3-style: per-head q/k norms), each:
        keys/values = cat(k/v_proj(ctx at positions < a), k/v_proj(norm(x)))   every layer reads ctx
        x = x + Attn(norm(x))                     bidirectional inside the block
        x = x + MLP(norm(x))
    hidden = norm(x)                              the backbone's output: block hidden states
    logits = head(hidden)                         DFlash has no head: the target's lm_head

The block layout is speculators' `sample_from_anchor`:
    False  the anchor is the bonus token; slot s >= 1 predicts the token at a + s (S - 1 tokens)
    True   every slot predicts: slot s predicts the token at a + s + 1            (S tokens)
Training samples up to max_anchors anchors per sequence and runs all their blocks in one pass;
the j-th predicted token of a block (the token at a + 1 + j) weighs exp(-j / gamma) in the CE.
At inference the anchor is the last verified token x_n and the context every position < n.

The seam for the families built on DFlash (DSpark, Domino, ...): `forward()`, the backbone, gives
block hidden states; `block_head()` turns them into a `BlockHead` (logits = features @ weight.T, and
a confidence per slot where the family has one). Training, decoding and the export tests all read
logits through it, so a subclass adds its head there and nowhere else. The layout is the
`BlockLayout` flag. Attention reads a `BlockVisibility`: a flex_attention BlockMask on CUDA, a
dense boolean mask for SDPA elsewhere (flex_attention has no backward on CPU), per conversation
on CPU with packed data; all are made from the one rule in `block_visible`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.base import (
    Draft,
    target_layer_shape,
    target_text_config,
    uncapturable_layer,
)
from specdraft.drafts.dflash.blocks import (
    BlockVisibility,
)
from specdraft.drafts.dflash.decode import DFlashDrafter
from specdraft.drafts.dflash.options import DFlashBackboneSpec, DFlashDims, DFlashSpec
from specdraft.drafts.dflash.export import FILE_FORMAT as SPECULATORS_FILES, write_speculators_export
from specdraft.drafts.layers import RMSNorm
from specdraft.drafts.dflash.layer import BlockHead, DFlashLayer
from specdraft.drafts.dflash.train import DFlashTraining
from specdraft.drafts.objectives import (
    CE,
    Objective,
)
from specdraft.drafts.objective_options import objective_from_options


# -- the draft -------------------------------------------------------------------------------------


class DFlashBackbone(DFlashBackboneSpec, DFlashTraining, Draft):
    """DFlash's backbone with no head of its own (the target's lm_head): the DFlash family as it is
    (drafts/dflash/), and the base of the families that add a head (drafts/dspark/)."""

    dims_type = DFlashDims
    serving_formats = {"speculators": write_speculators_export}
    file_formats = {"speculators": SPECULATORS_FILES}
    import_settings = ("target_layers", "sample_from_anchor", "mask_token_id")
    layer_class = DFlashLayer  # one draft layer (a family on the backbone may wrap its sublayers)
    tensor_keys = (("fc.weight", "draft.target_layers"),)

    def __init__(self, dims: DFlashDims, objective: Objective = CE):
        super().__init__()
        self.dims = dims
        self.layout = dims.layout
        self.objective = objective  # what training_loss minimises (a training setting, not exported)
        # speculators' names: the native state dict is the speculators export minus mask_delta
        self.fc = nn.Linear(len(dims.target_layers) * dims.target_hidden_size, dims.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        # The draft's own MASK row, added to the target's embedding of mask_token_id. Zero and
        # frozen by default: then MASK is embedded exactly as speculators / vLLM embed it.
        self.mask_delta = nn.Parameter(torch.zeros(dims.hidden_size), requires_grad=dims.train_mask_embedding)
        if dims.train_mask_embedding:  # speculators cannot carry a trained MASK row: native export only
            self.serving_formats = {}
        self.init_linear_weights(self.dims.initializer_range)

    def describe(self) -> str:
        return "; ".join(
            [
                f"target layers {self.dims.target_layers} of {self.dims.target_num_layers}, "
                f"{self.dims.num_layers} draft layers, blocks of {self.dims.block_size}",
                *self.describe_refusals(),
            ]
        )

    def serving_refusal(self, fmt: str) -> Optional[str]:
        return uncapturable_layer(self.dims.target_layers, self.dims.target_num_layers)

    # -- building ---------------------------------------------------------------------------------

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "DFlashBackbone":
        return cls(
            cls.dims_type(**cls.dims_fields(target_config, draft_cfg)),
            objective=objective_from_options(draft_cfg, default=cls.default_loss),
        )

    @classmethod
    def dims_fields(cls, target_config, draft_cfg) -> Dict[str, Any]:
        """The dims' fields from the target's config and the `draft.` keys (a subclass adds its own)."""
        text = target_text_config(target_config)
        mask_id = draft_cfg.mask_token_id
        return dict(
            **target_layer_shape(target_config),
            hidden_act=getattr(text, "hidden_act", "silu"),
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            target_layers=cls.resolved_target_layers(draft_cfg, target_config),
            num_layers=int(draft_cfg.num_layers),
            block_size=int(draft_cfg.block_size),
            sample_from_anchor=cls.sample_from_anchor(draft_cfg),
            # default: the last row of the embedding table (an unused / reserved id in Qwen and
            # Llama-3 vocabularies); any id embeds exactly as speculators does
            mask_token_id=int(text.vocab_size - 1 if mask_id is None else mask_id),
            train_mask_embedding=bool(draft_cfg.train_mask_embedding),
            loss_decay_gamma=float(draft_cfg.loss_decay_gamma),
            loss_weighting=str(draft_cfg.get("loss_weighting", "decay")),
            dpace_alpha=float(draft_cfg.get("dpace_alpha", 0.5)),
            max_anchors=int(draft_cfg.max_anchors),
            target_num_layers=int(text.num_hidden_layers),
        )

    # -- the backbone: block embeddings + context -> block hidden states ---------------------------

    def context(self, hidden: Dict[int, torch.Tensor]) -> torch.Tensor:
        """Target hidden states {layer id: (B, T, Ht)} -> the context every layer reads (B, T, H)."""
        stacked = torch.cat([hidden[layer] for layer in self.dims.target_layers], dim=-1)
        return self.hidden_norm(self.fc(stacked.to(self.fc.weight.dtype)))

    def context_keys_values(self, context, cos, sin) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's (K, V) (B, KV, T, D): computed once, read by every block."""
        cos, sin = cos.to(context.dtype), sin.to(context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_embeddings(self, anchor_embeds: torch.Tensor, mask_embed: torch.Tensor) -> torch.Tensor:
        """anchor_embeds (B, A, H), the target's embedding of mask_token_id (H,) -> (B, A*S, H)."""
        B, A, H = anchor_embeds.shape
        mask = (mask_embed.to(self.mask_delta.dtype) + self.mask_delta).expand(B, A, self.layout.block_size - 1, H)
        return torch.cat([anchor_embeds.to(self.mask_delta.dtype)[:, :, None], mask], dim=2).view(B, -1, H)

    def forward(self, anchor_embeds, mask_embed, cos, sin, context_kv, visibility: Optional[BlockVisibility]):
        """The backbone: blocks [anchor, MASK...] (anchor_embeds (B, A, H); mask_embed (H,), the
        target's row of mask_token_id) at rotary tables cos/sin (B, A*S, D), the context's per-layer
        (K, V) -> block hidden states (B, A*S, H). One call = one draft forward pass; mask_delta is
        read here, inside the module call, so that ZeRO-3 has gathered it."""
        x = self.block_embeddings(anchor_embeds, mask_embed)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            x = self.run_layer(layer, x, cos, sin, context_k, context_v, visibility)
        return self.norm(x)

    # -- the head seam: block hidden states -> logits (and confidences) ---------------------------

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The (V, F) weight of the head's logits, made once per step (or once per drafter):
        DFlash's is the target's lm_head."""
        return lm_head_weight

    def block_head(
        self,
        hidden: torch.Tensor,
        previous_tokens: Optional[torch.Tensor],
        head_weight: torch.Tensor,
        state: Optional[torch.Tensor] = None,
    ) -> BlockHead:
        """hidden (..., S', H) of S' consecutive slots; previous_tokens (..., S'): each slot's
        previous token (the token before the one it predicts; the anchor for slots <= first_slot),
        read by heads that condition on it; state: a sequential head's, from the slot before.
        DFlash has no head: its logits are the target's lm_head applied to the hidden states."""
        return BlockHead(hidden, head_weight)

    def head_logits(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous_tokens: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Block hidden states (..., S, H) -> logits (..., S, V), through block_head."""
        return self.block_head(hidden, previous_tokens, self.head_weight(lm_head_weight)).logits()

    # -- decoding ---------------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        # one block drafts block_size - 1 tokens (block_size with sample_from_anchor)
        return int(self.layout.predictions)

    def make_drafter(self, target) -> DFlashDrafter:
        return DFlashDrafter(self, target)


class DFlashDraft(DFlashSpec, DFlashBackbone):
    """The DFlash family: the backbone as it is, its logits the target's lm_head."""

    architecture = "DFlashDraft"
