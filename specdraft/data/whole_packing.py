"""Whole conversations packed into windows (`packing: whole`), as speculators and SpecForge do.

The packed cache's flat files hold every conversation one after another (data/packing.py). Here
each conversation is placed whole into one window of max_seq_length tokens, best fit, longest
first; one longer than a window keeps its first max_seq_length tokens. A window's tail is padding:
token PAD_ID, no label, a document of its own (attention never reaches it from a conversation).
No conversation is cut by a window border, so no answer is trained without its prompt, and a
conversation's target features are the same whatever it is packed beside (what a per-row feature
cache relies on: features/).

Nothing is copied: a window is gathered from the flat memory maps when a batch asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch

from specdraft.data.packing import TOKEN_DTYPE

PAD_ID = 0  # never a label and alone in its document: any id computes nothing a loss reads


def conversation_bounds(cache_dir: Path, meta: dict) -> Tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) in the flat files of every conversation, in the order they were written."""
    total = meta["tokens"]
    starts_flag = np.memmap(Path(cache_dir) / "doc_start.bin", dtype=np.uint8, mode="r", shape=(total,))
    starts = np.flatnonzero(starts_flag).astype(np.int64)
    lengths = np.diff(np.append(starts, total))
    return starts, lengths


def best_fit(lengths: np.ndarray, window: int) -> List[List[int]]:
    """Conversation indices per window: longest first, each into the window with the least room
    that still holds it (a new window when none does); a conversation longer than `window` takes
    one of its own. Deterministic: ties go to the lower index, then the older window."""
    used = np.minimum(lengths, window)
    order = np.lexsort((np.arange(len(used)), -used))
    windows: List[List[int]] = []
    room_count = np.zeros(window + 1, dtype=np.int64)  # windows with exactly this much room left
    by_room: List[List[int]] = [[] for _ in range(window + 1)]  # their ids, oldest first
    for row in order:
        need = int(used[row])
        fits = np.flatnonzero(room_count[need:])
        if len(fits):
            room = need + int(fits[0])
            w = by_room[room].pop(0)
            room_count[room] -= 1
        else:
            room, w = window, len(windows)
            windows.append([])
        windows[w].append(int(row))
        left = room - need
        by_room[left].append(w)
        by_room[left].sort()
        room_count[left] += 1
    return windows


@dataclass
class Placement:
    row: int  # the conversation's index (flat order)
    offset: int  # its first token's position in the window
    length: int  # tokens of it in the window (<= its length: the window's size cuts a longer one)


class WholePackedData:
    """PackedData's interface (len, batch, tokens / loss_mask row slices, meta) over whole-
    conversation windows of the same flat files."""

    def __init__(self, cache_dir: Path, meta: dict):
        self.cache_dir = Path(cache_dir)
        window = meta["max_seq_length"]
        total = meta["tokens"]
        self.flat_tokens = np.memmap(self.cache_dir / "tokens.bin", dtype=TOKEN_DTYPE, mode="r", shape=(total,))
        self.flat_mask = np.memmap(self.cache_dir / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(total,))
        self.starts, self.lengths = conversation_bounds(self.cache_dir, meta)
        self.window = window
        self.windows = best_fit(self.lengths, window)
        kept = int(np.minimum(self.lengths, window).sum())
        self.meta = dict(
            meta,
            packing="whole",
            sequences=len(self.windows),
            truncated_tokens=int(self.lengths.sum()) - kept,
            padding_tokens=len(self.windows) * window - kept,
        )
        self.tokens = _Rows(self, "tokens")
        self.loss_mask = _Rows(self, "loss_mask")

    def __len__(self) -> int:
        return len(self.windows)

    def describe(self) -> str:
        """The windows, and the tokens lost to truncation and padding (train's log, `specdraft data`)."""
        return (
            f"packing whole: {len(self)} windows of {self.window} tokens, {self.meta['truncated_tokens']} tokens "
            f"cut from conversations longer than a window, {self.meta['padding_tokens']} tokens of padding"
        )

    def placements(self, window: int) -> List[Placement]:
        out, offset = [], 0
        for row in self.windows[window]:
            length = int(min(self.lengths[row], self.window))
            out.append(Placement(row, offset, length))
            offset += length
        return out

    def conversation(self, row: int) -> Tuple[np.ndarray, np.ndarray]:
        """(token ids, loss mask) of a whole conversation, untruncated."""
        start, length = int(self.starts[row]), int(self.lengths[row])
        return self.flat_tokens[start : start + length], self.flat_mask[start : start + length]

    def _window_arrays(self, window: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        ids = np.full(self.window, PAD_ID, dtype=np.int64)
        mask = np.zeros(self.window, dtype=np.int64)
        starts = np.zeros(self.window, dtype=bool)
        end = 0
        for place in self.placements(window):
            start = int(self.starts[place.row])
            end = place.offset + place.length
            ids[place.offset : end] = self.flat_tokens[start : start + place.length]
            mask[place.offset : end] = self.flat_mask[start : start + place.length]
            starts[place.offset] = True
        if end < self.window:
            starts[end] = True  # the padding: a document of its own
        return ids, mask, starts, end

    def batch(self, indices) -> dict:
        arrays = [self._window_arrays(int(w)) for w in np.asarray(indices)]
        ids = np.stack([a[0] for a in arrays])
        mask = np.stack([a[1] for a in arrays])
        starts = np.stack([a[2] for a in arrays])
        filled = np.array([a[3] for a in arrays])
        index = np.arange(self.window)
        start_index = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "document_positions": torch.from_numpy(index - start_index),
            "document_ids": torch.from_numpy(np.cumsum(starts, axis=1) - 1),
            # the conversations' tokens, not the padding: what draft.distill_tokens all teaches
            "token_mask": torch.from_numpy((index[None, :] < filled[:, None]).astype(np.int64)),
        }


class _Rows:
    """data.tokens[a:b] / data.loss_mask[a:b]: windows a..b-1 as a (n, L) array (what code written
    for PackedData's memory maps reads, e.g. EAGLE-3's vocabulary count)."""

    def __init__(self, data: WholePackedData, field: str):
        self.data, self.field = data, field

    def __getitem__(self, rows: slice) -> np.ndarray:
        windows = range(*rows.indices(len(self.data)))
        column = 0 if self.field == "tokens" else 1
        return np.stack([self.data._window_arrays(w)[column] for w in windows]).reshape(len(windows), self.data.window)
