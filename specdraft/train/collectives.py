"""Collectives placed where the process group's backend needs their tensors.

NCCL (DeepSpeed's backend on CUDA) refuses CPU tensors and gloo refuses CUDA ones, so every
tensor collective of the loop goes through `all_reduce` here instead of calling torch.distributed
with whatever tensor is at hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specdraft.errors import SpecdraftError


def collective_device() -> torch.device:
    """Where the default process group's collectives run: CPU for gloo, the rank's accelerator
    otherwise (nccl, hccl, ccl, ...)."""
    from deepspeed.accelerator import get_accelerator

    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(get_accelerator().current_device_name())


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks; the result lives on collective_device() (no host sync here)."""
    reduced = tensor.to(collective_device())
    if reduced is tensor:  # .to() to the same device is the tensor itself: keep the input intact
        reduced = tensor.clone()
    dist.all_reduce(reduced)
    return reduced


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (failures surface everywhere, no hang)."""
    value = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(value)
    return bool(value.item())


def broadcast_error(check, rank: int):
    """Run `check` on rank 0 only; its result, or its SpecdraftError, reaches every rank.
    (Object collectives pick their own device: the current CUDA device under NCCL.)"""
    box = [None, None]
    if rank == 0:
        try:
            box[0] = check()
        except SpecdraftError as err:
            box[1] = str(err)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise SpecdraftError(box[1])
    return box[0]
