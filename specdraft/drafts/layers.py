"""Building blocks the draft families share: the dims of a Llama-style layer, RMSNorm, the
target's RoPE, the q/k/v/o projections, attention with an explicit visibility mask, the gated MLP,
and the training-time attentions that need no (T, T) mask (sliding window, lagged causal
cross-attention), packed documents included (one path per device: target/attention.py). Module
attribute names (q_proj, gate_proj, ...) are the serving formats' keys: speculators, SGLang and
LongSpec load them by these names."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from specdraft.target.attention import attention_path, document_segments, flex_attention, make_block_mask, per_document
from specdraft.drafts.spec import LayerDims


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


def attend(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    # q (B, Hq, T, D), k/v (B, Hkv, S, D), visible (T, S) bool; every row has >= 1 True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


class Projections(nn.Module):
    """The q/k/v/o projections of an attention over `in_size` inputs (2H for EAGLE-3's fused input),
    and the reshapes to and from heads. keys_values=False: queries only (GLIDE's cross-attention
    reads the target's keys/values). bias: q/k/v biases, as Qwen2's attention has (o_proj has none)."""

    def __init__(self, d: LayerDims, in_size: Optional[int] = None, keys_values: bool = True, bias: bool = False):
        super().__init__()
        self.d = d
        in_size = d.hidden_size if in_size is None else in_size
        self.q_proj = nn.Linear(in_size, d.num_heads * d.head_dim, bias=bias)
        if keys_values:
            self.k_proj = nn.Linear(in_size, d.num_kv_heads * d.head_dim, bias=bias)
            self.v_proj = nn.Linear(in_size, d.num_kv_heads * d.head_dim, bias=bias)
        self.o_proj = nn.Linear(d.num_heads * d.head_dim, d.hidden_size, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, n * D) -> (B, n, T, D)"""
        return x.view(*x.shape[:2], -1, self.d.head_dim).transpose(1, 2)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output (B, Hq, T, D) -> o_proj of the merged heads (B, T, H)."""
        return self.o_proj(out.transpose(1, 2).flatten(2))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); act: the target's hidden_act (Llama, Qwen: silu; Gemma: gelu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACT2FN[hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def same_document(query_documents: torch.Tensor, key_documents: torch.Tensor) -> torch.Tensor:
    """(..., Q) and (..., K) document ids -> (..., Q, K) bool: the dense form of the document rule,
    built only on the "dense" path (target/attention.py: not on CPU, not on CUDA)."""
    return query_documents[..., :, None] == key_documents[..., None, :]


def sliding_window_attention(q, k, v, window: int, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Query t attends to keys t-window+1 .. t (and, with documents, only its own document's).

    q (B, Hq, T, D), k/v (B, Hkv, T, D), documents (B, T) or None -> (B, Hq, T, D). No (T, T) mask:
    a window covering the sequence is plain causal attention (is_causal, the fast kernels); up to
    two windows, one (T, T) band mask (blocks would not compute less); longer sequences split the
    queries into blocks of `window`, each attending to its own block and the one before under a
    (window, 2 window) band mask, so the cost is O(T x window). Documents: on CPU each one is
    attended alone that way; on CUDA one flex_attention over a block mask of the same rule.
    """
    B, H, T, D = q.shape
    gqa = H != k.shape[1]
    if documents is not None and attention_path(q.device) == "slices":
        return per_document(lambda *t: sliding_window_attention(*t, window), document_segments(documents), q, k, v)
    if documents is not None and attention_path(q.device) == "flex":
        return flex_attention(q, k, v, window_block_mask(documents, window))
    if T <= window and documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if T <= 2 * window:  # blocks would compute as much as one (T, T) band: one call, no copies
        distance = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)[None, :]
        visible = ((distance >= 0) & (distance < window))[None, None]  # (1, 1, T, T)
        if documents is not None:
            visible = visible & same_document(documents, documents)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)
    W = window
    blocks = -(-T // W)
    pad = blocks * W - T

    def blocked(x):  # (B, h, T, D) -> (B * blocks, h, W, D): 4-D, so SDPA keeps its fused kernels
        x = F.pad(x, (0, 0, 0, pad)).view(B, x.shape[1], blocks, W, D).transpose(1, 2)
        return x.reshape(B * blocks, x.shape[2], W, D)

    def with_previous(x):  # (B * blocks, h, W, D) -> (B * blocks, h, 2W, D): previous block, then own
        x = x.view(B, blocks, *x.shape[1:])
        x = torch.cat([F.pad(x, (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1], x], dim=3)
        return x.view(B * blocks, x.shape[2], 2 * W, D)

    qb, kb, vb = blocked(q), with_previous(blocked(k)), with_previous(blocked(v))
    i = torch.arange(W, device=q.device)[:, None]  # query offset in its block
    j = torch.arange(2 * W, device=q.device)[None, :]  # key offset from the previous block's start
    distance = W + i - j  # (W, 2W) query index - key index
    band = (distance >= 0) & (distance < window)
    first = torch.arange(blocks, device=q.device)[:, None, None] == 0
    visible = (band & ~(first & (j < W)))[None]  # (1, blocks, W, 2W): block 0 has no previous block
    if documents is not None:
        docs = F.pad(documents, (0, pad), value=-1).view(B, blocks, W)  # padding: its own "document"
        docs_prev = torch.cat([F.pad(docs, (0, 0, 1, 0), value=-2)[:, :-1], docs], dim=2)  # (B, blocks, 2W)
        visible = visible & same_document(docs, docs_prev)
    visible = visible.expand(B, blocks, W, 2 * W).reshape(B * blocks, 1, W, 2 * W)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, enable_gqa=gqa)  # (B * blocks, H, W, D)
    return out.view(B, blocks, H, W, D).transpose(1, 2).reshape(B, H, blocks * W, D)[:, :, :T]


def window_mask_elements(B: int, T: int, window: int) -> int:
    """Elements of the band mask sliding_window_attention builds for B rows of T tokens without
    documents (SDPA keeps it as a float bias for the backward): none within one window (causal), one
    (T, T) up to two windows, else one (window, 2 window) per block of each row."""
    if T <= window:
        return 0
    if T <= 2 * window:
        return T * T
    return B * -(-T // window) * window * 2 * window


def window_block_mask(documents: torch.Tensor, window: int):
    """The sliding window inside documents as a flex_attention BlockMask (O(T x window / 128^2) blocks)."""

    def same_document_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window) & (documents[b, q] == documents[b, kv])

    B, T = documents.shape
    return make_block_mask(same_document_window, B, T, T, documents.device)


def lagged_block_mask(documents: torch.Tensor, lag: int):
    """Query t sees key s <= t - lag of its own document, as a flex_attention BlockMask over all T
    queries and keys (rows without a visible key come out zero). The lag is read from a tensor: a
    Python int in the mask_mod would be a constant of the compiled create_block_mask (one
    compilation per lag), as the (T - lag) queries of the sliced form would be a shape."""
    B, T = documents.shape
    last_key = torch.arange(T, device=documents.device) - lag  # (T,) the last key query t sees

    def same_document_lagged(b, h, q, kv):
        return (kv <= last_key[q]) & (documents[b, kv] == documents[b, q])

    return make_block_mask(same_document_lagged, B, T, T, documents.device)


def lagged_cross_attention(q, k, v, lag: int, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Query t attends to target keys 0 .. t-lag (of its own document): causal attention of the
    queries [lag:] over the keys [:T-lag], so no document in the batch means plain is_causal.
    Documents: on CPU each one alone that way; on CUDA flex_attention over a block mask of the
    same rule (its rows without a visible key are zero, as here).

    q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D); rows without any visible key are zero.
    """
    B, H, T, D = q.shape
    gqa = H != k.shape[1]
    if documents is not None and attention_path(q.device) == "slices":
        return per_document(lambda *t: lagged_cross_attention(*t, lag), document_segments(documents), q, k, v)
    if documents is not None and attention_path(q.device) == "flex":  # every lag at the same (T, T) shapes
        return flex_attention(q, k, v, lagged_block_mask(documents, lag))
    if lag >= T:
        return q.new_zeros(B, H, T, v.shape[-1])
    q, k, v = q[:, :, lag:], k[:, :, : T - lag], v[:, :, : T - lag]
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        n = T - lag
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        visible = causal & same_document(documents[:, lag:], documents[:, :n])  # (B, n, n)
        has_context = visible[:, :, 0] | visible.any(dim=-1)  # (B, n)
        visible[:, :, 0] |= ~has_context  # keep softmax finite; these rows are zeroed below
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=gqa)
        out = out * has_context[:, None, :, None].to(out.dtype)
    return F.pad(out, (0, 0, lag, 0))  # queries t < lag see no target position
