"""speculators' own trainer (`speculators train`) as one plain process on a CPU: the device calls it
makes patched here, the installed package untouched. Run with the speculators venv's python:

    .venv-speculators/bin/python bench/speculators_train.py --speculator-type eagle3 \
        --verifier-name-or-path TARGET --data-path FEATURES --save-path OUT \
        --target-layer-ids 0 1 2 --draft-vocab-size 256 --max-steps 3 --epochs 1 \
        --loss-implementation eager --draft-attn-impl sdpa --num-workers 0 \
        --on-missing raise --no-resume-from-checkpoint

or from specdraft's python, `speculators_train.run(argv, log_path)` (a process of its own, in that
venv; versus_settings.speculators_argv builds argv). Every argument goes to `speculators train`
unchanged; the last five are the flags a CPU needs (versus_settings.SPECULATORS_CPU_FLAGS). It
writes <save-path>/<epoch>/{model.safetensors, config.json, ...} and <save-path>/run.yaml as on a GPU.

`run_many([(argv, log_path), ...])` trains several runs from one process of that venv (`--runs
FILE`): torch, transformers and speculators imported once (~7 s of a CPU each time), then each run
in a forked child, a fresh copy of that state as a new process would have (nothing one run sets or
seeds reaches the next; tests/speculators_env.py serves its scripts the same way). Each child's
wall seconds and exit status go to <save-path>/speculators_run.json. `epoch_batches` counts the
batches speculators' sampler makes of each epoch (its --epochs must hold exactly the steps).

What speculators 0.9.0 (site-packages/speculators/) does with no accelerator, and the patch for it
(each one checked by running without it):
- train/trainer.py:221 `self.local_rank = get_local_rank()` (the integer 0 from
  train/distributed.py:43-44 when not under torchrun), then :348 `self.model.to(self.local_rank)`
  and :532-537 / :642-647 `v.to(self.local_rank)` for every batch: `.to(0)` on a CPU-only torch
  raises "RuntimeError: Cannot access accelerator device when none is available".
  -> get_local_rank returns "cpu", in train/trainer.py (which imported the name, :30-35) and in
  train/distributed.py (for any module that reads it from there later; train/recovery.py:10
  imports it too, but calls it only when an accelerator exists, :223-228).
- train/trainer.py:78-92 `_StepTimer.mark` / `now` call `torch.accelerator.synchronize()` on every
  logged step (:515: step 0 always) -> the same RuntimeError. -> synchronize is a no-op.
- train/trainer.py:227-228 `self.device_type = acc.type if acc is not None else "cuda"`, read by
  :539-540 / :649-650 `torch.autocast(self.device_type, dtype=hidden_states_dtype)`. "cuda" on a
  CPU build only warns ("CUDA is not available ... Disabling autocast") and runs without autocast;
  "cpu" autocasts to bfloat16 as a GPU run does with --hidden-states-dtype bfloat16 (with float32
  CPU autocast is off either way). -> device_type = "cpu" after Trainer.__init__ (it is read only
  in train_epoch / val_epoch, after __init__).
Left alone, because nothing reaches them on a CPU: train/dataloader.py:51 (guarded by
torch.accelerator.is_available()), train/cli.py:777 (current_accelerator(check_available=True) is
None), models/utils.py:74 (torch.compile only under CUDA). Resuming is not patched:
train/checkpointer.py:306 and :323 map a checkpoint to utils/util.py:16 get_current_device(),
"cuda:0" without an accelerator, so run with --no-resume-from-checkpoint. With LOCAL_RANK set
(torchrun) train/distributed.py:151 asks for an accelerator (the same RuntimeError): one process
only, and main() refuses LOCAL_RANK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
PYTHON_VAR = "SPECDRAFT_SPECULATORS_PYTHON"  # as the Makefile sets it for the tests
# what a launcher (torchrun, or specdraft's own init_distributed in the calling process) leaves in
# the environment: with LOCAL_RANK set speculators takes itself for a torchrun rank
# (train/distributed.py:142-151) and asks for an accelerator
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def speculators_python() -> Path:
    """The speculators venv's interpreter: $SPECDRAFT_SPECULATORS_PYTHON, else the Makefile's."""
    return Path(os.environ.get(PYTHON_VAR) or ROOT / ".venv-speculators" / "bin" / "python")


def speculators_env() -> Dict[str, str]:
    """This environment for that venv: without our PYTHONPATH (specdraft, built for another
    transformers) and a launcher's rank variables."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and k not in LAUNCHER_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(argv: Sequence[str], log_path: Path, python: Optional[Path] = None) -> None:
    """This script in the speculators venv, a process of its own, from any python (specdraft's);
    its output to log_path."""
    python = Path(python or speculators_python())
    if not python.is_file():
        raise SystemExit(f"no speculators venv at {python} (make speculators-venv, or set {PYTHON_VAR})")
    with open(log_path, "w") as log:
        done = subprocess.run(
            [str(python), __file__, *map(str, argv)], env=speculators_env(), stdout=log, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = Path(log_path).read_text()[-3000:]
        raise SystemExit(f"speculators train exited {done.returncode}; the end of {log_path}:\n{tail}")


RUN_RECORD = "speculators_run.json"  # in each --save-path: {"seconds", "returncode"} of a run_many child


def run_many(runs: Sequence[Tuple[Sequence[str], Path]], log_path: Path, python: Optional[Path] = None) -> None:
    """Each (argv, log) in order, in one process of the speculators venv (`--runs`); stops at the
    first run that fails. log_path: that process's own output."""
    python = Path(python or speculators_python())
    if not python.is_file():
        raise SystemExit(f"no speculators venv at {python} (make speculators-venv, or set {PYTHON_VAR})")
    spec = [{"argv": [str(a) for a in argv], "log": str(log)} for argv, log in runs]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file, open(log_path, "w") as log:
        json.dump(spec, file)
        file.flush()
        done = subprocess.run(
            [str(python), __file__, "--runs", file.name], env=speculators_env(), stdout=log, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = Path(log_path).read_text()[-3000:]
        raise SystemExit(f"speculators train (--runs) exited {done.returncode}; the end of {log_path}:\n{tail}")


def serve_runs(spec_path: str) -> None:
    """run_many's side in the speculators venv: import once, fork a child per run."""
    import importlib

    patch_for_cpu()
    from speculators.cli import app

    for name in (
        "speculators.train.cli",
        "speculators.models.eagle3",
        "speculators.models.dflash",
        "speculators.models.dspark",
    ):
        importlib.import_module(name)
    for run in json.loads(Path(spec_path).read_text()):
        save_path = Path(run["argv"][run["argv"].index("--save-path") + 1])
        started = time.perf_counter()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: the run, its output in its own log
            with open(run["log"], "w") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
            code = 0
            try:
                app(["train", *run["argv"]], prog_name="speculators")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        seconds = time.perf_counter() - started
        save_path.mkdir(parents=True, exist_ok=True)
        (save_path / RUN_RECORD).write_text(json.dumps({"seconds": seconds, "returncode": code}))
        print(f"{save_path}: exit {code} after {seconds:.1f}s (log {run['log']})", flush=True)
        if code != 0:
            tail = Path(run["log"]).read_text()[-3000:]
            raise SystemExit(f"speculators train exited {code} for {save_path}; the end of {run['log']}:\n{tail}")


# run by the speculators venv's python: the multipack batches of each epoch, as its trainer makes
# them (S:train/dataloader.py:56-73 _setup_dataloader, seed = --seed; S:train/cli.py:718-737)
COUNT_BATCHES = """
import json, sys, torch
from speculators.train.data import ArrowDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
path, seq_len, ratio, seed, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
data = ArrowDataset(max_len=seq_len, datapath=path, on_missing="raise", train_ratio=ratio, split="train",
                    hidden_states_dtype=torch.float32)
sampler = MultipackDistributedBatchSamplerV2(batch_max_length=seq_len, lengths=data.approx_lengths,
                                             num_replicas=1, rank=0, seed=seed)
counts = []
while sum(counts) < steps:
    sampler.set_epoch(len(counts))
    counts.append(len(sampler))
print(json.dumps(counts))
"""
SPECULATORS_SEED = 42  # S:train/config/schema.py:728; versus_settings never sets --seed


def epoch_batches(
    data_path, seq_len: int, train_data_ratio: float, steps: int, python: Optional[Path] = None
) -> List[int]:
    """Batches of each epoch speculators' trainer makes of data_path, for as many epochs as `steps`
    steps need: len(result) is the --epochs that trains exactly `steps` (run_training starts every
    epoch, and a later one trains a step before --max-steps stops it)."""
    python = Path(python or speculators_python())
    done = subprocess.run(
        [
            str(python),
            "-c",
            COUNT_BATCHES,
            str(data_path),
            str(seq_len),
            repr(train_data_ratio),
            str(SPECULATORS_SEED),
            str(steps),
        ],
        env=speculators_env(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"counting speculators' batches of {data_path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def patch_for_cpu() -> None:
    """The three patches of the module docstring, on the imported modules (never their files)."""
    import torch

    from speculators.train import distributed, trainer

    def cpu_rank():
        return "cpu"

    distributed.get_local_rank = cpu_rank
    trainer.get_local_rank = cpu_rank
    torch.accelerator.synchronize = lambda *args, **kwargs: None

    original_init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu


def main(argv) -> None:
    if "LOCAL_RANK" in os.environ:
        raise SystemExit("speculators_train.py runs one process on a CPU: LOCAL_RANK is set (torchrun?)")
    if argv[:1] == ["--runs"]:
        serve_runs(argv[1])
        return
    patch_for_cpu()
    from speculators.cli import app

    app(["train", *argv], prog_name="speculators")  # exits with the command's status


if __name__ == "__main__":
    main(sys.argv[1:])
