"""Where training metrics go: metrics.jsonl, TensorBoard, and W&B when configured (rank 0 only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
import math
from typing import Dict, List, Optional, Tuple

import torch

from omegaconf import DictConfig, OmegaConf

from specdraft.drafts.base import DraftLoss
from specdraft.errors import SpecdraftError, write_error
from specdraft.parallel.collectives import all_reduce


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
        raise SpecdraftError(
            "key 'wandb.project' is set but wandb is not installed (pip install 'specdraft[wandb]')"
        ) from None
    os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)  # offline: no network, sync later
    return wandb.init(
        project=cfg.wandb.project,
        name=cfg.wandb.run_name,
        dir=str(run_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
        mode=cfg.wandb.mode,
    )


class LossWindow:
    """Token-weighted loss / accuracy sums and the draft's own metrics, kept as tensors on the
    loss's device as they come and reduced across ranks once per logging interval: one all-reduce
    and one host read per log, none per micro-batch (reading a CUDA value stalls the host)."""

    def __init__(self):
        self._open: Optional[torch.Tensor] = None  # (3,) float64: loss sum, tokens, correct of this step
        self._steps: List[torch.Tensor] = []  # one (3,) per optimizer step since the last reduce
        self.metrics = {}  # name -> [numerator, denominator], 0-dim tensors

    def add(self, out: DraftLoss) -> None:
        tokens = out.tokens.double()
        sums = torch.stack([out.loss.detach().double() * tokens, tokens, out.correct.double()])
        self._open = sums if self._open is None else self._open + sums
        for name, (numerator, denominator) in out.metrics.items():
            pair = self.metrics.setdefault(name, [0.0, 0.0])
            pair[0] = pair[0] + numerator.detach().double()
            pair[1] = pair[1] + denominator.detach().double()

    def end_step(self) -> None:
        self._steps.append(self._open)
        self._open = None

    def reduce(self) -> Tuple[List[float], dict]:
        """Every rank: (the mean loss of each step since the last reduce, the window's metrics)."""
        names = sorted(self.metrics)  # the same names on every rank: one family, one loss
        steps = torch.stack(self._steps)  # (steps, 3)
        extra = [
            torch.as_tensor(v, dtype=torch.float64, device=steps.device).reshape(())
            for name in names
            for v in self.metrics[name]
        ]
        flat = torch.cat([steps.flatten(), torch.stack(extra)]) if extra else steps.flatten()
        flat = all_reduce(flat).tolist()  # the one host sync
        n = steps.shape[0]
        totals = [flat[3 * i : 3 * i + 3] for i in range(n)]
        rest = flat[3 * n :]
        self._steps, self.metrics = [], {}
        loss_sum = sum(row[0] for row in totals)
        tokens = max(sum(row[1] for row in totals), 1.0)
        correct = sum(row[2] for row in totals)
        values = {"loss": loss_sum / tokens, "accuracy": correct / tokens}
        for i, name in enumerate(names):
            values[name] = rest[2 * i] / max(rest[2 * i + 1], 1.0)
        # perplexity is exp(CE): the loss itself when it is CE, its CE term under a distillation
        # objective (none without one)
        distilled = any(name.startswith("objective/") for name in names)
        ce = values.get("objective/ce") if distilled else values["loss"]
        if ce is not None:
            values["perplexity"] = math.exp(min(ce, 50.0))
        return [s / max(t, 1.0) for s, t, _ in totals], values
