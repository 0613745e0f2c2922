"""Where demo assets live, how a directory is published only once complete, how builds log."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from transformers.utils import logging as hf_logging

from specdraft.errors import SpecdraftError

STAMP = "specdraft_demo.json"  # written last into every built directory: what it was built from


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def no_progress_bars():
    """transformers' per-shard tqdm bars would interleave with the build's own log lines."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def stamp_matches(stamp: dict | None, expected: dict) -> bool:
    """Whether a build's stamp (read_stamp; None: no complete build) records every `expected` input."""
    return stamp is not None and all(stamp.get(k) == v for k, v in expected.items())


def reuse_or_build(out_dir: Path, expected: dict, build, what: str, log=log_stderr) -> None:
    """Keep out_dir when its stamp records every `expected` input; else remove what is there
    (remove_stale) and call build(), which writes it under a new stamp (building)."""
    if stamp_matches(read_stamp(out_dir), expected):
        log(f"[demo] reusing cached {what} {out_dir}")
    else:
        remove_stale(out_dir, log)
        build()


@contextlib.contextmanager
def building(out_dir: Path, stamp: dict, log=log_stderr):
    """Yield a temp dir next to `out_dir`; on success write `stamp` and rename it into place.

    `stamp` is written when the block ends, so the block may add results to it (row counts).

    A crash leaves no half-written `out_dir` behind (the temp dir is removed), so existence of
    `out_dir` means complete. If another process published `out_dir` first, its copy is kept.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SpecdraftError(f"{out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        _make_readable(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if read_stamp(out_dir) is None:
                raise
            log(f"{out_dir} was built concurrently by another process; keeping that copy")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale(directory: Path, log=log_stderr) -> None:
    """Delete a previously built asset directory — only one this module wrote (it has a stamp)."""
    if not directory.exists():
        return
    if read_stamp(directory) is None:
        raise SpecdraftError(
            f"{directory} exists but was not built by `specdraft demo` "
            f"(no {STAMP}); move it away or set SPECDRAFT_HOME elsewhere"
        )
    log(f"{directory} was built from different settings; rebuilding it")
    shutil.rmtree(directory)


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and some writers create 0600 files; a cache is as readable as any
    # file this user creates (umask applies).
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
