"""Collectives placed where the process group's backend needs their tensors.

NCCL (DeepSpeed's backend on CUDA) refuses CPU tensors and gloo refuses CUDA ones, so every
tensor collective of the loop goes through `all_reduce` here instead of calling torch.distributed
with whatever tensor is at hand. A failure on one rank reaches every rank through here too
(raise_everywhere, run_shared), so no rank is left waiting at the next collective.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from specdraft.errors import SpecdraftError, write_error, write_failure


def collective_device() -> torch.device:
    """Where the default process group's collectives run: CPU for gloo, the rank's accelerator
    otherwise (nccl, hccl, ccl, ...)."""
    from deepspeed.accelerator import get_accelerator

    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(get_accelerator().current_device_name())


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks; the result lives on collective_device() (no host sync here).
    Without a process group (one process: a script calling the data pipeline) a copy of it."""
    if not dist.is_initialized():
        return tensor.clone()
    reduced = tensor.to(collective_device())
    if reduced is tensor:  # .to() to the same device is the tensor itself: keep the input intact
        reduced = tensor.clone()
    dist.all_reduce(reduced)
    return reduced


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any rank (failures surface everywhere, no hang);
    `flag` itself without a process group."""
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(value)
    return bool(value.item())


def agree_max(value: int) -> int:
    """The largest `value` over all ranks, on every rank. Runs on the host (over gloo, beside an
    NCCL group where there is one), so a call every step neither waits for the device nor stalls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_host_group())
    return int(flag.item())


@functools.lru_cache(maxsize=None)
def _host_group():
    """A process group whose collectives run on CPU tensors: the default one if it is gloo's. Made
    by the first agree_max, which every rank reaches at the same point."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def raise_everywhere(error: Optional[BaseException]) -> None:
    """Collective: if any rank holds an error, every rank raises it, so no rank is left waiting at
    the next collective. The lowest failing rank's message wins; a SpecdraftError stays one (a
    one-line user error everywhere), so does a failed write (its path and the OS's reason), anything
    else becomes the same RuntimeError on every rank (caused by the original where it happened). Costs one small all_reduce when nothing failed.
    Without a process group (one process, e.g. a script calling the data pipeline) the error is raised as is."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    if not any_rank(error is not None):
        return
    if error is not None and not isinstance(error, SpecdraftError) and write_failure(error) is not None:
        original, error = error, write_error(error)  # a full disk: one line, on every rank
        error.__cause__ = original
    reports = [None] * dist.get_world_size()
    mine = (
        None
        if error is None
        else (
            isinstance(error, SpecdraftError),
            f"{type(error).__name__}: {error}" if not isinstance(error, SpecdraftError) else str(error),
        )
    )
    dist.all_gather_object(reports, mine)
    failing = next(rank for rank, report in enumerate(reports) if report is not None)
    user_error, message = reports[failing]
    if user_error:
        if failing == dist.get_rank():
            raise error
        raise SpecdraftError(message)
    raise RuntimeError(f"rank {failing} failed: {message}") from error


def run_shared(fn, on_rank: Optional[int] = 0):
    """Run `fn` on one rank (every rank when on_rank is None); its failure reaches every rank
    (raise_everywhere). Returns fn's result where it ran, None elsewhere."""
    result, error = None, None
    if on_rank is None or not dist.is_initialized() or dist.get_rank() == on_rank:
        try:
            result = fn()
        except Exception as err:
            error = err
    raise_everywhere(error)
    return result
