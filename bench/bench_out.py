"""An --out directory a bench owns: the benches that retrain runs under --out/<preset> (deleting
what a run left there) write a marker into it, and refuse a non-empty directory without one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdraft.errors import SpecdraftError  # noqa: E402

# written in --out/<preset> when the bench makes it: the runs there are the bench's, trained anew
# each time; a non-empty directory without it is someone else's, and nothing in it is deleted
BENCH_MARKER = "specdraft_bench.json"


def check_bench_out(out: Path) -> None:
    """--out/<preset>: new, empty, or one this bench wrote (its marker); else one line, before
    anything is written or deleted."""
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out: {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / BENCH_MARKER).is_file():
        raise SpecdraftError(
            f"--out: {out} exists, is not empty and was not written by this bench (no {BENCH_MARKER}); "
            f"the bench retrains the runs in it, so it never writes there: choose a new or empty --out"
        )


def mark_bench_out(out: Path, script: str = "bench/acceptance.py") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / BENCH_MARKER).write_text(json.dumps({"written_by": script}) + "\n")
