"""Which export a path means: a draft export (its config.json), a run directory (its newest
step_<N>/ export), a several-draft run's step_<N>/<name>/, or a target model directory; and the
target an export was trained against (`specdraft eval`, the benches)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

from specdraft.checkpoint.draft_names import choose_draft
from specdraft.errors import SpecdraftError
from specdraft.export.files import read_export_config
from specdraft.rundir.layout import CONFIG_NAME, draft_part, exports, step_of


def _export_drafts(export_dir: Path) -> List[Optional[str]]:
    """[None] for a draft export; the names of a several-draft run's step_<N>/<name>/ exports."""
    if (export_dir / CONFIG_NAME).is_file():
        return [None]
    # a run's own step_<N>/ exports hold a config.json too: they are steps, not drafts
    return sorted(
        p.name for p in export_dir.iterdir() if p.is_dir() and (p / CONFIG_NAME).is_file() and step_of(p.name) is None
    )


def _newest_export(run_dir: Path) -> Path:
    """A run's newest step_<N>/ export (run_dir itself when it is a several-draft run's step_<N>/)."""
    if _export_drafts(run_dir):
        return run_dir
    steps = [d for d in exports(run_dir) if _export_drafts(d)]
    if not steps:
        raise SpecdraftError(
            f"{run_dir}: neither a draft export (no {CONFIG_NAME}) nor a run directory (no step_<N>/ exports)"
        )
    return steps[-1]


def run_draft_names(path, name: Optional[str] = None) -> List[Optional[str]]:
    """The drafts `specdraft eval PATH [--draft NAME]` evaluates: [None] for a draft export or a
    one-draft run; [name], or every draft of a several-draft run's newest export."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG_NAME).is_file():
        return [choose_draft([None], name, "eval")]
    names = _export_drafts(_newest_export(path))
    if name is None and names != [None]:
        return names
    return [choose_draft(names, name, "eval")]


def resolve_export(path, target=None, draft_name: Optional[str] = None) -> Tuple[Optional[Path], Path]:
    """(export_dir or None, target_dir) for a run dir, an export dir or a target model dir.
    target: the target model directory to use instead of the one the export records (the
    absolute path it was trained at, which another machine does not have). draft_name: the
    draft of a several-draft run (required there)."""
    path = Path(path)
    if not path.exists():
        raise SpecdraftError(f"{path}: not found")
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        path = _newest_export(path)
        path = draft_part(path, choose_draft(_export_drafts(path), draft_name, "eval"))
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecdraftError(f"{path / CONFIG_NAME}: not readable JSON ({err})") from None
    if "architecture" not in config:  # a Hugging Face model directory: the target itself
        return None, path
    config = read_export_config(path)
    if target is not None:
        if not (Path(target) / CONFIG_NAME).is_file():
            raise SpecdraftError(f"--target {target}: not a model directory (no {CONFIG_NAME})")
        return path, Path(target)
    recorded = (config.get("target") or {}).get("path")
    if not recorded:
        raise SpecdraftError(f"{path / CONFIG_NAME}: names no target model; pass --target DIR")
    if not (Path(recorded) / CONFIG_NAME).is_file():
        raise SpecdraftError(
            f"{path / CONFIG_NAME}: the target it was trained with, {recorded}, is not there "
            f"(no {CONFIG_NAME}); pass --target DIR"
        )
    return path, Path(recorded)
