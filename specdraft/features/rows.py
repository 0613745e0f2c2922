"""A row of a feature cache is one conversation, named by its content: the same token ids and
labels are the same row whatever file, order or packing they come in (a cache is never tied to
the row order of one dataset)."""

from __future__ import annotations

import hashlib

import numpy as np

KEY_BYTES = 16


def row_key(token_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    digest.update(np.ascontiguousarray(token_ids, dtype=np.uint32).tobytes())
    digest.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return digest.digest()


def row_keys(data) -> list:
    """The key of every conversation of whole-packed data (data/whole_packing.py), by row index."""
    return [row_key(*data.conversation(row)) for row in range(len(data.lengths))]
