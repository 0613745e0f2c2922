"""Files and directories that appear whole or not at all, and stay after a power loss.

    write_atomic(path, text | bytes | writer)   temp file + fsync + rename + fsync(dir)
    temp_dir_beside(final_dir)                  a fresh temp directory to build a directory in
    publish_dir(tmp_dir, final_dir)             fsync every file, rename, fsync(parent)

A reader sees the old content or the new, never a mix; the temp name is next to the final one
(same filesystem, so the rename is atomic). Temp names are fresh per call (`.<name>.<random>.tmp`,
created exclusively), so they never take, or delete, a file of the user's such as `X.tmp` or
`X.old`, and two writers of one path never share one.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Union

Content = Union[str, bytes, Callable[[Path], None]]  # a writer is called with the temp path
TEMP_SUFFIX = ".tmp"
ASIDE_SUFFIX = ".old"


def fresh_name(path: Path, suffix: str = TEMP_SUFFIX) -> Path:
    """A hidden name beside `path` that nothing holds now: `.<name>.<random><suffix>`."""
    while True:
        candidate = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        if not os.path.lexists(candidate):
            return candidate


def temp_target(name: str) -> "str | None":
    """The final name a temp name of fresh_name's form stands for, None for any other name."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return None
    final = name[1 : -len(TEMP_SUFFIX)].rsplit(".", 1)[0]
    return final if is_temp_of(name, final) else None


def is_temp_of(name: str, final_name: str) -> bool:
    """Whether `name` is one of our temp names for `final_name` (fresh_name's form)."""
    prefix = f".{final_name}."
    return name.startswith(prefix) and name.endswith(TEMP_SUFFIX) and len(name) == len(prefix) + 8 + len(TEMP_SUFFIX)


def write_atomic(path, content: Content) -> None:
    path = Path(path)
    while True:  # created exclusively (mode 0o666 less the umask, as a plain open would)
        tmp = fresh_name(path)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
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


def temp_dir_beside(final_dir) -> Path:
    """A new empty directory next to `final_dir` (its parents created), ours alone to fill and
    to delete on failure."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = fresh_name(final_dir)
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def publish_dir(tmp_dir, final_dir) -> None:
    """Rename a finished temp directory into place (replacing an existing one of ours, which is
    moved aside under a fresh name and removed only after the new one is durable)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    fsync_tree(tmp_dir)
    old = None
    if final_dir.exists():  # rename cannot replace a non-empty directory: move the old one aside
        old = fresh_name(final_dir, ASIDE_SUFFIX)
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
