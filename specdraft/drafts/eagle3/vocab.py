"""EAGLE-3's draft vocabulary: the N target tokens most frequent at loss-masked positions.

    used = sorted(top N target ids)                     (ties and padding: the lower id first)
    d2t[i] = used[i] - i        (N,) int64    target_id = draft_id + d2t[draft_id]
    t2d[v] = v in used          (V,) bool

Counted by streaming the memory-mapped packed cache block by block: every rank counts the same
file the same way, so the maps agree without a collective, and no rank loads the dataset.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

ROWS_PER_BLOCK = 4096  # sequences read per step of the count (bounded memory)


def count_target_tokens(data, vocab_size: int) -> np.ndarray:
    """(V,) int64 occurrences of each target id among the loss-masked tokens of `data` (PackedData)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(data), ROWS_PER_BLOCK):
        tokens = np.asarray(data.tokens[start : start + ROWS_PER_BLOCK])
        mask = np.asarray(data.loss_mask[start : start + ROWS_PER_BLOCK]).astype(bool)
        ids = tokens[mask].astype(np.int64)
        ids = ids[ids < vocab_size]  # tokenizer-only ids beyond the model's vocab are never predicted
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def vocab_maps(counts: np.ndarray, draft_vocab_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d2t (N,) int64, t2d (V,) bool) from per-id counts."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first, lower id on ties
    used = np.sort(order[:draft_vocab_size])
    d2t = torch.from_numpy(used - np.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(N,) the target id of each draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def vocab_disagreement(counts: np.ndarray, t2d: torch.Tensor) -> str:
    """One line for the log of a run that imported its maps: how many of the data's own top N
    tokens (counts: vocab_maps' input; only tokens the data has) fall outside t2d, and the share
    of the data's tokens each vocabulary covers."""
    n = int(t2d.sum())
    _, own_t2d = vocab_maps(counts, n)
    top = own_t2d & torch.from_numpy(counts > 0)  # vocab_maps pads with unseen ids: not the data's
    outside = int((top & ~t2d).sum())
    total = max(int(counts.sum()), 1)
    covered, own = (float(counts[m.numpy()].sum()) / total for m in (t2d, top))
    return (
        f"{outside} of the data's {int(top.sum())} most frequent answer tokens are outside the imported draft "
        f"vocabulary of {n} (it covers {covered:.1%} of the data's answer tokens, the data's own top {n} would "
        f"cover {own:.1%}); the imported d2t/t2d are kept, not recounted"
    )
