"""Causal attention inside packed documents without a (T, T) mask.

Packed rows hold several conversations; a query sees the keys <= its position in its own one.
- CPU: each conversation is one slice of the row, attended with `is_causal` (no mask at all).
  Its borders are read on the host, which costs nothing there.
- CUDA: flex_attention with a block mask built on the device from the document ids (no T^2
  tensor, no host sync). flex_attention has no backward on CPU (torch 2.13), hence the slices.
- Any other device (meta, the tests' stand-in for a second device): the dense (B, 1, T, T) mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch


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
        if documents.device.type == "cpu":
            return cls(documents, segments=document_segments(documents))
        if documents.device.type == "cuda":
            return cls(documents, block_mask=document_block_mask(documents))
        return cls(documents)

    def dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool: key j <= query t, both in the same conversation."""
        T = self.ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]


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


def document_block_mask(documents: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (documents[b, q] == documents[b, kv])

    B, T = documents.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=documents.device)


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
