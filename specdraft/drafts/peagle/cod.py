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
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def cod_sample(valid: torch.Tensor, num_depths: int, ratio: float, ratio_min: float,
               generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """valid (T,) bool on the host -> (anchor, depth), (N,) long each: depth 0 first (all T
    positions), then each depth's slots in increasing anchor order."""
    return slot_order(cod_anchors(valid, num_depths, ratio, ratio_min, generator))


def cod_anchors(valid: torch.Tensor, num_depths: int, ratio: float, ratio_min: float,
                generator: torch.Generator) -> List[torch.Tensor]:
    """cod_sample's slots depth by depth: [arange(T), depth 1's anchors, ...], each sorted and a
    subset of the depth before's (the order cod_attention.py attends in without a mask)."""
    T = valid.shape[0]
    valid_index = valid.nonzero().flatten()
    anchors = [torch.arange(T)]
    pool = valid_index[valid_index >= 1]
    for d in range(1, num_depths):
        size = int(max(0, valid_index.numel() - d) * max(ratio ** d, ratio_min))
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


def cod_visibility(anchor: torch.Tensor, depth: torch.Tensor, documents=None,
                   key_anchor: Optional[torch.Tensor] = None, key_depth: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, N) bool, speculators' create_peagle_mask_mod: a slot sees the depth-0 slots of anchors
    <= its own (its context, causally) and the slots of its own rollout at depths <= its own.
    documents (T,): a slot sees only slots whose anchor lies in its own conversation.
    key_anchor / key_depth (M,): keys other than the queries' own slots -> (N, M) (sequence
    parallelism: a rank's slots against the gathered depth-0 keys and its own deeper slots)."""
    if key_anchor is None:
        key_anchor, key_depth = anchor, depth
    q_anchor, k_anchor = anchor[:, None], key_anchor[None, :]
    context = (key_depth[None, :] == 0) & (k_anchor <= q_anchor)
    rollout = (k_anchor == q_anchor) & (key_depth[None, :] <= depth[:, None])
    visible = context | rollout
    if documents is not None:
        visible &= documents[anchor.clamp_min(0)][:, None] == documents[key_anchor.clamp_min(0)][None, :]
    return visible
