"""A deterministic, rank-sharded batch sampler whose position can be saved and restored.

Every epoch is a permutation of all sequences drawn from (seed, epoch); each rank takes its own
contiguous slice. The position is (epoch, batch index), so a resume jumps straight to the next
batch without re-reading the skipped ones.
"""

from __future__ import annotations

import numpy as np

from specdraft.errors import SpecdraftError


class ShardedBatchSampler:
    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = num_samples // world_size
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise SpecdraftError(f"data: {num_samples} sequences are too few for {world_size} rank(s) x "
                                 f"per_device_batch_size={batch_size}")
        self.epoch = 0
        self.batch_index = 0
        self._shard_epoch = -1
        self._shard = None

    def _rank_shard(self) -> np.ndarray:
        if self._shard_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            self._shard = order[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
            self._shard_epoch = self.epoch
        return self._shard

    def next_batch(self) -> np.ndarray:
        if self.batch_index == self.batches_per_epoch:
            self.epoch += 1
            self.batch_index = 0
        start = self.batch_index * self.batch_size
        batch = self._rank_shard()[start:start + self.batch_size]
        self.batch_index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "world_size": self.world_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise SpecdraftError(f"resume: the checkpoint was trained on {state['num_samples']} sequences, "
                                 f"the data now gives {self.num_samples}: data_files or max_seq_length changed")
        self.epoch = state["epoch"]
        # Position in samples seen this epoch, mapped onto this run's batch geometry.
        seen = state["batch_index"] * state["batch_size"] * state["world_size"]
        self.batch_index = min(seen // (self.batch_size * self.world_size), self.batches_per_epoch)
