"""EAGLE-3's training-time-test attention without a (T, (k+1) T) mask.

At TTT step k, query t sees the step-0 keys 0..t (causal) plus one key of each step 1..k: the
key at its own position t (the diagonal). A dense mask over the (k+1) T keys costs O(k T^2)
compute and memory; here the causal part is one SDPA with `is_causal` (the fast kernels) and the
diagonal part k dot products per query, merged exactly:

    out_t = (Z0_t o0_t + Zd_t od_t) / (Z0_t + Zd_t)
    o0, Z0: attention over the causal keys and its partition sum; od, Zd: the same over the diagonal keys

SDPA returns o0 but not Z0, so the diagonal part enters the causal call as one extra "sink" key
in front of every row, whose score for query t is log Zd_t (an extra q/k coordinate carries it)
and whose value is zero, plus a value column of ones on the real keys. The call then returns
Z0 o0 / (Z0 + Zd) in the value columns and Z0 / (Z0 + Zd) in the ones column, so
out = those values + (1 - that weight) od. Everything is differentiable through SDPA's own backward.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from specdraft.target.attention import PackedDocuments, document_causal_attention, flex_attention, per_document


def _per_query_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    # (B, Hkv, T, D) -> (B, heads, T, D): the kv head each query head reads (GQA)
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def ttt_attention(
    q: torch.Tensor, keys: List[torch.Tensor], values: List[torch.Tensor], documents=None
) -> torch.Tensor:
    """q (B, Hq, T, D): step k's queries; keys/values: k + 1 tensors (B, Hkv, T, D), step 0 first.
    documents (B, T) of packed data (or its PackedDocuments, built once per batch): the causal keys
    of the query's own conversation only, without a (T, T) mask on CPU and CUDA (documents.py).
    -> (B, Hq, T, D), equal to SDPA over cat(keys) under ttt_visibility's dense mask."""
    docs = PackedDocuments.of(documents)
    if len(keys) == 1:
        return document_causal_attention(q, keys[0], values[0], docs)
    if docs is not None and docs.block_mask is not None:
        return _flex_ttt(q, keys, values, docs.block_mask)
    log_zd, diag_out = _diagonal(q, keys[1:], values[1:])
    scale = q.shape[-1] ** -0.5
    q_ext = torch.cat([q, log_zd / scale], dim=-1)  # (B, H, T, D + 1): the sink's score coordinate
    if docs is None:
        merged = _behind_a_sink(q_ext, keys[0], values[0], scale)
    elif docs.segments is not None:
        merged = per_document(lambda *t: _behind_a_sink(*t, scale), docs.segments, q_ext, keys[0], values[0])
    else:  # no kernel to run (meta): the dense mask, the sink seen by all
        visible = F.pad(docs.dense(), (1, 0, 1, 0), value=True)
        merged = _behind_a_sink(q_ext, keys[0], values[0], scale, visible)
    causal_weight = merged[..., -1:]  # Z0 / (Z0 + Zd)
    return merged[..., :-1] + (1 - causal_weight) * diag_out


def _diagonal(q, diag_keys, diag_values):
    """Attention over the same-position keys of steps 1..k -> log Zd (B, H, T, 1), od (B, H, T, D)."""
    H = q.shape[1]
    diag_keys = torch.stack([_per_query_heads(k, H) for k in diag_keys], dim=-2)  # (B, H, T, k, D)
    diag_values = torch.stack([_per_query_heads(v, H) for v in diag_values], dim=-2)
    diag_scores = torch.einsum("bhtd,bhtkd->bhtk", q, diag_keys) * q.shape[-1] ** -0.5  # (B, H, T, k)
    log_zd = torch.logsumexp(diag_scores, dim=-1, keepdim=True)
    return log_zd, torch.einsum("bhtk,bhtkd->bhtd", diag_scores.softmax(dim=-1), diag_values)


def _behind_a_sink(q_ext, keys, values, scale, visible=None):
    """The causal keys behind one sink key: row 0 is a dummy query, so with is_causal query t (row
    t+1) sees the sink and the keys 0..t. -> (B, H, T, D + 1): values, then the causal weight."""
    B, kv_heads = keys.shape[:2]
    q_ext = F.pad(q_ext, (0, 0, 1, 0))  # dummy query row in front
    k_ext = F.pad(keys, (0, 1))  # real keys: 0 in the extra coordinate
    sink_key = torch.zeros_like(k_ext[:, :, :1])
    sink_key[..., -1] = 1.0
    k_ext = torch.cat([sink_key, k_ext], dim=2)  # (B, Hkv, T + 1, D + 1)
    v_ext = F.pad(values, (0, 1), value=1.0)  # the ones column measures the causal keys' weight
    v_ext = torch.cat([v_ext.new_zeros(B, kv_heads, 1, v_ext.shape[-1]), v_ext], dim=2)
    gqa = q_ext.shape[1] != kv_heads
    if visible is None:
        merged = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        merged = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, attn_mask=visible, scale=scale, enable_gqa=gqa)
    return merged[:, :, 1:]  # drop the dummy query


def _flex_ttt(q, keys, values, block_mask):
    """CUDA: flex_attention over the step-0 keys returns its log-sum-exp, so no sink is needed."""
    log_zd, diag_out = _diagonal(q, keys[1:], values[1:])
    causal_out, log_z0 = flex_attention(q, keys[0], values[0], block_mask, return_lse=True)
    causal_weight = torch.sigmoid(log_z0.unsqueeze(-1) - log_zd).to(q.dtype)  # Z0 / (Z0 + Zd)
    return causal_weight * causal_out + (1 - causal_weight) * diag_out
