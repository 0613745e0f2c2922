"""What bench/gpu_step.py reads its numbers from: a clock on the device's timeline (CUDA events,
perf_counter on CPU), the peak memory of a case (the CUDA allocator's, the process's resident set
on CPU), dynamo's counters, and whether an error was the device running out of memory."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import resident_memory  # noqa: E402


class Clock:
    """Marks on the device's timeline: CUDA events on CUDA, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, marks: list) -> List[float]:
        """Seconds between consecutive marks (synchronizes first)."""
        self.sync()
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]

    def each(
        self, fn: Callable[[int], None], calls: int, start: int = 0, deadline: Optional[float] = None
    ) -> List[float]:
        """Each call's seconds, the calls back to back (nothing waits between them); past
        `deadline` (perf_counter) no further call starts, the first always runs."""
        self.sync()
        marks = [self.mark()]
        for i in range(calls):
            if i and deadline is not None and time.perf_counter() > deadline:
                break
            fn(start + i)
            marks.append(self.mark())
        return self.seconds(marks)

    def alone(self, fn: Callable[[int], None], i: int) -> float:
        """One call's seconds, the device idle before and after."""
        return self.each(fn, 1, i)[0]


class PeakMemory:
    """CUDA: max_memory_allocated since reset() less what was allocated at start (the case's own);
    CPU: the process's peak resident set since reset() (VmHWM, reset through clear_refs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.before = 0

    def start_case(self) -> float:
        """Free what earlier cases left; returns the bytes still allocated (a leak if nonzero)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            self.before = torch.cuda.memory_allocated()
        return self.before

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with contextlib.suppress(OSError):
            resident_memory.reset_peak()  # peak RSS := current RSS

    def peak(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() - self.before
        with contextlib.suppress(OSError, KeyError):
            return resident_memory.status_bytes("VmHWM")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dynamo_counts() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }


def is_oom(error: Optional[BaseException]) -> bool:
    """The allocator's OutOfMemoryError, or one wrapped on its way out (a compiler's failure, a
    CUDA runtime error), anywhere down the chain of causes."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, torch.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
        ):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
