"""Every RNG of this rank, saved with each checkpoint and restored on resume (exact resume).

Python, numpy and torch's CPU generator, plus the accelerator's generator of every device the
rank can see (CUDA keeps one per device), read through DeepSpeed's accelerator API. All of it in
types torch.load(weights_only=True) accepts.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def _device_accelerator():
    """DeepSpeed's accelerator when it has device generators of its own; None on the CPU one
    (whose "device" RNG is torch's CPU generator, saved already)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" or not accelerator.is_available():
        return None
    return accelerator


def rng_state() -> dict:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    accelerator = _device_accelerator()
    devices = [] if accelerator is None else [accelerator.get_rng_state(i) for i in range(accelerator.device_count())]
    return {
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "devices": devices,
    }  # (device_count,) byte tensors, index = device index


def set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    accelerator = _device_accelerator()
    if accelerator is not None:
        # a checkpoint from a CPU run (no device states) leaves the device generators as seeded
        for index, device_state in enumerate(state.get("devices", [])[: accelerator.device_count()]):
            accelerator.set_rng_state(device_state, index)
