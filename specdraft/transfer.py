"""Host tensors onto the model's device without stalling the host.

A CUDA copy from pageable (ordinary) host memory is synchronous: the host waits until the GPU has
taken the bytes, i.e. until the queue ahead of it has drained. A copy from pinned memory with
non_blocking=True is queued and returns at once. The training step's host-side tensors (the
batch, the rows a loss counts, DFlash's blocks) go through here.
"""

from __future__ import annotations

import torch


def can_pin() -> bool:
    """Pinning needs an accelerator runtime (a CPU-only torch raises on pin_memory())."""
    return torch.accelerator.is_available()


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """x (on the host, or already on `device`) -> on `device`; from the host: pinned, then an
    asynchronous copy (the caching host allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if x.device == device or device.type == "cpu":
        return x.to(device)
    if x.device.type == "cpu" and can_pin() and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
