"""SIGKILL the trainer at random instants during saves; restart with resume=auto each time.

Imports once, then forks a trainer per trial (a fresh process group each), so 10+ trials cost
seconds, not 10 s of imports each. Prints one JSON report on stdout for tests/test_checkpoint.py.
"""

import json
import os
import random
import signal
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

from helpers import one_rank_env  # noqa: E402
from specdraft.config import load_config  # noqa: E402
from specdraft.rundir.layout import COMMITTED, LATEST  # noqa: E402
from specdraft.checkpoint.slots import committed_slots, verify_slot  # noqa: E402
from specdraft.train.loop import train  # noqa: E402

overrides_file, run_dir, trials, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
max_delay = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0  # seconds of training before a kill, at most
overrides = json.loads(open(overrides_file).read())
os.environ["SPECDRAFT_SAVE_PAUSE_S"] = "0.03"
ckpt = os.path.join(run_dir, "ckpt")
log_path = os.path.join(os.path.dirname(os.path.abspath(run_dir)), "trainer.log")


def start_trainer(trial: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(one_rank_env(port + trial))
    sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        with open(log_path, "a") as log:
            result = train(load_config(None, overrides), log=lambda m: (log.write(f"{trial} {m}\n"), log.flush()))
            steps = result.losses or next(iter(result.draft_losses.values()), [])  # a several-draft run: per draft
            log.write(f"{trial} finished {len(steps)}\n")
        os._exit(0)
    except BaseException:
        with open(log_path, "a") as log:
            log.write(f"{trial} crashed {traceback.format_exc()!r}\n")
        os._exit(1)


def committed_state() -> dict:
    slots = committed_slots(__import__("pathlib").Path(ckpt))
    for slot in slots:
        verify_slot(slot)  # raises if a committed slot is damaged
    latest = os.path.join(ckpt, LATEST)
    pointer = open(latest).read().strip() if os.path.exists(latest) else None
    if pointer is not None:
        assert os.path.exists(os.path.join(ckpt, pointer, COMMITTED)), f"latest -> uncommitted {pointer}"
    present = sorted(p for p in os.listdir(ckpt) if p.startswith("step_")) if os.path.isdir(ckpt) else []
    # a slot dir without COMMITTED at the instant of the kill: the save was interrupted midway
    interrupted = [p for p in present if p not in {s.name for s in slots}]
    return {"committed": [s.name for s in slots], "interrupted": interrupted, "latest": pointer}


def wait_until_training(trial: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log_path) and any(line.startswith(f"{trial} specdraft:") for line in open(log_path)):
            return
        time.sleep(0.02)
    raise RuntimeError(f"trainer {trial} did not start within {timeout} s")


rng = random.Random(1234)
report = {"trials": []}
for trial in range(trials):
    pid = start_trainer(trial)
    wait_until_training(trial)  # start-up time varies with machine load; the kill must not
    delay = rng.uniform(0.0, max_delay)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    report["trials"].append({"delay": delay, "killed": os.WIFSIGNALED(status), **committed_state()})
pid = start_trainer(trials)
_, status = os.waitpid(pid, 0)
report["final_exit"] = os.WEXITSTATUS(status)
report["final"] = committed_state()
report["log"] = open(log_path).read().splitlines()
print(json.dumps(report))
