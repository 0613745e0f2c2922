"""Sequence parallelism (Ulysses): the N ranks of one SP group share each sequence, T/N tokens each.

    shard = SequenceShard(group, size=N, rank=r, length=T)     # r holds tokens [r T/N, (r+1) T/N)
    x_local = shard.local(x_full)                              # (B, T/N, ...) of a (B, T, ...) tensor
    out = shard.attention(core, q, k, v)                       # core sees the whole sequence, h/N heads

Everything per token (projections, MLPs, norms, the loss) runs on the rank's own tokens; attention
needs keys of the whole sequence: `attention` moves heads instead of tokens (one differentiable
all_to_all for q, k, v each and one for the output, DeepSpeed Ulysses' exchange), so the core
attention runs unchanged over all T positions with h/N heads (documents, windows, lags, TTT's
diagonal: no rule changes). `gather` is the all-gather for what is not a head tensor (DFlash's
context), `extend_right` brings the few tokens of the next shard a shifted read needs (EAGLE-3's
x_{t+1+k}, a teacher at t+1+k). size 1 (`SequenceShard.whole(T)`): every method is the identity and
no collective runs, so one code path serves both.

Collectives are torch.distributed's autograd-aware ones (torch.distributed.nn.functional; the
gather's own, _AllGather): their backward is the reverse exchange, so the gradient of a key
reaches the rank that made it. gloo runs
all_to_all_single and all_to_all (measured with torch 2.13), so all of this is tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a sequence of `length` tokens shared by the `size` ranks of `group`."""

    group: Any  # the SP process group (None: no SP, size 1)
    size: int
    rank: int  # rank inside the group: its shard is tokens [start, end)
    length: int  # T, the whole sequence

    @classmethod
    def whole(cls, length: int) -> "SequenceShard":
        return cls(None, 1, 0, length)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def local_length(self) -> int:
        return self.length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.local_length

    @property
    def end(self) -> int:
        return self.start + self.local_length

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (dim: the sequence's)."""
        return x if not self.parallel else x.narrow(dim, self.start, self.local_length)

    def positions(self, device=None) -> torch.Tensor:
        """(T/N,) the sequence indices of this rank's tokens."""
        return torch.arange(self.start, self.end, device=device)

    # -- exchanges -------------------------------------------------------------------------------

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, T/N, D) this rank's tokens of every head -> (B, h/N, T, D) every token of its
        heads. Fewer heads than ranks (a GQA key with h < N heads): each head is repeated N/h
        times first, as DeepSpeed's Ulysses does, so rank r reads head r h/N."""
        if not self.parallel:
            return x
        B, h, t, D = x.shape
        if h % self.size:
            x = x.repeat_interleave(self.size // h, dim=1)
            h = self.size
        send = x.reshape(B, self.size, h // self.size, t, D).permute(1, 0, 2, 3, 4).contiguous()
        received = _all_to_all(send, self.group)  # (N, B, h/N, t, D): index j = rank j's tokens
        return received.permute(1, 2, 0, 3, 4).reshape(B, h // self.size, self.size * t, D)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of to_heads: (B, h/N, T, D) -> (B, h, T/N, D)."""
        if not self.parallel:
            return x
        B, h, T, D = x.shape
        send = x.reshape(B, h, self.size, T // self.size, D).permute(2, 0, 1, 3, 4).contiguous()
        received = _all_to_all(send, self.group)  # (N, B, h/N, T/N, D): index j = heads of rank j
        return received.permute(1, 0, 2, 3, 4).reshape(B, self.size * h, T // self.size, D)

    def attention(
        self, core: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs
    ) -> torch.Tensor:
        """core(q, k, v, ...) over the whole sequence with this rank's heads -> (B, hq, T/N, D).
        q (B, hq, T/N, D), k/v (B, hkv, T/N, D)."""
        if not self.parallel:
            return core(q, k, v, *args, **kwargs)
        return self.to_tokens(core(self.to_heads(q), self.to_heads(k), self.to_heads(v), *args, **kwargs))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a per-rank tensor, on every rank (differentiable: the gradient of
        each shard is summed over the ranks that read it and lands on its own rank)."""
        if not self.parallel:
            return x
        return torch.cat(_AllGather.apply(x, self.group, self.rank, self.size).unbind(0), dim=dim)

    def extend_right(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T/N, ...) -> (B, T/N + n, ...): this rank's tokens then the next n of the sequence
        (zeros past its end). For tensors without a gradient (target features): n tokens of each
        rank are exchanged, never the sequence."""
        if n <= 0:
            return x
        if not self.parallel:
            return torch.cat([x, x.new_zeros(x.shape[0], n, *x.shape[2:])], dim=1)
        assert n <= self.local_length, f"extend_right({n}) reaches past the next shard ({self.local_length} tokens)"
        heads = [torch.empty_like(x[:, :n]).contiguous() for _ in range(self.size)]
        dist.all_gather(heads, x[:, :n].contiguous(), group=self.group)
        after = heads[self.rank + 1] if self.rank + 1 < self.size else torch.zeros_like(heads[0])
        return torch.cat([x, after], dim=1)

    def shift_left(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """x[:, t + shift] at each of this rank's t, zeros past the sequence's end (no gradient)."""
        return self.extend_right(x, shift)[:, shift:]

    def token_mean(self, summed: torch.Tensor, group_tokens: int, tokens: torch.Tensor):
        """A loss summed over this rank's counted tokens -> (the loss this rank backpropagates, the
        weight the loop logs it with). Size 1: (summed / tokens, tokens), the plain mean.
        SP: (N summed / G, G / N) with G the group's count (whole-sequence, read on the host): the
        group's mean of these losses is the sequence's mean loss, so DeepSpeed's average over
        all ranks gives every SP group's gradient summed over its ranks (their shares of one loss),
        and the loop's token-weighted mean of the logged losses is the sequence's loss."""
        if not self.parallel:
            return summed / tokens.clamp_min(1), tokens
        weight = torch.full((), group_tokens / self.size, dtype=torch.float64, device=tokens.device)
        return summed * (self.size / max(group_tokens, 1)), weight

    def host_count(self, mask: torch.Tensor) -> int:
        """A host mask's count over the whole sequence, for token_mean under SP (every rank alike);
        size 1 needs none and reads nothing (a training step makes no host read of tensor values)."""
        return int(mask.sum()) if self.parallel else 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """A count summed over the group (not differentiable: token counts, hits)."""
        if not self.parallel:
            return value
        total = value.clone()
        dist.all_reduce(total, group=self.group)
        return total


class _AllGather(torch.autograd.Function):
    """(...) per rank -> (N, ...) every rank's; backward: the gradients of all N summed over the
    group (all_reduce), this rank's slice. Not torch.distributed.nn.functional.all_gather (torch
    2.13): off NCCL its backward received a dense but permuted gradient (an SDPA key's) into
    permuted strides while the exchange wrote contiguous bytes (P-EAGLE's keys came back
    scrambled), and its scatter took group ranks for global ones (a second SP group failed)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone(memory_format=torch.contiguous_format)  # the incoming buffer is not ours to reduce into
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None, None, None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Dim 0 of `x` (size N) sent one slice per rank; slice j of the result came from rank j."""
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(torch.empty_like(x), x, group=group)


@dataclass(frozen=True)
class SequenceParallel:
    """The SP layout of a run: `size` consecutive ranks share a sequence; the data-parallel rank
    (which batch a rank reads) is rank // size. group None: size 1."""

    size: int = 1
    rank: int = 0  # inside the group
    group: Any = None
    data_rank: int = 0
    data_world: int = 1

    def shard(self, length: int) -> SequenceShard:
        return SequenceShard(self.group, self.size, self.rank, length)


def sequence_parallel_groups(size: int) -> SequenceParallel:
    """Every rank calls this at the same point (new_group is collective): groups of `size`
    consecutive ranks. size 1: no group."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if world % size:
        raise SpecdraftError(
            f"key 'sequence_parallel_size': {size} does not divide the world size {world} "
            f"(ranks share sequences in groups of {size})"
        )
    if size <= 1:
        return SequenceParallel(1, 0, None, rank, world)
    mine: Optional[Any] = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallel(size, rank % size, mine, rank // size, world // size)
