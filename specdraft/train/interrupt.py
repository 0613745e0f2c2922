"""SIGINT and SIGTERM (Ctrl-C; what SLURM and Kubernetes send before a kill): finish the step,
save it through the periodic save path, exit 130 / 143.

    stop = StopSignals(rank)    train(): handlers installed as the loop starts, the caller's
                                restored when train() returns (tests and notebooks train in-process)
    stop.agreed()               every step, on every rank: the signal to stop on, 0 to go on
    TrainingInterrupted         raised after the save: a SystemExit, so the process exits 128 + N

A signal may reach only some ranks, or reach them at different steps: each step every rank adds
the signal it saw (0: none) to one MAX all-reduce on the host, and every rank acts on the result,
so all stop after the same step. A second signal exits at once without saving: a half-written slot
is never committed, so the previous committed slot stays the one a resume takes. Signals within
REPEAT_WINDOW_S of the first count as the first: launchers pass a signal on to workers that got it
too (torchrun under SLURM; the deepspeed launcher after a Ctrl-C in a terminal).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from specdraft.parallel.collectives import agree_max

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 1.0


class TrainingInterrupted(SystemExit):
    """Training stopped on signal `signum` after committing `step` (exit code 128 + signum)."""

    def __init__(self, signum: int, step: int, slot: str):
        super().__init__(128 + signum)
        self.signum, self.step, self.slot = signum, step, slot

    def __str__(self) -> str:
        return f"interrupted at step {self.step}: checkpoint {self.slot} committed; rerun the same command to resume"


class StopSignals:
    def __init__(self, rank: int):
        self.rank = rank
        self.received = 0  # the first signal this process got (0: none)
        self._first_at = 0.0
        self._previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers: signals keep their default action
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def agreed(self) -> int:
        """Collective: the largest signal number any rank received, 0 when none did."""
        return agree_max(self.received)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.received:
            self.received, self._first_at = signum, time.monotonic()
            if self.rank == 0:
                _say(
                    f"specdraft: {name}: stopping after this step to save a checkpoint (a second signal exits "
                    f"at once, without saving)"
                )
        elif time.monotonic() - self._first_at > REPEAT_WINDOW_S:
            _say(
                f"specdraft: {name} again (rank {self.rank}): exiting now without saving; the last committed "
                f"checkpoint is intact"
            )
            os._exit(128 + signum)


def _say(line: str) -> None:
    # not print(): the handler may run inside a print of the main thread. The newline first ends a
    # progress bar's line, which would otherwise be drawn over this one.
    os.write(2, f"\n{line}\n".encode())
