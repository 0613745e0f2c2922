"""Run by tests/test_multinode.py: the runs listed in a plan file, every draft family in one process.

    multinode_script.py one_node PLAN WORK   under torchrun with 2 ranks on one node: each run
                                             trained straight, in order, in this process
    multinode_script.py nodes PLAN WORK      one process per node (torchrun --nnodes 2
                                             --nproc_per_node 1): each run trained with one
                                             node's trainer SIGKILLed while it saves step
                                             kill_step, then the same run again on both nodes
                                             (resume=auto)

PLAN: {"runs": [{"name", "overrides", "ports": [2 ports]}], "pause": s, "kill_step": N}. Both nodes
read the same plan. In `nodes` mode this process never joins a process group: each training job
is a forked child (a fresh process group on its run's own port, rendezvous as torchrun set it up,
RANK / WORLD_SIZE / LOCAL_RANK as torchrun gave them), so a node's trainer can be killed and the
next job started without paying the imports again. The child of run i's first job on node i % 2
is SIGKILLed by this process as soon as the save of step kill_step has written a file
(SPECDRAFT_SAVE_PAUSE_S holds the save open meanwhile); the other node's child is left to fail
on its own. Node 0 then copies the crashed run (WORK/crashed_copy/, for the test's 1-rank resume)
before both nodes start the second job.

Every child records the files this rank wrote, created, renamed or removed under WORK (an audit
hook: Python's opens for writing, os.replace, os.mkdir, ..., and each torch.save) for the test's
check that node 1's process, LOCAL_RANK 0 there too, writes only its own checkpoint shards.

Writes WORK/results/<name>.<job>.rank<r>.json per job and rank; a child's output goes to
WORK/logs/<name>.<job>.rank<r>.log.
"""

import json
import os
import shutil
import signal
import sys
import time
import traceback
import types
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames, every step

import torch  # noqa: E402

from specdraft.config import load_config  # noqa: E402
from specdraft.rundir.layout import COMMITTED  # noqa: E402
from specdraft.checkpoint.manager import PAUSE_ENV  # noqa: E402
from specdraft.train.loop import train  # noqa: E402
from specdraft.checkpoint.slots import committed_slots  # noqa: E402
from helpers import TrainingSpy, digests, rendezvous_env  # noqa: E402

mode, plan_file, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
plan = json.loads(Path(plan_file).read_text())
rank = int(os.environ["RANK"])
results = work / "results"
results.mkdir(parents=True, exist_ok=True)
quiet = dict(log=lambda *a: None)
# after the engine's build and each update: the digest of every trainable tensor and Adam moment
updates = TrainingSpy(types.SimpleNamespace(setattr=setattr), record=digests)


def config(run: dict, output_dir: Path):
    return load_config(None, [*run["overrides"], f"output_dir={output_dir}"])


def dump(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# -- one node, 2 ranks: every run straight, in this process -------------------------------------

if mode == "one_node":
    for run in plan["runs"]:
        losses = train(config(run, work / "one_node" / run["name"]), **quiet).losses
        dump(results / f"{run['name']}.one_node.rank{rank}.json", {"losses": losses, "updates": updates.snapshots})
    # Twelve engines and process groups in one process: the interpreter's teardown of their threads
    # has aborted a rank ("terminate called without an active exception") after every result was
    # written. The results are on disk; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

assert mode == "nodes", mode
assert os.environ["LOCAL_RANK"] == "0" and os.environ["LOCAL_WORLD_SIZE"] == "1"  # each node's only rank

# What a process's first deepspeed.initialize and metrics log import (~1.5 s: DeepSpeed's Muon module
# calls torch.compile, which imports inductor), imported once here instead of in every child.
import deepspeed.runtime.engine  # noqa: E402,F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
from torch.utils.tensorboard import SummaryWriter  # noqa: E402,F401


# -- what a child writes -------------------------------------------------------------------------

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit event: (indices of the paths it writes, index of the dir_fd a relative path is relative to)
WRITE_EVENTS = {
    "os.rename": ((0, 2), (1, 3)),
    "os.mkdir": ((0, 2),),
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((1, None),),
    "shutil.move": ((1, None),),
    "os.truncate": ((0, None),),
    "os.symlink": ((1, 2),),
    "os.link": ((1, 3),),
}


def spy_writes(writes: list) -> None:
    """From here on, every path under WORK this process writes goes to `writes` (absolute)."""
    root = os.path.realpath(work) + os.sep

    def note(path, dir_fd=None) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # shutil.rmtree's unlinks
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            path = os.path.realpath(path)
            if path.startswith(root):
                writes.append(path)

    def hook(event, args):
        if event == "open":
            path, mode_, flags = args
            if (mode_ and any(c in mode_ for c in "wax+")) or (isinstance(flags, int) and flags & WRITE_FLAGS):
                note(path)
        elif event in WRITE_EVENTS:
            for i, fd in WRITE_EVENTS[event]:
                note(args[i], None if fd is None or fd >= len(args) else args[fd])

    sys.addaudithook(hook)
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # opened by torch's C++ writer: no audit event
        note(f)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):  # safetensors' Rust writer: no audit event either
        note(filename)
        return real_save_file(tensors, filename, *args, **kwargs)

    safetensors.torch.save_file = save_file  # read at call time (checkpoint/untrained_state.py's import)


def start_child(run: dict, job: str, port: int, output_dir: Path, pause: float = 0.0) -> int:
    """Fork a trainer of `run` for this rank; it writes its result file and exits."""
    pid = os.fork()
    if pid:
        return pid
    out = results / f"{run['name']}.{job}.rank{rank}.json"
    log = open(work / "logs" / f"{run['name']}.{job}.rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(rendezvous_env(port))  # 127.0.0.1, as both launches name it
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts this job's store
    if pause:
        os.environ[PAUSE_ENV] = str(pause)
    writes = []
    try:
        cfg = config(run, output_dir)
        spy_writes(writes)
        lines = []
        losses = train(cfg, log=lines.append).losses
        result = {"losses": losses, "log": lines, "writes": writes, "updates": updates.snapshots}
        code = 0
    except BaseException as err:  # a peer killed mid-save: this rank's collective fails
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:2000], "writes": writes}
        code = 1
    dump(out, result)
    log.flush()
    os._exit(code)


def wait(pid: int, timeout: float) -> dict:
    """Wait for a child; one still running after `timeout` s is killed (a hang, reported)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"exit": os.waitstatus_to_exitcode(status), "hung": False}
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return {"exit": None, "hung": True}


def slot_state(ckpt: Path, step: int) -> dict:
    slot = ckpt / f"step_{step}"
    return {
        "committed": [s.name for s in committed_slots(ckpt)] if ckpt.is_dir() else [],
        "files": sorted(str(p.relative_to(slot)) for p in slot.rglob("*") if p.is_file()) if slot.is_dir() else [],
    }


def kill_during_save(pid: int, ckpt: Path, step: int, timeout: float = 300.0) -> dict:
    """SIGKILL the child once the save of `step` has written its first file, before it commits."""
    slot = ckpt / f"step_{step}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if slot.is_dir() and any(entry.is_file() for entry in os.scandir(slot)):  # a one-draft slot: files at its top
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"killed": True, "slot_committed_at_kill": (slot / COMMITTED).exists(), **slot_state(ckpt, step)}
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"killed": False}
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return {"killed": False, "timed_out": True}


def wait_for_file(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


(work / "logs").mkdir(exist_ok=True)
(work / "sync").mkdir(exist_ok=True)
for index, run in enumerate(plan["runs"]):
    name, ports = run["name"], run["ports"]
    # 1. the run on both nodes, one node's trainer SIGKILLed while it saves step kill_step
    crashed, step = work / "crashed" / name, plan["kill_step"]
    pid = start_child(run, "crash", ports[0], crashed, pause=plan["pause"])
    killer = index % 2
    if rank == killer:
        report = kill_during_save(pid, crashed / "ckpt", step)
    else:
        report = wait(pid, 120)
    dump(results / f"{name}.crash_report.rank{rank}.json", dict(report, killer=killer))
    (work / "sync" / f"{name}.crashed.rank{rank}").touch()
    if rank == 0:  # both nodes' trainers are gone: a copy of the crashed run for the 1-rank resume
        wait_for_file(work / "sync" / f"{name}.crashed.rank1")
        shutil.copytree(crashed, work / "crashed_copy" / name)
        (work / "sync" / f"{name}.copied").touch()
    else:
        wait_for_file(work / "sync" / f"{name}.copied")
    # 2. the same command again, on both nodes: resume=auto
    wait(start_child(run, "resumed", ports[1], crashed), 600)
