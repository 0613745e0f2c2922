"""A filesystem every rank shares: waiting for a file another rank wrote, and the one-line error when
it never shows (a run directory or data cache on node-local disks)."""

from __future__ import annotations

import time
from pathlib import Path

from specdraft.errors import SpecdraftError

VISIBLE_WAIT_S = 10.0  # how long a rank waits for another rank's file (NFS attribute caches)


def wait_visible(path: Path) -> bool:
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while not path.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def not_shared_error(ckpt_dir: Path, rank: int, what: str) -> SpecdraftError:
    return SpecdraftError(
        f"{ckpt_dir}: rank {rank} cannot see {what}: the checkpoint directory (output_dir) "
        f"must be on a filesystem every node shares, at the same path"
    )
