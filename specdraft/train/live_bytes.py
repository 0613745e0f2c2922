"""The tensors a step really holds, on CPU: the peak of live tensor storage bytes, what a GPU's
caching allocator would hold for the same code (no allocator slack, no RSS of freed pages). The
memory model's terms (train/memory.py) are checked against it: tests/test_memory.py at one rank,
tests/test_sequence_parallel.py per rank at SP=2, `bench/long_context.py --live`.

    with LiveTensorBytes() as live:
        model(ids, mask).loss.backward()
    live.peak  # bytes
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of CPU tensor storages allocated under this mode and still alive (an op's
    output that shares an input's storage, a view or detach of a parameter, allocates nothing):
    what a GPU's allocator would hold."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.storages and key not in inputs:
                self.storages.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key, size):
        self.live -= size
        self.storages.discard(key)
