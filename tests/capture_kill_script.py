"""SIGKILL `specdraft capture` at instants of a shard's life, then at random instants, then let
it finish; prints one JSON report for tests/test_feature_cache.py.

Imports once, then forks a capture per trial (a fresh process group each). The deterministic
trials die inside the commit path of shard `n`:
  write   half of its bytes in the temp file, before the fsync and the rename
  renamed its file in place, its commit not yet recorded in the rank's part file
  commit  right after its commit (the next shard's rows not yet written)
The random trials die at a uniform instant in [0, max_delay] s of the capture.
"""

import json
import os
import random
import signal
import sys
import time
import warnings

warnings.filterwarnings("ignore")

from helpers import one_rank_env  # noqa: E402
from specdraft.config import load_config  # noqa: E402
import specdraft.features.cache as cache_module  # noqa: E402
import specdraft.features.shards as shards_module  # noqa: E402
from specdraft.commands.capture import capture  # noqa: E402

overrides_file, port, random_trials, max_delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
overrides = json.loads(open(overrides_file).read())


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, shard: int) -> None:
    """In the forked capture: die at `point` of its shard number `shard` (1-based, this run's)."""
    calls = {"n": 0}
    write, commit = shards_module.write_atomic, cache_module.commit_to_part

    def write_atomic(path, payload):
        calls["n"] += 1
        if point == "write" and calls["n"] == shard:
            from specdraft.rundir.atomic import fresh_name

            with open(fresh_name(path), "wb") as half:
                half.write(payload[: len(payload) // 2])
            die()
        write(path, payload)
        if point == "renamed" and calls["n"] == shard:
            die()

    def commit_to_part(*args):
        commit(*args)
        if point == "commit" and calls["n"] == shard:
            die()

    shards_module.write_atomic = write_atomic
    cache_module.commit_to_part = commit_to_part


def run(trial: int, point=None, shard=0, delay=None) -> int:
    pid = os.fork()
    if pid == 0:
        os.environ.update(one_rank_env(port + trial))
        sys.stdout = sys.stderr = open(os.devnull, "w")
        if point:
            arm(point, shard)
        capture(load_config(None, overrides), log=lambda *a: None)
        os._exit(0)
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


report = {"trials": []}
trial = 0
for point, shard in (("write", 2), ("renamed", 2), ("commit", 1), ("write", 1)):
    status = run(trial, point, shard)
    report["trials"].append({"point": point, "shard": shard, "killed": os.WIFSIGNALED(status)})
    trial += 1
rng = random.Random(0)
for _ in range(random_trials):
    delay = rng.uniform(0, max_delay)
    status = run(trial, delay=delay)
    report["trials"].append({"delay": round(delay, 3), "killed": os.WIFSIGNALED(status)})
    trial += 1
report["final_status"] = run(trial)
print(json.dumps(report))
