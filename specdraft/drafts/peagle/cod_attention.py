"""P-EAGLE's slot attention (peagle/cod.py: cod_visibility) without its (N, N) mask.

A sequence's slots come depth by depth: depth 0 at every position 0..T-1, then depth d's slots in
increasing anchor order, their anchors a subset of depth d-1's (COD draws depth d from depth d-1's
survivors). Slot (a, d) sees the depth-0 keys <= a of its conversation and the keys (a, 1..d) of
its own rollout: EAGLE-3's training-time test at step d for query a (ttt_attention.py). So each
depth's queries and its rollout's keys are put at their anchors' positions (T rows, zeros where a
depth has no slot), ttt_attention runs over them, and the slots' rows are taken back. The memory
is O(K T) where the mask was O(N^2) with N ~ 3.4 T slots (K = 8 depths, r = 0.7, r_min = 0.2).
Under sequence parallelism (GatheredCODSlots) a rank's slots read the gathered depth-0 keys
through a dense mask instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from specdraft.target.attention import PackedDocuments
from specdraft.drafts.layers import attend
from specdraft.drafts.eagle3.ttt_attention import ttt_attention
from specdraft.parallel.sequence import SequenceShard
from specdraft.transfer import to_device


@dataclass(frozen=True)
class CODSlots:
    """Where each depth's slots lie in the slot order, and their anchors (on the device), for B
    rows laid out alike (peagle/cod.py: CODBatch; a row's unused places anchored at T)."""

    positions: int  # T: depth 0's slots are positions 0..T-1, in order
    depth_rows: Tuple[Tuple[int, int], ...]  # depths 1..: [start, end) in the slot order
    anchors: Tuple[torch.Tensor, ...]  # depths 1..: (B, n_d) long, increasing in each row; T: no slot
    documents: Optional[PackedDocuments] = None  # (B, T) of packed data

    @classmethod
    def of(cls, anchors_by_depth: Sequence[torch.Tensor], device, documents=None) -> "CODSlots":
        """One sequence's slots from COD's lists depth by depth (peagle/cod.py: cod_anchors, on the
        host): depth 0 is arange(T); each later depth's anchors are sorted and a subset of the
        depth before's. documents (T,)."""
        T = anchors_by_depth[0].numel()
        rows, start = [], T
        for anchor in anchors_by_depth[1:]:  # sizes only: no tensor value is read
            rows.append((start, start + anchor.numel()))
            start += anchor.numel()
        docs = None if documents is None else PackedDocuments.of(documents.reshape(1, -1))
        return cls(T, tuple(rows), tuple(to_device(a[None], device) for a in anchors_by_depth[1:]), docs)

    @classmethod
    def of_batch(cls, anchor: torch.Tensor, sizes: Sequence[int], documents=None) -> "CODSlots":
        """anchor (B, N) on the device in CODBatch's order (`sizes`: its places per depth, the same
        in every row), documents (B, T) or None."""
        rows, start = [], sizes[0]
        for size in sizes[1:]:
            rows.append((start, start + size))
            start += size
        return cls(sizes[0], tuple(rows), tuple(anchor[:, a:b] for a, b in rows), PackedDocuments.of(documents))

    def attention(self, q, k, v, past_keys, past_values):
        """The EAGLE-3 layer's mask-free rule (eagle3/layer.py): the slots see no past."""
        return cod_attention(q, k, v, self), k, v


def cod_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: CODSlots) -> torch.Tensor:
    """q (B, Hq, N, D), k/v (B, Hkv, N, D) in the slot order of `slots` -> (B, Hq, N, D), equal to
    SDPA under cod_visibility's dense mask (at the places that hold a slot)."""
    T = slots.positions
    keys, values = [k[:, :, :T]], [v[:, :, :T]]
    outs = [ttt_attention(q[:, :, :T], keys, values, slots.documents)]
    for (start, end), anchor in zip(slots.depth_rows, slots.anchors):
        keys.append(_at_anchors(k[:, :, start:end], anchor, T))
        values.append(_at_anchors(v[:, :, start:end], anchor, T))
        query = _at_anchors(q[:, :, start:end], anchor, T)
        out = ttt_attention(query, keys, values, slots.documents)
        outs.append(out.gather(2, _rows(anchor.clamp(max=T - 1), out)))  # an unused place reads row T - 1
    return torch.cat(outs, dim=2)


def _rows(anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, n) anchors -> the (B, H, n, D) index of those rows of a (B, H, ., D) tensor."""
    return anchor[:, None, :, None].expand(x.shape[0], x.shape[1], anchor.shape[1], x.shape[-1])


def _at_anchors(x: torch.Tensor, anchor: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H, n, D) rows -> (B, H, T, D) with row i of batch row b at position anchor[b, i], zeros
    elsewhere; the rows anchored at T (no slot) land on a row T that is dropped."""
    return x.new_zeros(*x.shape[:2], T + 1, x.shape[-1]).scatter(2, _rows(anchor, x), x)[:, :, :T]


@dataclass(frozen=True)
class GatheredCODSlots:
    """Sequence parallelism: one rank's slots (its T/N depth-0 positions, then the deeper slots
    anchored in its shard, depth by depth) against the depth-0 keys of the whole sequence
    (all-gathered) followed by its own deeper slots' keys. A slot's rollout lies on its anchor's
    rank; its context is the depth-0 keys <= its anchor, on this rank and every one before.
    A dense (slots, T + deeper slots) mask (cod_visibility's rule, built by the caller): CODSlots'
    mask-free path puts every depth at all T positions, the whole sequence's rows on every rank."""

    shard: SequenceShard
    visible: torch.Tensor  # (B, 1, n, T + n - T/N) bool on the device

    def attention(self, q, k, v, past_keys, past_values):
        """The EAGLE-3 layer's mask-free rule (eagle3/layer.py): the slots see no past."""
        return gathered_cod_attention(q, k, v, self), k, v


def gathered_cod_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: GatheredCODSlots) -> torch.Tensor:
    """q (B, Hq, n, D), k/v (B, Hkv, n, D) of this rank's slots -> (B, Hq, n, D). The gather is
    differentiable: a depth-0 key's gradient from every rank's slots lands on its own rank."""
    local = slots.shard.local_length
    # one gather for keys and values: one collective, not two
    context = slots.shard.gather(torch.cat([k[:, :, :local], v[:, :, :local]], dim=1), dim=2)
    keys = torch.cat([context[:, : k.shape[1]], k[:, :, local:]], dim=2)
    values = torch.cat([context[:, k.shape[1] :], v[:, :, local:]], dim=2)
    return attend(q, keys, values, slots.visible)
