"""The draft export: a self-describing directory that rebuilds the draft without the trainer,
in files a user can ship (its layout: step_<N>/ in specdraft/rundir/layout.py). Written by training on rank 0
and by the offline commands (commands/export.py: `specdraft export`); read back
by `specdraft eval`, the benchmarks and tests, strictly (no key patching).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from specdraft import __version__
from specdraft.rundir.atomic import publish_dir, temp_dir_beside
from specdraft.config import config_hash
from specdraft.drafts.base import Draft
from specdraft.drafts.registry import draft_from_export_config
from specdraft.errors import SpecdraftError, write_failure
from specdraft.rundir.layout import (
    CONFIG_NAME,
    EXPORT,
    MARKER,
    PTH_NAME,
    SAFETENSORS_NAME,
    TARGET_HEADS_NAME,
    TRAINING_CONFIG_NAME,
    marker_text,
)


NATIVE_FILES = ("pth", "safetensors")


def serving_formats(draft, cfg: DictConfig) -> Sequence[str]:
    """The serving formats a save writes: `export_formats` from the config, else the family's."""
    configured = cfg.get("export_formats")
    if configured is None:
        return draft.default_serving_formats()
    for name in configured:  # refused at start-up, not at the first save after hours of training
        refusal = draft.serving_refusal(name)
        if refusal:
            raise SpecdraftError(f"key 'export_formats': {name}: {refusal}")
    return list(configured)


def write_draft_export(
    out_dir: Path,
    state_dict: Dict[str, torch.Tensor],
    draft,
    cfg: DictConfig,
    tokenizer=None,
    formats=NATIVE_FILES,
    target_heads=None,
    serving: Optional[Sequence[str]] = None,
    run_dir=None,
    step: Optional[int] = None,
) -> Path:
    """Write a complete draft export directory atomically (rank 0 only); its marker names the run
    and step it came from.

    formats: which native weight files (pth, safetensors). serving: the serving formats written
    into subdirectories (None: serving_formats(draft, cfg)). target_heads: optional
    {"embed_tokens.weight", "lm_head.weight"} from the target, written to their own file so the
    draft's weights still load strictly on their own.
    """
    serving = serving_formats(draft, cfg) if serving is None else serving
    for name in serving:  # checked before anything is written
        if name not in draft.serving_formats:
            raise SpecdraftError(
                f"export format {name!r}: a {draft.family} draft has no such serving format "
                f"(it has: {', '.join(['native', *draft.serving_formats])})"
            )
    # a symlink the user gave is followed, never replaced: the export lands where it points
    out_dir = Path(os.path.realpath(out_dir))
    origin = {"run": None if run_dir is None else os.path.abspath(run_dir), "step": step}
    tmp = None
    try:
        tmp = temp_dir_beside(out_dir)
        _write_export_files(tmp, state_dict, draft, cfg, tokenizer, formats, target_heads, serving, origin)
        publish_dir(tmp, out_dir)
    except Exception as err:  # a full disk: one line; earlier exports are untouched
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = write_failure(err, out_dir)
        if reason is None:
            raise
        raise SpecdraftError(f"{out_dir}: writing the draft export failed ({reason})") from err
    return out_dir


def _write_export_files(tmp: Path, state_dict, draft, cfg, tokenizer, formats, target_heads, serving, origin) -> None:
    from safetensors.torch import save_file

    # save_file refuses tensors sharing memory: give each its own contiguous storage
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    if "pth" in formats:
        torch.save(tensors, tmp / PTH_NAME)
    if "safetensors" in formats:
        save_file(tensors, str(tmp / SAFETENSORS_NAME), metadata={"format": "pt"})
    if target_heads is not None:
        save_file({k: v.contiguous().clone() for k, v in target_heads.items()}, str(tmp / TARGET_HEADS_NAME))
    for name in serving:  # e.g. speculators/ for vLLM, each with the run's training config
        draft.serving_formats[name](draft, tensors, tmp / name, str(cfg.target))
        OmegaConf.save(cfg, tmp / name / TRAINING_CONFIG_NAME, resolve=True)
    description = dict(
        draft.export_config(),
        specdraft_version=__version__,
        target={"path": os.path.abspath(cfg.target), "config_hash": config_hash(cfg)},
        dtype=str(next(iter(tensors.values())).dtype).replace("torch.", ""),
    )
    (tmp / CONFIG_NAME).write_text(json.dumps(description, indent=2))
    OmegaConf.save(cfg, tmp / TRAINING_CONFIG_NAME, resolve=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    (tmp / MARKER).write_text(marker_text(EXPORT, **origin))  # ours: `specdraft export` may replace it


# -- reading an export back ------------------------------------------------------------------------


def read_export_config(export_dir) -> Dict[str, Any]:
    path = Path(export_dir) / CONFIG_NAME
    if not path.is_file():
        raise SpecdraftError(f"{path}: not found (not a specdraft draft export)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpecdraftError(f"{path}: not valid JSON ({err.msg})") from None
    if "architecture" not in config or "dims" not in config:
        raise SpecdraftError(f"{path}: missing 'architecture' or 'dims' (not a specdraft draft export)")
    return config


def load_exported_draft(export_dir, dtype: torch.dtype = torch.float32) -> Tuple[Draft, Dict[str, Any]]:
    """Rebuild the draft from config.json and load its weights strictly (no key patching)."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    draft = draft_from_export_config(config)
    weights = export_dir / SAFETENSORS_NAME
    if weights.is_file():
        state_dict = load_file(str(weights))
    elif (export_dir / PTH_NAME).is_file():
        state_dict = torch.load(export_dir / PTH_NAME, map_location="cpu", weights_only=True)
    else:
        raise SpecdraftError(f"{export_dir}: neither {SAFETENSORS_NAME} nor {PTH_NAME} found")
    try:
        draft.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        raise SpecdraftError(f"{weights}: weights do not match config.json: {str(err).splitlines()[0]}") from None
    return draft.cast(dtype).eval(), config  # buffers (rotary inv_freq) stay as in training


class BackgroundExporter:
    """Writes draft exports on a worker thread, off the training path (rank 0).

    The gather (a collective) stays on the training path; only the file writes move. One export
    is in flight at a time; `wait()` re-raises a failed write and is called before the next
    submit and at the end of training.
    """

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdraft-export")
        self._pending = None

    def submit(self, fn, *args, **kwargs) -> None:
        self.wait()
        self._pending = self._pool.submit(fn, *args, **kwargs)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()
