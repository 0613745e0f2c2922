"""regenerate's output: complete rows written to shards atomically (a shard appears whole or not at
all, named per rank and run, never overwritten), and the rows the committed shards already hold
(what a rerun skips)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from specdraft.rundir.atomic import is_temp_of, write_atomic

SHARD_GLOB = "shard-*.jsonl"


class ShardWriter:
    """Completed rows -> atomically written shards, named per rank and run (never overwritten)."""

    def __init__(self, out: Path, rank: int, rows_per_shard: int, ready: Callable[[], bool] = lambda: True):
        self.out, self.rows_per_shard, self.ready = out, rows_per_shard, ready
        # a run killed mid-write (SIGKILL, power loss) leaves its shard's temp file: never a
        # shard, so this rank's rerun removes it (each rank only its own: they run at once)
        for stale in out.glob(f".shard-r{rank:03d}-*.jsonl.*.tmp"):  # atomic.fresh_name's form
            if is_temp_of(stale.name, stale.name[1:].rsplit(".", 2)[0]):
                stale.unlink(missing_ok=True)
        self.prefix = f"shard-r{rank:03d}-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
        self.pending: List[dict] = []
        self.count = 0

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.pending or not self.ready():  # not ready: no manifest, so no shard (a rerun redoes them)
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.pending)
        write_atomic(self.out / f"{self.prefix}-{self.count:05d}.jsonl", text)
        self.count += 1
        self.pending.clear()


def written_keys(out: Path) -> Dict[Tuple[str, str, int], Tuple[int, int]]:
    """(file, id, sample) -> (answer tokens, truncated answers) of every row in the committed shards."""
    keys = {}
    for path in sorted(out.glob(SHARD_GLOB)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                answers = [m for m in row["conversations"] if m["role"] == "assistant"]
                keys[(row.get("file", ""), str(row["id"]), row["sample"])] = (
                    sum(len(m.get("token_ids") or ()) for m in answers),
                    sum(bool(m.get("truncated")) for m in answers),
                )
    return keys
