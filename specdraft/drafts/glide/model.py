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
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafts.base import (
    MemoryShape,
    CaptureRequest,
    Draft,
    DraftLoss,
    FileFormat,
    HostBatch,
    TargetFeatures,
    document_starts,
    rows_where,
    target_layer_shape,
)
from specdraft.drafts.glide.longspec import longspec_refusal, longspec_state_dict, write_longspec
from specdraft.drafts.glide.decode import GlideDrafter, SlidingWindowCache
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
    window_mask_elements,
)
from specdraft.drafts.objectives import CE, Objective, answer_labels, shared_head_objective, term_metrics
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


class GlideDraft(GlideSpec, Draft):
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

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        d, p, tokens = self.dims, shape.dtype_bytes, shape.B * shape.T
        H, heads, kv, hd, I = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
        terms = {
            # input embeddings (H), cos/sin (2 hd), the target's last-layer K/V (2 kv hd)
            "capture features": shape.capture_features(H + 2 * hd + 2 * d.target_kv_heads * hd),
            # saved per token: 10 H-sized tensors (norm in/out, residuals, o_proj / cross / MLP
            # outputs), q/k/v + RoPE copies + attention outputs (self 4 heads hd + 3 kv hd, cross
            # 3 heads hd), MLP gate/up/silu/product (4I); the 3 RMSNorms keep their inputs in fp32
            "draft activations": tokens
            * ((10 * H + 7 * heads * hd + 3 * kv * hd + 4 * I) * p + shape.fp32_norm_inputs(3 * H)),
            "loss chunk + hidden grads": shape.loss_chunk(
                tokens, shape.target.vocab_size, H, teacher=self.objective.needs_teacher
            ),
        }
        # one conversation per row longer than the window: the self-attention's band mask
        # (layers.sliding_window_attention), as the float bias SDPA makes of it and keeps for the
        # backward. It spans the whole sequence under SP: the core attends every token with the
        # rank's heads. Packed documents add no term: per-conversation slices on CPU, flex block
        # masks on CUDA (O(T^2 / 128^2) block indices), drafts/layers.py
        band = 0 if shape.documents else window_mask_elements(shape.B, shape.context_T, d.sliding_window)
        if band:
            terms["window mask"] = band * p
        return terms

    def make_drafter(self, target: nn.Module) -> GlideDrafter:
        return GlideDrafter(self, target)

    # -- training --------------------------------------------------------------------------

    def capture_request(self) -> CaptureRequest:
        # the final hidden state only when the objective reads the target's distribution
        return CaptureRequest(last_layer_kv=True, final_hidden=self.objective.needs_teacher)

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        lag = int(torch.randint(1, self.dims.max_lag + 1, (1,), generator=generator))
        options: Dict[str, Any] = {"lag": lag}
        if self.dims.anchor_offset:
            options["position_ids"] = anchor_offset_positions(
                seq_len, self.dims.max_sink_tokens, self.dims.max_position_offset, generator
            )
        return options

    def training_loss(
        self,
        features: TargetFeatures,
        lm_head_weight,
        input_ids,
        loss_mask,
        chunk_size: int,
        lag: int = 1,
        documents: Optional[torch.Tensor] = None,
        host: Optional[HostBatch] = None,
        **_,
    ) -> DraftLoss:
        """documents (B, T) or None: packed documents; attention and labels stay inside each one."""
        hidden = self.forward_sequence(
            features.input_embeds,
            features.cos,
            features.sin,
            features.last_keys,
            features.last_values,
            lag,
            documents,
            features.shard,
        )
        shard = features.shard or SequenceShard.whole(input_ids.shape[1])
        host = HostBatch.of(input_ids, loss_mask, documents, host)
        counted = counted_predictions(self.objective.taught(host.loss_mask, host.token_mask), host.documents, lag)
        group_tokens = shard.host_count(counted)  # on the host: the whole sequence's, every rank alike
        counted = shard.local(counted)
        rows, tokens = rows_where(counted, input_ids.device)
        predictions = hidden.flatten(0, 1)[rows]  # row b*T + t predicts token t+1 of row b
        labels = shard.local(F.pad(input_ids[:, 1:], (0, 1))).flatten()[rows]  # token t+1 at t
        next_is_answer = torch.zeros_like(host.loss_mask, dtype=torch.bool)  # on the host: is token t+1 an answer
        next_is_answer[:, :-1] = host.loss_mask[:, 1:].bool()
        ce_labels, answers = answer_labels(labels, shard.local(next_is_answer)[counted])  # CE learns answers only
        # the teacher: the target's own next-token distribution at t, from its final hidden state
        teacher = features.final_hidden.flatten(0, 1)[rows] if self.objective.needs_teacher else None
        objective = self.objective.over_rows(rows.numel(), answers)
        out = shared_head_objective(predictions, lm_head_weight, teacher, ce_labels, objective, chunk_size)
        correct = out.correct if ce_labels is labels else (out.argmax == labels).sum()  # vs the data's token
        loss, weight = shard.token_mean(out.loss, group_tokens, tokens)
        return DraftLoss(loss=loss, tokens=weight, correct=correct, metrics=term_metrics(out.terms, tokens, answers))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The target's RoPE on x (B, heads, T, D) as its attention applies it (cos/sin (B, T, R), the
    capture's tables): over the whole head, or with partial rotary (GLM-4.5, Qwen3-Next: R < D) over
    the first R dims of each head, the rest passed through (their apply_rotary_pos_emb). Queries of
    the cross-attention so meet the target's keys rotated alike."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)


def counted_predictions(loss_mask: torch.Tensor, documents: Optional[torch.Tensor], lag: int) -> torch.Tensor:
    """(B, T) bool: the positions t whose prediction of token t+1 the loss counts. Token t+1 is
    loss-masked and in t's document, and t had target context: t - lag is in its document."""
    B, T = loss_mask.shape
    index = torch.arange(T, device=loss_mask.device)
    counted = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    if documents is None:
        counted[:, :-1] = loss_mask[:, 1:].bool() & (index[None, :-1] >= lag)
        return counted
    start_index = document_starts(documents)  # (B, T) its document's first token
    has_context = index - lag >= start_index
    same_document = start_index[:, 1:] == start_index[:, :-1]
    counted[:, :-1] = loss_mask[:, 1:].bool() & has_context[:, :-1] & same_document  # label in t's document
    return counted


def anchor_offset_positions(seq_len: int, max_sink: int, max_offset: int, generator: torch.Generator) -> torch.Tensor:
    """Anchor-Offset position ids: s sink positions 0..s-1, the rest shifted by a random offset."""
    sinks = int(torch.randint(0, max_sink + 1, (1,), generator=generator))
    offset = int(torch.randint(0, max_offset + 1, (1,), generator=generator))
    positions = torch.arange(seq_len, device="cpu")  # drawn on the host; TargetWithDraft moves it
    positions[sinks:] += offset
    return positions
