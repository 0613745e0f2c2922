"""The learning rate of every optimizer update: linear warmup to the peak, then cosine decay.

Update k (1-based) runs at `learning_rate * lr_ratio(k, ...)`:

    k <= warmup:   k / warmup                       update 1 moves the weights; update `warmup` is the peak
    k >  warmup:   cosine from 1 to min_lr_ratio    over updates warmup+1 .. total (+1), never reaching 0 inside the run

Why not DeepSpeed's WarmupCosineLR: it starts at iteration -1 (rate 0) and its first step lands on
iteration 0 (linear warmup 0 / w = 0), so updates 1 and 2 of every run changed nothing, whatever
`warmup_steps` was.

The scheduler's checkpointed state is the number of updates taken; the schedule's shape comes
from the run's config, as it did with DeepSpeed's (whose state was `last_batch_iteration`, which
a slot written before this module still holds: update n ran at iteration n - 2, and n updates
leave `last_batch_iteration` at n - 1).
"""

from __future__ import annotations

import math
from specdraft.errors import SpecdraftError


def lr_ratio(update: int, warmup: int, total: int, min_ratio: float) -> float:
    """The fraction of the peak learning rate that 1-based update `update` runs at."""
    if update <= warmup:
        return update / warmup
    progress = min(1.0, (update - warmup - 1) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """Sets every param group's lr before each update; DeepSpeed calls step() after it and
    carries state_dict() in the checkpoint."""

    def __init__(self, optimizer, warmup: int, total: int, min_ratio: float):
        self.optimizer = optimizer
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.updates = 0  # taken so far
        self._apply()

    def _apply(self) -> None:
        ratio = lr_ratio(self.updates + 1, self.warmup, self.total, self.min_ratio)
        for group, peak in zip(self.optimizer.param_groups, self.peaks):
            group["lr"] = peak * ratio

    def step(self, *_, **__) -> None:
        self.updates += 1
        self._apply()

    def lr_of_last_update(self) -> float:
        """What the most recent update ran at (the first group's peak times its ratio): the rate a
        step's log line reports."""
        return self.peaks[0] * lr_ratio(max(self.updates, 1), self.warmup, self.total, self.min_ratio)

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        if "updates" in state:
            self.updates = int(state["updates"])
        elif "last_batch_iteration" in state:  # DeepSpeed's WarmupCosineLR, in a slot saved before this module
            self.updates = int(state["last_batch_iteration"]) + 1
        else:
            raise SpecdraftError(
                f"the slot's lr_scheduler state holds {sorted(state)}: neither specdraft's schedule "
                "(updates) nor DeepSpeed's WarmupCosineLR (last_batch_iteration); it was not written by specdraft"
            )
        self._apply()  # after the optimizer's own load, which brought back the saved lr
