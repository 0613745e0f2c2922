"""A run directory's layout: the one place that names its files.

run/
  specdraft.json             the marker: this directory is a specdraft run (written first)
  config.yaml                the resolved config of the run
  ckpt/step_<N>/             DeepSpeed state of the draft only (params, optimizer, scheduler)
  ckpt/step_<N>/draft_frozen.safetensors   the draft's untrained state (buffers such as EAGLE-3's
                             d2t/t2d, frozen parameters such as DFlash's mask_delta), exact dtypes:
                             DeepSpeed leaves frozen parameters out of the slot and its universal
                             conversion drops buffers, so our writer carries them itself
  ckpt/step_<N>/COMMITTED    written last by rank 0 after every rank fsynced its own files: step,
                             world size, ZeRO stage, batch geometry, target identity, sha256 of
                             every file in the slot
  ckpt/step_<N>.universal/   step_<N> in DeepSpeed's universal format (made by a resume at another
                             world size or ZeRO stage; reused by the next one), its own COMMITTED
  ckpt/step_<N>.rejected/    a slot that failed verification under resume=auto, moved aside
  ckpt/step_<N>.abandoned/   a slot later than the one a resume rolled back to (resume=RUN/ckpt/step_<M>,
                             M < N), moved aside with its export step_<N>.abandoned/: kept, never
                             resumed by resume=auto, never pruned
  ckpt/latest                newest committed slot name: a hint for people and tools
  step_<N>/                  the draft export written by training (export/files.py):
    model.safetensors          the draft's weights (no target tensors, no `draft_model.` prefix)
    draft_model_weights.pth    the same tensors as a torch state dict (LongSpec's file name)
    config.json                what rebuilds the draft: architecture, dims, target path + config hash
    target_heads.safetensors   (optional) the target's embed_tokens / lm_head, for a standalone draft
    <format>/                  each serving format of the draft's family (e.g. speculators/, sglang/):
                               the files that engine loads (config.json + model.safetensors)
    tokenizer files, training_config.yaml
    specdraft.json             the marker: an export specdraft wrote, naming its run and step
  export_step_<N>/           `specdraft export` (the same layout as step_<N>/)
  consolidated/step_<N>/     `specdraft consolidate`: draft_fp32.safetensors

What specdraft owns, and so may replace or add to, is decided here and only here (is_run_dir,
is_export_dir, is_regenerate_dir): a directory holding our marker file `specdraft.json` of that
kind; a run made before markers existed is one whose ckpt/ holds a committed slot. Everything else
a user points us at is theirs (specdraft/rundir/ownership.py refuses to write over it).

A run of several drafts (`drafts:` in its config) keeps one level more, a folder per draft name,
under one commit: ckpt/step_<N>/<name>/ (each draft's DeepSpeed state and untrained state; the one
COMMITTED at ckpt/step_<N>/ covers them all), ckpt/step_<N>.universal/<name>/, step_<N>/<name>/,
export_step_<N>/<name>/, consolidated/step_<N>/<name>/.

A slot without COMMITTED does not exist for resume (checkpoint/slots.py); an export directory is written
under a temp name and renamed, so it exists whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from specdraft import __version__

CONFIG_FILE = "config.yaml"
CKPT_DIR = "ckpt"
SLOT_PREFIX = "step_"
COMMITTED = "COMMITTED"
LATEST = "latest"
UNIVERSAL_SUFFIX = ".universal"
REJECTED_SUFFIX = ".rejected"
ABANDONED_SUFFIX = ".abandoned"
FROZEN_FILE = "draft_frozen.safetensors"
# the files of a draft export
SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
PTH_NAME = "draft_model_weights.pth"
TARGET_HEADS_NAME = "target_heads.safetensors"
TRAINING_CONFIG_NAME = "training_config.yaml"
# the marker of a directory specdraft owns: {"kind": RUN | EXPORT | REGENERATE, ...}
MARKER = "specdraft.json"
RUN, EXPORT, REGENERATE = "run", "export", "regenerate"


def slot_name(step: int) -> str:
    return f"{SLOT_PREFIX}{step}"


def step_of(name: str) -> Optional[int]:
    """The step of a slot or export name (step_<N>), None for any other name."""
    digits = name[len(SLOT_PREFIX) :]
    return int(digits) if name.startswith(SLOT_PREFIX) and digits.isdigit() else None


def slot_step(path: Path) -> int:
    return int(path.name[len(SLOT_PREFIX) :])


def config_file(run_dir) -> Path:
    return Path(run_dir) / CONFIG_FILE


def ckpt_dir(run_dir) -> Path:
    return Path(run_dir) / CKPT_DIR


def export_dir(run_dir, step: int) -> Path:
    """Where training writes the draft export of `step`."""
    return Path(run_dir) / slot_name(step)


def exports(run_dir) -> List[Path]:
    """The run's draft export directories (step_<N>/), oldest first."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(found, key=slot_step)


def offline_export_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / f"export_{slot_name(step)}"


def consolidated_file(run_dir, slot_dir: Path) -> Path:
    return Path(run_dir) / "consolidated" / slot_dir.name / "draft_fp32.safetensors"


def universal_dir(slot_dir: Path) -> Path:
    return slot_dir.with_name(slot_dir.name + UNIVERSAL_SUFFIX)


def draft_part(directory, name: Optional[str]) -> Path:
    """A draft's folder inside a slot, an export or a consolidated step: the directory itself for a
    one-draft run (name None), its <name>/ in a run of several drafts."""
    return Path(directory) if name is None else Path(directory) / name


# -- what specdraft owns --------------------------------------------------------------------------


def marker_text(kind: str, **fields) -> str:
    return json.dumps({"kind": kind, **fields, "specdraft_version": __version__}, indent=1)


def marker_kind(directory) -> Optional[str]:
    """The kind our marker in `directory` names; None without one we wrote (missing, unreadable,
    or a user's own `specdraft.json`: not our kinds, no specdraft_version)."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(marker, dict)
        or marker.get("kind") not in (RUN, EXPORT, REGENERATE)
        or "specdraft_version" not in marker
    ):
        return None
    return marker["kind"]


def committed_slots(ckpt: Path) -> List[Path]:
    """Slots with a COMMITTED marker, oldest first."""
    if not ckpt.is_dir():
        return []
    return sorted(
        (p for p in ckpt.iterdir() if p.is_dir() and step_of(p.name) is not None and (p / COMMITTED).is_file()),
        key=slot_step,
    )


def is_run_dir(path) -> bool:
    """A specdraft run: our run marker, or (a run from before markers) a committed checkpoint slot."""
    path = Path(path)
    return path.is_dir() and (marker_kind(path) == RUN or bool(committed_slots(ckpt_dir(path))))


def is_export_dir(path) -> bool:
    return Path(path).is_dir() and marker_kind(path) == EXPORT


def is_regenerate_dir(path) -> bool:
    return Path(path).is_dir() and marker_kind(path) == REGENERATE


def enclosing_run(path) -> Optional[Path]:
    """`path` itself or the nearest directory above it that is a specdraft run; None if none is."""
    path = Path(path).resolve()
    for directory in (path, *path.parents):
        if is_run_dir(directory):
            return directory
    return None


# `eval --plot` PNGs carry this in their "Software" text chunk: the mark of a plot we may replace
PLOT_SOFTWARE = "specdraft"


def is_our_plot(path) -> bool:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.text.get("Software", "").startswith(PLOT_SOFTWARE)
    except Exception:  # not an image, unreadable: not ours
        return False
