"""Draft-only exports: the draft's weights without the target, in files a user can ship.

step_<N>/
  draft_model_weights.pth    state dict, `draft_model.` prefix stripped (LongSpec's layout)
  model.safetensors          the same tensors
  config.json                what rebuilds the draft: architecture, dims, target path + hash
  target_heads.safetensors   (optional) the target's embed_tokens / lm_head, for a standalone draft
  <format>/                  the draft in a serving engine's own format (the family's
                             serving_formats, e.g. speculators/ for vLLM)
  tokenizer files, training_config.yaml
  <format>/                  each serving format of the draft's family (e.g. speculators/, sglang/):
                             the files that engine loads (config.json + model.safetensors)
The directory is written under a temp name and renamed: it exists whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from specdraft import __version__
from specdraft.config import config_hash
from specdraft.drafts.io import CONFIG_NAME, PTH_NAME, SAFETENSORS_NAME, TARGET_HEADS_NAME
from specdraft.errors import SpecdraftError
from specdraft.train.model import DRAFT_PREFIX


def extract_and_rename(state_dict: Dict[str, torch.Tensor], prefix: str = DRAFT_PREFIX) -> "OrderedDict[str, torch.Tensor]":
    """Keep the keys under `prefix`, with the prefix stripped."""
    return OrderedDict((key[len(prefix):], value) for key, value in state_dict.items() if key.startswith(prefix))


def gather_draft_state_dict(engine) -> Optional[Dict[str, torch.Tensor]]:
    """The draft's full weights (CPU copies, no prefix) on rank 0, None elsewhere; every rank
    must call. Under ZeRO-3 only the draft's parameters are gathered, never the target's."""
    import torch.distributed as dist

    from specdraft.train.engine import gathered

    draft = engine.module.draft_model
    with gathered(list(draft.parameters())):
        if dist.get_rank() != 0:
            return None
        return {name: t.detach().clone().cpu() for name, t in draft.state_dict().items()}


NATIVE_FILES = ("pth", "safetensors")


def serving_formats(draft, cfg: DictConfig) -> Sequence[str]:
    """The serving formats a save writes: `export_formats` from the config, else the family's."""
    configured = cfg.get("export_formats")
    return list(configured) if configured is not None else draft.default_serving_formats()


def write_draft_export(out_dir: Path, state_dict: Dict[str, torch.Tensor], draft, cfg: DictConfig,
                       tokenizer=None, formats=NATIVE_FILES, target_heads=None,
                       serving: Optional[Sequence[str]] = None) -> Path:
    """Write a complete draft export directory atomically (rank 0 only).

    formats: which native weight files (pth, safetensors). serving: the serving formats written
    into subdirectories (None: serving_formats(draft, cfg)). target_heads: optional
    {"embed_tokens.weight", "lm_head.weight"} from the target, written to their own file so the
    draft's weights still load strictly on their own.
    """
    from safetensors.torch import save_file

    serving = serving_formats(draft, cfg) if serving is None else serving
    for name in serving:  # checked before anything is written
        if name not in draft.serving_formats:
            raise SpecdraftError(f"export format {name!r}: a {draft.family} draft has no such serving format "
                                 f"(it has: {', '.join(['native', *draft.serving_formats])})")
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_file refuses tensors sharing memory: give each its own contiguous storage
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    if "pth" in formats:
        torch.save(tensors, tmp / PTH_NAME)
    if "safetensors" in formats:
        save_file(tensors, str(tmp / SAFETENSORS_NAME), metadata={"format": "pt"})
    if target_heads is not None:
        save_file({k: v.contiguous().clone() for k, v in target_heads.items()}, str(tmp / TARGET_HEADS_NAME))
    for name, writer in draft.serving_formats.items():  # e.g. speculators/ for vLLM
        writer(draft, tensors, tmp / name, os.path.abspath(cfg.target))
    description = dict(draft.export_config(), specdraft_version=__version__,
                       target={"path": os.path.abspath(cfg.target), "config_hash": config_hash(cfg)},
                       dtype=str(next(iter(tensors.values())).dtype).replace("torch.", ""))
    (tmp / CONFIG_NAME).write_text(json.dumps(description, indent=2))
    OmegaConf.save(cfg, tmp / "training_config.yaml", resolve=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    for name in serving:
        draft.serving_formats[name](draft, tensors, tmp / name, str(cfg.target))
    _fsync_tree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


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
