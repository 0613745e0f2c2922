"""GLIDE (as LongSpec trains it): one decoder layer that reads the target's last-layer K/V.

    x = embed(token_t)                                   (target's embeddings, frozen)
    x = x + SelfAttn(norm(x))       sliding window over the draft's own states
    x = x + CrossAttn(norm(x))      over target keys/values at positions <= limit_t
    x = x + MLP(norm(x))
    logits = lm_head(x)                                  (target's lm_head, frozen; no final norm
                                                          unless draft.final_norm)

Training imitates verification lag: query t sees target K/V only at positions <= t - p, p drawn
per batch in [1, max_lag]; outputs for t < p have no target context and leave the loss.
At inference the limit is the last position the target has verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specdraft.drafts.base import (
    Draft,
    FileFormat,
    target_layer_shape,
)
from specdraft.drafts.glide.export import longspec_refusal, longspec_state_dict, write_longspec
from specdraft.drafts.glide.decode import GlideDrafter, SlidingWindowCache
from specdraft.drafts.glide.train import GlideTraining
from specdraft.drafts.glide.options import (
    GlideSpec,
    resolved_attention_bias,
)
from specdraft.drafts.layers import (
    GatedMLP,
    LayerDims,
    Projections,
    RMSNorm,
    apply_rope,
    attend,
    lagged_cross_attention,
    sliding_window_attention,
)
from specdraft.drafts.objectives import CE, Objective
from specdraft.drafts.objective_options import objective_from_options
from specdraft.parallel.sequence import SequenceShard


@dataclass
class GlideDims(LayerDims):  # num_kv_heads: the draft's own self-attention K/V heads
    target_kv_heads: int  # heads of the target K/V that cross-attention reads
    sliding_window: int
    max_lag: int
    final_norm: bool
    anchor_offset: bool = False
    max_sink_tokens: int = 4
    max_position_offset: int = 30000
    initializer_range: float = 0.02
    attention_bias: bool = False


class GlideSelfAttention(Projections):
    def __init__(self, d: GlideDims):
        super().__init__(d, bias=d.attention_bias)

    def forward(
        self,
        x,
        cos,
        sin,
        index=None,
        cache: Optional[SlidingWindowCache] = None,
        documents=None,
        shard: Optional[SequenceShard] = None,
    ):
        # index None: a whole training sequence 0..T-1 (documents (B, T) or None), no cache;
        # shard: this rank's tokens of it (sequence parallelism; documents are the whole sequence's)
        q = rope(self.heads(self.q_proj(x)), cos, sin)
        k = rope(self.heads(self.k_proj(x)), cos, sin)
        v = self.heads(self.v_proj(x))
        if index is None:
            shard = shard or SequenceShard.whole(x.shape[1])
            return self.output(shard.attention(sliding_window_attention, q, k, v, self.d.sliding_window, documents))
        key_index = index
        if cache is not None:
            k, v, key_index = cache.append(k, v, index)
        distance = index[:, None] - key_index[None, :]  # (T, S) query index - key index
        visible = (distance >= 0) & (distance < self.d.sliding_window)
        return self.output(attend(q, k, v, visible))


class GlideCrossAttention(Projections):
    """Queries from the draft; keys/values are the target's last layer (keys already rotated)."""

    def __init__(self, d: GlideDims):
        super().__init__(d, keys_values=False, bias=d.attention_bias)

    def forward(
        self,
        x,
        cos,
        sin,
        target_keys,
        target_values,
        limit=None,
        lag: int = 0,
        documents=None,
        shard: Optional[SequenceShard] = None,
    ):
        # limit (T,): the last target position query t may read; < 0 means none.
        # limit None: a whole training sequence, query t reads up to t - lag (of its document)
        q = rope(self.heads(self.q_proj(x)), cos, sin)
        keys, values = target_keys.to(q.dtype), target_values.to(q.dtype)
        if limit is None:
            shard = shard or SequenceShard.whole(x.shape[1])
            return self.output(shard.attention(lagged_cross_attention, q, keys, values, lag, documents))
        visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= limit[:, None]  # (T, S)
        has_context = visible.any(dim=1)
        visible[~has_context, 0] = True  # keep softmax finite; these rows are zeroed below
        out = attend(q, keys, values, visible)
        out = out * has_context[None, None, :, None].to(out.dtype)
        return self.output(out)


class GlideDraft(GlideSpec, GlideTraining, Draft):
    architecture = "GlideDraft"
    dims_type = GlideDims
    # LongSpec's own files (`export --format longspec`): only on request, a save would copy the
    # weights its native draft_model_weights.pth already holds
    serving_formats = {"longspec": write_longspec}
    on_request_formats = ("longspec",)
    file_formats = {"longspec": FileFormat(longspec_state_dict)}
    tensor_keys = (("*_proj.bias", "draft.attention_bias"), ("norm.weight", "draft.final_norm"))

    def __init__(self, dims: GlideDims, objective: Objective = CE):
        super().__init__()
        self.dims = dims
        self.objective = objective  # what training_loss minimises (a training setting, not exported)
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = GlideSelfAttention(dims)
        self.cross_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.cross_attn = GlideCrossAttention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = GatedMLP(dims.hidden_size, dims.intermediate_size)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps) if dims.final_norm else None
        self.init_linear_weights(self.dims.initializer_range)

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "GlideDraft":
        shape = target_layer_shape(target_config)
        return cls(
            GlideDims(
                **shape,
                target_kv_heads=shape["num_kv_heads"],
                sliding_window=int(draft_cfg.sliding_window),
                max_lag=int(draft_cfg.max_lag),
                final_norm=bool(draft_cfg.final_norm),
                anchor_offset=bool(draft_cfg.anchor_offset),
                max_sink_tokens=int(draft_cfg.max_sink_tokens),
                max_position_offset=int(draft_cfg.max_position_offset),
                # .get: a draft config written before the key existed means the default (the target's)
                attention_bias=resolved_attention_bias(draft_cfg.get("attention_bias"), target_config),
            ),
            objective=objective_from_options(draft_cfg, default=cls.default_loss),
        )

    def serving_refusal(self, fmt: str) -> Optional[str]:
        return longspec_refusal(self.dims) if fmt == "longspec" else None

    @property
    def trained_depth(self) -> int:
        # drafting token j after the last verified one reads the target at lag j; training drew
        # lags in [1, max_lag]
        return self.dims.max_lag

    # -- the layer -------------------------------------------------------------------------

    def forward(
        self,
        input_embeds,
        cos,
        sin,
        target_keys,
        target_values,
        cross_limit,
        index,
        cache: Optional[SlidingWindowCache] = None,
    ) -> torch.Tensor:
        """input_embeds (B, T, H) at token indices `index` (T,) -> draft hidden states (B, T, H).

        cross_limit (T,): the last target K/V position each query may read (< 0: none).
        """
        x = input_embeds
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, index, cache)
        x = x + self.cross_attn(self.cross_layernorm(x), cos, sin, target_keys, target_values, cross_limit)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x) if self.norm is not None else x

    def forward_sequence(
        self,
        input_embeds,
        cos,
        sin,
        target_keys,
        target_values,
        lag: int,
        documents: Optional[torch.Tensor] = None,
        shard: Optional[SequenceShard] = None,
    ) -> torch.Tensor:
        """Training: whole sequences at token indices 0..T-1; query t reads target K/V up to t - lag;
        documents (B, T) confines both attentions to each token's own document. -> (B, T, H).
        shard: sequence parallelism, the inputs and output are this rank's T/N tokens (documents
        the whole sequence's); both attentions exchange heads (SequenceShard.attention)."""
        x = input_embeds
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents=documents, shard=shard)
        x = x + self.cross_attn(
            self.cross_layernorm(x), cos, sin, target_keys, target_values, lag=lag, documents=documents, shard=shard
        )
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x) if self.norm is not None else x

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return hidden @ lm_head_weight.t()

    def make_drafter(self, target: nn.Module) -> GlideDrafter:
        return GlideDrafter(self, target)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The target's RoPE on x (B, heads, T, D) as its attention applies it (cos/sin (B, T, R), the
    capture's tables): over the whole head, or with partial rotary (GLM-4.5, Qwen3-Next: R < D) over
    the first R dims of each head, the rest passed through (their apply_rotary_pos_emb). Queries of
    the cross-attention so meet the target's keys rotated alike."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)
