"""A deterministic, rank-sharded batch sampler whose position survives a change of world size.

Every epoch is a permutation of all sequences drawn from (seed, epoch), cut into global batches
of `global_batch = batch_size x world_size x accumulation` sequences, one per optimizer step. The
k-th micro-batch of a step (k = micro_step x world_size + rank) is the k-th slice of batch_size
sequences of that global batch, so which sequences form a micro-batch does not depend on how
they are spread over ranks and accumulation steps.

The position is global: (epoch, sequences consumed this epoch by all ranks). A resume with
another world size, same global batch, continues at the next unseen sequence: none repeated,
none skipped.
"""

from __future__ import annotations

import numpy as np

from specdraft.errors import SpecdraftError


class ShardedBatchSampler:
    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, accumulation: int = 1):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * world_size * accumulation
        self.steps_per_epoch = num_samples // self.global_batch  # the tail of an epoch is dropped
        if self.steps_per_epoch == 0:
            raise SpecdraftError(
                f"data: {num_samples} sequences are too few for a global batch of "
                f"{self.global_batch} ({world_size} rank(s) x per_device_batch_size="
                f"{batch_size} x gradient_accumulation_steps={accumulation})"
            )
        self.epoch = 0
        self.position = 0  # sequences consumed this epoch, all ranks
        self._order_epoch = -1
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> np.ndarray:
        """This rank's next micro-batch (every rank calls it once per micro step)."""
        if self.position == self.steps_per_epoch * self.global_batch:
            self.epoch += 1
            self.position = 0
        start = self.position + self.rank * self.batch_size
        batch = self._epoch_order()[start : start + self.batch_size]
        self.position += self.batch_size * self.world_size
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise SpecdraftError(
                f"resume: the checkpoint was trained on {state['num_samples']} sequences, "
                f"the data now gives {self.num_samples}: data_files or max_seq_length changed"
            )
        if state["global_batch"] != self.global_batch or state["position"] % self.global_batch:
            raise SpecdraftError(
                f"resume: the checkpoint's global batch is {state['global_batch']} sequences, "
                f"this run's is {self.global_batch}"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
