"""Where training metrics go: metrics.jsonl, TensorBoard, and W&B when configured (rank 0 only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

from omegaconf import DictConfig, OmegaConf

from specdraft.errors import SpecdraftError, write_error


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: DictConfig, enabled: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        try:
            self._jsonl = open(self.path, "a", encoding="utf-8")
        except OSError as err:
            raise write_error(err, self.path, "opening the metrics log") from err
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))
        if cfg.wandb.project:
            self._wandb = _start_wandb(cfg, run_dir)

    def log(self, step: int, values: Dict[str, float]) -> None:
        if not self.enabled:
            return
        try:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        except OSError as err:  # a full disk: one line naming the file (every rank stops: run_shared)
            raise write_error(err, self.path, "writing metrics") from err
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(cfg: DictConfig, run_dir: Path) -> Optional[object]:
    try:
        import wandb
    except ImportError:
        raise SpecdraftError("key 'wandb.project' is set but wandb is not installed "
                             "(pip install 'specdraft[wandb]')") from None
    os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)  # offline: no network, sync later
    return wandb.init(project=cfg.wandb.project, name=cfg.wandb.run_name, dir=str(run_dir),
                      config=OmegaConf.to_container(cfg, resolve=True), mode=cfg.wandb.mode)
