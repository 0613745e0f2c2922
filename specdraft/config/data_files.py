"""The data a configuration names: `data_files` resolved to files, and the ranks that read distinct
batches of it."""

from __future__ import annotations

import glob
import os
from typing import Any, List

from omegaconf import DictConfig, OmegaConf

from specdraft.errors import SpecdraftError


def data_world(cfg: DictConfig, world_size: int) -> int:
    """The ranks reading distinct batches: the ranks of one sequence-parallel group read the same."""
    return world_size // cfg.get("sequence_parallel_size", 1)


def resolve_data_files(spec: Any, source: str = "config", key: str = "key 'data_files'") -> List[str]:
    """A path, a glob or a list of them -> sorted unique existing files; a miss is an error, and
    so is a directory (its files are not guessed)."""
    items = list(spec) if OmegaConf.is_list(spec) or isinstance(spec, (list, tuple)) else [spec]
    files: List[str] = []
    for item in items:
        item = str(item)
        if os.path.isdir(item):
            raise SpecdraftError(
                f"{source}: {key}: {item} is a directory; name its files or a glob such as "
                f"{os.path.join(item, '*.jsonl')}"
            )
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise SpecdraftError(f"{source}: {key}: no file matches {item}")
        files.extend(matches)
    if not files:
        raise SpecdraftError(f"{source}: {key}: no input files given")
    return list(dict.fromkeys(files))
