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
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafts.base import Draft, DraftLoss, TargetFeatures
from specdraft.drafts.loss import chunked_cross_entropy


@dataclass
class GlideDims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int  # the draft's own self-attention K/V heads
    target_kv_heads: int  # heads of the target K/V that cross-attention reads
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    max_lag: int
    final_norm: bool
    anchor_offset: bool = False
    max_sink_tokens: int = 4
    max_position_offset: int = 30000
    initializer_range: float = 0.02


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, T, D); cos/sin (B, T, D): the target's own rotary tables
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SlidingWindowCache:
    """The draft's self-attention K/V at inference: a bounded buffer of the last `window` tokens.

    Entries are keyed by token index, so a rejected draft is undone by `crop(n)` and the next
    round simply writes its positions again.
    """

    def __init__(self, window: int):
        self.window = window
        self.keys: Optional[torch.Tensor] = None  # (B, KV, <=window, D)
        self.values: Optional[torch.Tensor] = None
        self.index: Optional[torch.Tensor] = None  # (<=window,) token index of each entry

    def append(self, keys, values, index) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add new entries; return what the new queries may attend to (old + new)."""
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
            index = torch.cat([self.index, index])
        self.keys, self.values, self.index = (keys[:, :, -self.window:], values[:, :, -self.window:],
                                              index[-self.window:])
        return keys, values, index

    def crop(self, length: int) -> None:
        """Forget entries at token index >= length (drafted tokens the target rejected)."""
        if self.index is not None:
            keep = self.index < length
            self.keys, self.values, self.index = self.keys[:, :, keep], self.values[:, :, keep], self.index[keep]

    def __len__(self) -> int:
        return 0 if self.index is None else int(self.index.numel())


def _attend(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    # q (B, Hq, T, D), k/v (B, Hkv, S, D), visible (T, S) bool; every row has >= 1 True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


class GlideSelfAttention(nn.Module):
    def __init__(self, d: GlideDims):
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden_size, d.num_kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=False)

    def forward(self, x, cos, sin, index, cache: Optional[SlidingWindowCache] = None):
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2)
        key_index = index
        if cache is not None:
            k, v, key_index = cache.append(k, v, index)
        distance = index[:, None] - key_index[None, :]  # (T, S) query index - key index
        visible = (distance >= 0) & (distance < self.d.sliding_window)
        out = _attend(q, k, v, visible)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class GlideCrossAttention(nn.Module):
    """Queries from the draft; keys/values are the target's last layer (keys already rotated)."""

    def __init__(self, d: GlideDims):
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden_size, d.num_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=False)

    def forward(self, x, cos, sin, target_keys, target_values, limit):
        # limit (T,): the last target position query t may read; < 0 means none
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2), cos, sin)
        S = target_keys.shape[2]
        visible = torch.arange(S, device=x.device)[None, :] <= limit[:, None]  # (T, S)
        has_context = visible.any(dim=1)
        visible[:, 0] |= ~has_context  # keep softmax finite; these rows are zeroed below
        out = _attend(q, target_keys.to(q.dtype), target_values.to(q.dtype), visible)
        out = out * has_context[None, None, :, None].to(out.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class GlideMLP(nn.Module):
    def __init__(self, d: GlideDims):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d.hidden_size, d.intermediate_size, bias=False)
        self.down_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GlideDraft(Draft):
    architecture = "GlideDraft"

    def __init__(self, dims: GlideDims):
        super().__init__()
        self.dims = dims
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = GlideSelfAttention(dims)
        self.cross_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.cross_attn = GlideCrossAttention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = GlideMLP(dims)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps) if dims.final_norm else None
        self._init_weights()

    def _init_weights(self) -> None:
        generator = torch.Generator().manual_seed(0)  # same init on every rank, whatever the RNG
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator)
                                        * self.dims.initializer_range)

    @classmethod
    def from_target_config(cls, target_config, draft_cfg) -> "GlideDraft":
        text = getattr(target_config, "text_config", None) or target_config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(GlideDims(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            target_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            sliding_window=int(draft_cfg.sliding_window),
            max_lag=int(draft_cfg.max_lag),
            final_norm=bool(draft_cfg.final_norm),
            anchor_offset=bool(draft_cfg.anchor_offset),
            max_sink_tokens=int(draft_cfg.max_sink_tokens),
            max_position_offset=int(draft_cfg.max_position_offset),
            initializer_range=getattr(text, "initializer_range", 0.02),
        ))

    @classmethod
    def from_export_config(cls, config: Dict[str, Any]) -> "GlideDraft":
        return cls(GlideDims(**config["dims"]))

    def export_config(self) -> Dict[str, Any]:
        return {"architecture": self.architecture, "dims": dict(self.dims.__dict__)}

    @property
    def trained_depth(self) -> int:
        # drafting token j after the last verified one reads the target at lag j; training drew
        # lags in [1, max_lag]
        return self.dims.max_lag

    # -- the layer -------------------------------------------------------------------------

    def forward(self, input_embeds, cos, sin, target_keys, target_values, cross_limit, index,
                cache: Optional[SlidingWindowCache] = None) -> torch.Tensor:
        """input_embeds (B, T, H) at token indices `index` (T,) -> draft hidden states (B, T, H).

        cross_limit (T,): the last target K/V position each query may read (< 0: none).
        """
        x = input_embeds
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, index, cache)
        x = x + self.cross_attn(self.cross_layernorm(x), cos, sin, target_keys, target_values, cross_limit)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x) if self.norm is not None else x

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return hidden @ lm_head_weight.t()

    # -- training --------------------------------------------------------------------------

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        lag = int(torch.randint(1, self.dims.max_lag + 1, (1,), generator=generator))
        options: Dict[str, Any] = {"lag": lag}
        if self.dims.anchor_offset:
            options["position_ids"] = anchor_offset_positions(
                seq_len, self.dims.max_sink_tokens, self.dims.max_position_offset, generator)
        return options

    def training_loss(self, features: TargetFeatures, lm_head_weight, input_ids, loss_mask,
                      chunk_size: int, lag: int = 1, **_) -> DraftLoss:
        T = input_ids.shape[1]
        index = torch.arange(T, device=input_ids.device)
        hidden = self(features.input_embeds, features.cos, features.sin, features.last_keys,
                      features.last_values, cross_limit=index - lag, index=index)
        # hidden at t predicts token t+1; t < lag had no target context
        counted = loss_mask[:, 1:].bool() & (index[None, :-1] >= lag)
        predictions = hidden[:, :-1][counted]
        labels = input_ids[:, 1:][counted]
        total, correct = chunked_cross_entropy(predictions, lm_head_weight, labels, chunk_size)
        tokens = counted.sum()  # on the device: no host sync per micro-batch
        return DraftLoss(loss=total / tokens.clamp_min(1), tokens=tokens, correct=correct)


def anchor_offset_positions(seq_len: int, max_sink: int, max_offset: int,
                            generator: torch.Generator) -> torch.Tensor:
    """Anchor-Offset position ids: s sink positions 0..s-1, the rest shifted by a random offset."""
    sinks = int(torch.randint(0, max_sink + 1, (1,), generator=generator))
    offset = int(torch.randint(0, max_offset + 1, (1,), generator=generator))
    positions = torch.arange(seq_len)
    positions[sinks:] += offset
    return positions

