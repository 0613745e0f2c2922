"""P-EAGLE's COD sampling (speculators models/peagle/data.py: generate_cod_sample_indices), on one
sequence, drawn from a seeded torch.Generator so a resumed run draws the same slots.

    depth 0: every position t (the loss counts the valid ones)
    depth d (1 .. K-1): keep n_d = int(max(0, |valid| - d) * max(r^d, r_min)) positions drawn
        without replacement from the survivors of depth d-1 shifted by one (depth 1: the valid
        positions themselves), sorted; a kept position o is the slot (anchor o - d, depth d);
        when fewer survivors than n_d remain, all are kept. The next pool is (kept + 1), minus
        position 0 and the positions that are not valid.
    K depths at most; it stops early when n_d is 0.

One deliberate difference: a depth-1 candidate at position 0 would have anchor -1 (speculators
then reads its document id at index -1); it is dropped from the pool here.

Training draws every row of a batch at once (cod_sample_batch: fixed shapes, no loop over rows):
the same rule, the subset of depth d drawn as the n_d smallest of iid uniform keys over the pool
(a uniform subset, as randperm's first n_d), each depth's slots compacted into a fixed number of
places (cod_capacity: n_d of a row whose every position is valid), padded with slots anchored at T
that are not drawn. cod_anchors is the one-row reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


def cod_sample(
    valid: torch.Tensor, num_depths: int, ratio: float, ratio_min: float, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """valid (T,) bool on the host -> (anchor, depth), (N,) long each: depth 0 first (all T
    positions), then each depth's slots in increasing anchor order."""
    return slot_order(cod_anchors(valid, num_depths, ratio, ratio_min, generator))


def cod_anchors(
    valid: torch.Tensor, num_depths: int, ratio: float, ratio_min: float, generator: torch.Generator
) -> List[torch.Tensor]:
    """cod_sample's slots depth by depth: [arange(T), depth 1's anchors, ...], each sorted and a
    subset of the depth before's (the order cod_attention.py attends in without a mask)."""
    T = valid.shape[0]
    valid_index = valid.nonzero().flatten()
    anchors = [torch.arange(T)]
    pool = valid_index[valid_index >= 1]
    for d in range(1, num_depths):
        size = int(max(0, valid_index.numel() - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        if pool.numel() >= size:
            kept = pool[torch.randperm(pool.numel(), generator=generator)[:size]].sort().values
        else:
            kept = pool
        anchors.append(kept - d)
        pool = kept + 1
        pool = pool[(pool < T) & (pool != 0)]  # speculators wraps (kept + 1) % T, then drops 0
        pool = pool[valid[pool]]
    return anchors


def slot_order(anchors_by_depth: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """[depth 0's anchors, depth 1's, ...] -> (anchor, depth), (N,) each, in that order."""
    depths = [torch.full((a.numel(),), d, dtype=torch.long) for d, a in enumerate(anchors_by_depth)]
    return torch.cat(anchors_by_depth), torch.cat(depths)


def cod_visibility(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    documents=None,
    key_anchor: Optional[torch.Tensor] = None,
    key_depth: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(N, N) bool, speculators' create_peagle_mask_mod: a slot sees the depth-0 slots of anchors
    <= its own (its context, causally) and the slots of its own rollout at depths <= its own.
    documents (T,): a slot sees only slots whose anchor lies in its own conversation.
    key_anchor / key_depth (M,): keys other than the queries' own slots -> (N, M) (sequence
    parallelism: a rank's slots against the gathered depth-0 keys and its own deeper slots).
    Batched: anchor (B, N), documents (B, T), key_anchor (B, M) -> (B, N, M) (depths broadcast);
    an anchor past the end (cod_sample_batch's padding, T) reads the document of position T - 1."""
    if key_anchor is None:
        key_anchor, key_depth = anchor, depth
    q_anchor, k_anchor = anchor[..., :, None], key_anchor[..., None, :]
    context = (key_depth[..., None, :] == 0) & (k_anchor <= q_anchor)
    rollout = (k_anchor == q_anchor) & (key_depth[..., None, :] <= depth[..., :, None])
    visible = context | rollout
    if documents is not None:
        last = documents.shape[-1] - 1
        visible &= (
            documents.gather(-1, anchor.clamp(0, last))[..., :, None]
            == documents.gather(-1, key_anchor.clamp(0, last))[..., None, :]
        )
    return visible


def cod_capacity(length: int, num_depths: int, ratio: float, ratio_min: float) -> List[int]:
    """[C_1, C_2, ...]: the most slots depth d holds in a row of `length` positions, n_d with every
    position valid (n_d grows with |valid|), for the depths where it is > 0 (cod_anchors stops at
    the first n_d = 0, and n_d does not grow with d)."""
    sizes = []
    for d in range(1, num_depths):
        size = int(max(0, length - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        sizes.append(size)
    return sizes


@dataclass(frozen=True)
class CODBatch:
    """COD's slots of B rows at fixed shapes: per row its T depth-0 slots (positions 0..T-1), then
    for each depth d >= 1 a block of `sizes[d]` places, the row's depth-d slots in increasing
    anchor order first, then padding (anchor T, not drawn). The same slot order as slot_order of
    cod_anchors' lists, with each depth padded to a size fixed by T."""

    anchor: torch.Tensor  # (B, N) long; T at a padding place
    depth: torch.Tensor  # (N,) long, the same for every row
    drawn: torch.Tensor  # (B, N) bool: a slot (every depth-0 place), False at padding
    sizes: Tuple[int, ...]  # the places of depth 0 (T), 1, 2, ...: N = sum(sizes)

    @property
    def length(self) -> int:  # T
        return self.sizes[0]

    def depth_rows(self) -> List[Tuple[int, int]]:
        """Depths 1..: [start, end) of their places in the slot order (the same in every row)."""
        rows, start = [], self.sizes[0]
        for size in self.sizes[1:]:
            rows.append((start, start + size))
            start += size
        return rows

    def own(self, start: int, end: int) -> "CODBatch":
        """Sequence parallelism, on the host: the slots anchored in [start, end) (a rank's shard;
        depth 0 its positions), each depth still sorted, in as many places as the row that holds
        the most has (counted here, as DFlash's own_blocks does: places for a whole depth on every
        rank would run every rank's slots on each). The slots of the whole draw, filtered."""
        T = self.length
        anchors, depths, drawn = [self.anchor[:, start:end]], [self.depth[start:end]], [self.drawn[:, start:end]]
        sizes = [end - start]
        for first, last in self.depth_rows():
            anchor, kept = self.anchor[:, first:last], self.drawn[:, first:last]
            mine = kept & (anchor >= start) & (anchor < end)
            size = int(mine.sum(dim=1).max())
            order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices[:, :size]  # own first, in order
            mine = mine.gather(1, order)
            anchors.append(torch.where(mine, anchor.gather(1, order), T))
            depths.append(self.depth[first : first + size])
            drawn.append(mine)
            sizes.append(size)
        return CODBatch(torch.cat(anchors, dim=1), torch.cat(depths), torch.cat(drawn, dim=1), tuple(sizes))


def cod_sample_batch(
    valid: torch.Tensor, num_depths: int, ratio: float, ratio_min: float, generator: torch.Generator
) -> CODBatch:
    """valid (B, T) bool -> every row's COD slots (cod_anchors' rule, row by row independent),
    drawn with whole-batch tensor ops of shapes fixed by (B, T): depth d keeps the
    n_d = int(max(0, |valid| - d) * max(r^d, r_min)) members of its pool with the smallest of iid
    uniform keys (float64, from `generator`, which lives on the CPU: the same slots on any device),
    all of them when the pool is smaller."""
    B, T = valid.shape
    device = valid.device
    position = torch.arange(T, device=device)
    count = valid.sum(dim=1, keepdim=True)  # (B, 1) |valid| per row
    pool = valid & (position >= 1)
    anchors, depths, drawn = (
        [position.expand(B, T)],
        [torch.zeros(T, dtype=torch.long, device=device)],
        [torch.ones(B, T, dtype=torch.bool, device=device)],
    )
    sizes = cod_capacity(T, num_depths, ratio, ratio_min)
    for d, size in enumerate(sizes, start=1):
        keep = ((count - d).clamp_min(0).double() * max(ratio**d, ratio_min)).long()  # int() of a float64, per row
        keys = torch.rand((B, T), generator=generator, dtype=torch.float64).to(device)
        keys = torch.where(pool, keys, torch.full_like(keys, 2.0))  # the pool first, in a uniform order
        rank = torch.empty_like(position.expand(B, T)).scatter_(1, keys.argsort(dim=1), position.expand(B, T))
        kept = pool & (rank < keep)
        order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :size]  # kept positions, ascending
        placed = kept.gather(1, order)
        anchors.append(torch.where(placed, order - d, T))
        depths.append(torch.full((size,), d, dtype=torch.long, device=device))
        drawn.append(placed)
        pool = torch.zeros_like(pool)
        pool[:, 1:] = kept[:, :-1]  # kept + 1, inside the row
        pool &= valid
    return CODBatch(torch.cat(anchors, dim=1), torch.cat(depths), torch.cat(drawn, dim=1), (T, *sizes))
