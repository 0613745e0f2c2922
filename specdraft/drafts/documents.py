"""Attention inside packed documents without a (T, T) mask, one path per device (attention_path).

Packed rows hold several conversations; a query sees keys of its own one only (EAGLE-3: those
<= its position; GLIDE and DFlash add their window, lag or block rule on top).
- CPU ("slices"): each conversation is one slice of the row, attended as a row of its own (no
  document mask at all). Its borders are read on the host, which costs nothing there.
- CUDA ("flex"): flex_attention with a block mask built on the device from the document ids (no
  T^2 tensor, no host sync). flex_attention has no backward on CPU (torch 2.13), hence the slices.
- Any other device ("dense"; meta, the tests' stand-in for a second device): a dense mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F


def attention_path(device) -> str:
    """How packed documents are attended on `device`: "slices" (CPU), "flex" (CUDA), "dense" (else)."""
    return {"cpu": "slices", "cuda": "flex"}.get(torch.device(device).type, "dense")


@dataclass(frozen=True)
class PackedDocuments:
    """The document ids (B, T) and what the attention of this device needs, built once per batch."""

    ids: torch.Tensor
    segments: Optional[List[List[Tuple[int, int]]]] = None  # CPU: per row, each conversation's [start, end)
    block_mask: Optional[object] = None  # CUDA: flex_attention's BlockMask

    @classmethod
    def of(cls, documents) -> Optional["PackedDocuments"]:
        if documents is None or isinstance(documents, PackedDocuments):
            return documents
        path = attention_path(documents.device)
        if path == "slices":
            return cls(documents, segments=document_segments(documents))
        if path == "flex":
            return cls(documents, block_mask=document_block_mask(documents))
        return cls(documents)

    def dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool: key j <= query t, both in the same conversation."""
        T = self.ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]


def document_causal_attention(q, k, v, documents: Optional[PackedDocuments] = None,
                              scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention inside each conversation, without a (T, T) mask on CPU and CUDA.
    q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D). documents None: one per row."""
    gqa = q.shape[1] != k.shape[1]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    if documents is None:
        return causal(q, k, v)
    if documents.segments is not None:
        return per_document(causal, documents.segments, q, k, v)
    if documents.block_mask is not None:
        return flex_attention(q, k, v, documents.block_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.dense(), scale=scale, enable_gqa=gqa)


def document_attention(document_ids: Optional[torch.Tensor]):
    """The target's core attention for packed data (target/capture.py's `attention`): causal
    inside each document of document_ids (B, T); None (plain causal) without documents."""
    if document_ids is None:
        return None
    documents = PackedDocuments.of(document_ids)
    return lambda q, k, v, scale: document_causal_attention(q, k, v, documents, scale)


def document_segments(documents: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """documents (B, T) on the host -> per row the [start, end) of each conversation (contiguous ids)."""
    T = documents.shape[1]
    starts = documents[:, 1:] != documents[:, :-1]
    rows = []
    for row in starts:
        borders = [0, *(torch.nonzero(row).flatten() + 1).tolist(), T]
        rows.append(list(zip(borders[:-1], borders[1:])))
    return rows


def per_document(attend: Callable[..., torch.Tensor], segments: List[List[Tuple[int, int]]],
                 *tensors: torch.Tensor) -> torch.Tensor:
    """attend(*slices) on each conversation's slice (dim 2 of every (B, H, T, D) tensor), joined
    back along T: causal attention per conversation, one call each."""
    rows = []
    for b, row in enumerate(segments):
        rows.append(torch.cat([attend(*(t[b:b + 1, :, start:end] for t in tensors)) for start, end in row], dim=2))
    return torch.cat(rows, dim=0)


def document_block_mask(documents: torch.Tensor, key_documents: Optional[torch.Tensor] = None):
    """Query q sees key kv <= q of its own document. documents (B, Q): the queries' document ids;
    key_documents (B, KV): the keys' (default: the same), e.g. shifted for a lagged attention."""
    key_documents = documents if key_documents is None else key_documents

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (documents[b, q] == key_documents[b, kv])

    B, Q = documents.shape
    return make_block_mask(same_document_causal, B, Q, key_documents.shape[1], documents.device)


_compiled_block_mask = None


def make_block_mask(mask_mod, B: int, q_len: int, kv_len: int, device):
    """flex_attention's BlockMask of mask_mod(b, h, q, kv): (B, 1, q_len/128, kv_len/128) block
    indices. Eager create_block_mask first evaluates mask_mod over the whole (B, 1, Q, KV) grid (a
    T^2 bool tensor, then freed); compiled (CUDA) it evaluates it block by block instead."""
    global _compiled_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    build = create_block_mask
    if torch.device(device).type == "cuda":
        if _compiled_block_mask is None:
            _compiled_block_mask = torch.compile(create_block_mask)
        build = _compiled_block_mask
    return build(mask_mod, B, None, q_len, kv_len, device=device)


_compiled_flex = None


def flex_attention(q, k, v, block_mask, scale: Optional[float] = None, return_lse: bool = False):
    """flex_attention with `block_mask`; compiled on CUDA (eager flex materialises the scores).
    return_lse: also the (B, H, T) natural log-sum-exp of each row's scores (differentiable)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention as eager

    if q.device.type == "cuda" and _compiled_flex is None:
        _compiled_flex = torch.compile(eager)
    flex = _compiled_flex if q.device.type == "cuda" else eager
    gqa = q.shape[1] != k.shape[1]
    if not return_lse:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse
