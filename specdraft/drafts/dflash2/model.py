"""DFlash2: DFlash's block backbone (drafts/dflash/model.py) whose every layer wraps its attention
and its MLP in a grouped dynamic causal convolution (conv.py), plus a candidate selector
(selector.py) that reranks each slot's top-K unary candidates given the token before it.

    layer    h = norm(x); h, k = conv_a.prepare(h); x = x + conv_a.finish(Attn(h), k)
             h = norm(x); h, k = conv_m.prepare(h); x = x + conv_m.finish(MLP(h), k)
    unary    logits_s = lm_head(hidden_s)                          (DFlash's, the target's head)
    draft    slot s: the best (greedy) or a sampled one of topK(logits_s), scored
             unary + selector(hidden_s, the token chosen at slot s - 1; the anchor first)

A fresh draft's convolutions are the identity, so it starts as DFlash (speculators' reset).
Names are speculators' DFlash2DraftModel's (layers.i.attention_conv.*, layers.i.mlp_conv.*,
candidate_selector.*), so its file is a plain save."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict


from specdraft.drafts.dflash.layer import BlockHead, DFlashLayer
from specdraft.drafts.dflash.model import DFlashBackbone, DFlashDims
from specdraft.drafts.dflash2.conv import GroupedDynamicCausalConv
from specdraft.drafts.dflash2.decode import DFlash2Drafter
from specdraft.drafts.dflash2.export import FILE_FORMAT, write_speculators_export
from specdraft.drafts.dflash2.options import DFlash2Spec
from specdraft.drafts.dflash2.selector import CandidateSelector
from specdraft.drafts.dflash2.train import DFlash2Training


@dataclass
class DFlash2Dims(DFlashDims):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0


class DFlash2Layer(DFlashLayer):
    def __init__(self, d: DFlash2Dims):
        super().__init__(d)
        conv = dict(block_size=d.block_size, kernel_size=d.conv_kernel_size, group_size=d.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(d.hidden_size, **conv)
        self.mlp_conv = GroupedDynamicCausalConv(d.hidden_size, **conv)

    def forward(self, x, cos, sin, context_k, context_v, visibility):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context_k, context_v, visibility), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class DFlash2Draft(DFlash2Spec, DFlash2Training, DFlashBackbone):
    architecture = "DFlash2Draft"
    dims_type = DFlash2Dims
    layer_class = DFlash2Layer
    serving_formats = {"speculators": write_speculators_export}
    file_formats = {"speculators": FILE_FORMAT}
    import_settings = (*DFlashBackbone.import_settings, "conv_kernel_size", "conv_group_size", "selector_top_k")
    tensor_keys = (*DFlashBackbone.tensor_keys, ("candidate_selector.*", "draft.selector_rank"))

    def __init__(self, dims: DFlash2Dims, objective=None):
        from specdraft.drafts.objective_options import parse_objective

        super().__init__(dims, objective or parse_objective(self.default_loss))
        self.candidate_selector = CandidateSelector(
            dims.vocab_size, dims.hidden_size, dims.selector_rank, dims.selector_top_k, dims.initializer_range
        )
        for layer in self.layers:  # init_linear_weights drew them: back to the identity
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        if dims.train_mask_embedding:
            self.serving_formats = {}

    def describe(self) -> str:
        d = self.dims
        return (
            f"{super().describe()}; convolutions of {d.conv_kernel_size} taps over groups of {d.conv_group_size}, "
            f"selector rank {d.selector_rank} over the top {d.selector_top_k}"
        )

    @classmethod
    def dims_fields(cls, target_config, draft_cfg) -> Dict[str, Any]:
        return dict(
            super().dims_fields(target_config, draft_cfg),
            conv_kernel_size=int(draft_cfg.conv_kernel_size),
            conv_group_size=int(draft_cfg.conv_group_size),
            selector_rank=int(draft_cfg.selector_rank),
            selector_top_k=int(draft_cfg.selector_top_k),
            selector_loss_alpha=float(draft_cfg.selector_loss_alpha),
        )

    def block_head(self, hidden, previous_tokens, head_weight, state=None) -> BlockHead:
        # the unary logits are DFlash's; the selector reads each slot's previous token beside them
        return dataclasses.replace(
            super().block_head(hidden, previous_tokens, head_weight), previous_tokens=previous_tokens
        )

    def make_drafter(self, target) -> DFlash2Drafter:
        return DFlash2Drafter(self, target)
