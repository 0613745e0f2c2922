"""Files and directories that appear whole or not at all, and stay after a power loss.

    write_atomic(path, text | bytes | writer)   temp file + fsync + rename + fsync(dir)
    publish_dir(tmp_dir, final_dir)            fsync every file, rename, fsync(parent)

A reader sees the old content or the new, never a mix; the temp name is next to the final one
(same filesystem, so the rename is atomic).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Union

Content = Union[str, bytes, Callable[[Path], None]]  # a writer is called with the temp path


def write_atomic(path, content: Content) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave a stray temp file
        raise
    fsync_dir(path.parent)


def publish_dir(tmp_dir, final_dir) -> None:
    """Rename a finished temp directory into place (replacing an existing one, which is removed
    only after the new one is durable)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    fsync_tree(tmp_dir)
    old = None
    if final_dir.exists():  # rename cannot replace a non-empty directory: move the old one aside
        old = final_dir.with_name(final_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old)


def fsync_file(path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory) -> None:
    for root, dirs, files in os.walk(directory):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(root)
