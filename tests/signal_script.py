"""Signal `specdraft train` from outside, as SLURM or Kubernetes would; run by tests/test_resume.py.

Imports once, then forks one `python -m specdraft train CONFIG` per case (the module run as
__main__, exactly what the command runs), so the cases cost seconds, not 10 s of imports each.

    once:  SIGTERM at a step S with S + 1 and S + 2 not multiples of save_steps (the child is frozen
           with SIGSTOP while the step is read, so the stop lands at S + 1 or S + 2)
    twice: SIGTERM, then SIGTERM again 2 s later while that step's save is still being written
           (SPECDRAFT_SAVE_PAUSE_S=1 puts 3 s between the start of a save and its COMMITTED)

Prints one JSON report: per case the exit code, stdout, stderr and the step signalled after.
"""

import json
import os
import runpy
import signal
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import specdraft.train.loop  # noqa: E402,F401  (the heavy imports, once, before forking)

config_file, work, save_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])


def start(case: str, run_dir: str, env: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(env)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(os.path.join(work, f"{case}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["specdraft", "train", config_file, f"output_dir={run_dir}"]
    code = 1
    try:
        runpy.run_module("specdraft", run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def logged_steps(run_dir: str) -> int:
    """Steps in metrics.jsonl, a line being written included (the child checks for a signal
    before it logs the step)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    text = open(path).read() if os.path.exists(path) else ""
    return text.count("\n") + (not text.endswith("\n") and bool(text))


def signal_between_saves(pid: int, run_dir: str, after: int) -> int:
    """SIGTERM the child once it has logged more than `after` steps, at a step S whose next two
    steps are not multiples of save_steps; returns S."""
    while True:
        if os.waitpid(pid, os.WNOHANG)[0]:
            raise RuntimeError(f"the trainer in {run_dir} exited before it was signalled")
        if logged_steps(run_dir) <= after:
            time.sleep(0.05)
            continue
        os.kill(pid, signal.SIGSTOP)
        step = logged_steps(run_dir)
        if (step + 1) % save_steps and (step + 2) % save_steps:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
            return step
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)


def exit_code(status: int) -> int:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)


report = {}
for case, env in (("once", {}), ("twice", {"SPECDRAFT_SAVE_PAUSE_S": "1"})):
    run_dir = os.path.join(work, case)
    pid = start(case, run_dir, env)
    signalled = signal_between_saves(pid, run_dir, after=save_steps)
    if case == "twice":
        time.sleep(2.0)  # past the window in which a repeat counts as the first; before the commit
        os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    report[case] = {
        "exit": exit_code(status),
        "signalled_after": signalled,
        **{name: open(os.path.join(work, f"{case}.{name}")).read() for name in ("stdout", "stderr")},
    }
print(json.dumps(report))
