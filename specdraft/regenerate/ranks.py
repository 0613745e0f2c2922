"""How `specdraft regenerate` ends: on a signal, and when it runs on several ranks.

    stop = Stop()               SIGINT / SIGTERM (Ctrl-C; what SLURM and Kubernetes send first):
    with stop.installed():      the first one ends the generate call in progress (Interrupted); the
        stop.call(fn, ...)      rows finished before it are kept, the caller writes them and exits
                                RegenerateInterrupted (128 + signal: 130 for Ctrl-C)
    sync = RankSync(out, rank, world, stop, log)
        sync.manifest_ready()   ranks > 0: nothing of theirs on disk before rank 0's manifest.json
        sync.finish(counts)     ranks > 0, their shards written: hand rank 0 their counts
        sync.gather()           rank 0: every other rank's counts, once all have finished

regenerate starts no process group: its ranks (RANK / WORLD_SIZE, whatever launched them) share
only the --out directory, where each takes the rows its ids hash to. So they meet through files
there, each written (atomically) by one rank only: `.rank-r<k>.json`. Such a file may be left by an
earlier launch (killed before rank 0 read it): to tell this launch's from it, rank k names a fresh
nonce, rank 0 answers with this launch's token next to that nonce, and k's final file carries that
token, which no earlier file can.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Optional

from specdraft.rundir.atomic import write_atomic

MANIFEST = "manifest.json"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 10.0  # after a signal, how long a rank waits for the others (torchrun kills after 30 s)
WAIT_NOTE_S = 10.0  # a rank that waits longer says for what, once
POLL_S = 0.1


class Interrupted(KeyboardInterrupt):
    """Raised out of a generate call by the first signal (a BaseException, as Ctrl-C's own)."""


class RegenerateInterrupted(SystemExit):
    """Stopped on signal `signum`, the finished rows on disk: the process exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class Stop:
    """The first SIGINT / SIGTERM raises Interrupted only inside `call` (the generate calls, the
    long steps), else at the next call: the bookkeeping of finished rows and the shard writes are
    never cut. Later signals (torchrun passes a terminal's Ctrl-C on to its workers, which got it
    too) are ignored: what follows the first (writing, waiting STOP_GRACE_S for other ranks) ends."""

    def __init__(self):
        self.signum = 0
        self._raising = False
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @contextmanager
    def installed(self):
        if threading.current_thread() is threading.main_thread():  # else signals keep their action
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for s, previous in self._previous.items():
                signal.signal(s, signal.SIG_DFL if previous is None else previous)
            self._previous = {}

    def call(self, fn: Callable, *args):
        self._raising = True
        try:
            if self.signum:  # it came between two calls
                raise Interrupted()
            return fn(*args)
        finally:
            self._raising = False

    def _handle(self, signum, frame) -> None:
        if self.signum:
            return
        self.signum = signum
        if self._raising:
            raise Interrupted()


class RankSync:
    def __init__(self, out: Path, rank: int, world: int, stop: Stop, log: Callable[[str], None] = print):
        self.out, self.rank, self.world, self.stop, self.log = Path(out), rank, world, stop, log
        self.token = secrets.token_hex(8)  # rank 0: this launch's; another rank: its nonce

    def path(self, rank: int) -> Path:
        return self.out / f".rank-r{rank:03d}.json"

    def manifest_ready(self) -> bool:
        """Rank 0 claims --out, then writes manifest.json before the first shard: another rank
        writes nothing before it is there (False: not within STOP_GRACE_S of a signal)."""
        if self.rank == 0 or (self.out / MANIFEST).is_file():
            return True
        return bool(self._wait(lambda: (self.out / MANIFEST).is_file() or None, f"rank 0 to write {MANIFEST}"))

    def finish(self, counts: dict) -> None:
        """Rank k > 0, its rows written: its counts go to rank 0 (JSON values)."""
        if self.rank == 0 or not self.manifest_ready():
            return
        write_atomic(self.path(self.rank), json.dumps({"nonce": self.token}))
        run = self._wait(self._answered, "rank 0 to collect the counts")
        if run is not None:
            write_atomic(self.path(self.rank), json.dumps({"nonce": self.token, "run": run, **counts}))

    def gather(self) -> Dict[int, dict]:
        """Rank 0: {rank: counts} of the other ranks once every one has finished (after a signal,
        those that finished within STOP_GRACE_S)."""
        if self.world == 1:
            return {}
        answered = [None]

        def collect():
            states = self._states()
            nonces = {str(k): s["nonce"] for k, s in states.items() if "nonce" in s}
            if nonces != answered[0]:  # a rank named a new nonce (or its stale file is read): answer it
                write_atomic(self.path(0), json.dumps({"run": self.token, "nonces": nonces}))
                answered[0] = nonces
            return states if all(s.get("run") == self.token for s in states.values()) else None

        self._wait(collect, "the other ranks to finish their rows")
        return {k: s for k, s in self._states().items() if s.get("run") == self.token}

    def _states(self) -> Dict[int, dict]:
        return {k: _read_json(self.path(k)) or {} for k in range(1, self.world)}

    def _answered(self) -> Optional[str]:
        """Rank 0's token once it has answered this rank's nonce."""
        state = _read_json(self.path(0)) or {}
        return state.get("run") if (state.get("nonces") or {}).get(str(self.rank)) == self.token else None

    def _wait(self, poll: Callable, what: str):
        """poll() until it returns something; None once STOP_GRACE_S have passed since a signal."""
        start, noted, deadline = time.monotonic(), False, None
        while (found := poll()) is None:
            now = time.monotonic()
            if self.stop.signum:
                deadline = deadline or now + STOP_GRACE_S
                if now > deadline:
                    return None
            if not noted and now - start > WAIT_NOTE_S:
                self.log(f"regenerate: rank {self.rank} waits for {what}")
                noted = True
            time.sleep(POLL_S)
        return found


def _read_json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet
        return None
    return value if isinstance(value, dict) else None
