"""Resume after a signal, on another machine, and never from a checkpoint that runs code.

- Signals: SIGINT / SIGTERM stop at the next step boundary on every rank, commit that step and its
  export, print one line and exit 130 / 143; a second signal exits at once. The resumed run's
  losses are the uninterrupted run's, exactly.
- Pickles: every .pt file of a slot is unpickled with weights_only=True (DeepSpeed's types on an
  allowlist) before anything else reads it: a booby-trapped file is refused and never runs.
- Portability: a slot resumes at another thread count, world size and ZeRO stage for every family:
  the check that the draft came back compares bytes, not float sums (whose last bits depend on
  how many threads summed them).

The wide target has MLP matrices of 64 x 640 = 40960 elements: torch splits a sum over threads
from 32768 elements on, so a sum over one of them can differ between 1 and 2 threads.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, launch_env, run_overrides, save_target, torchrun, train_run
from specdraft.cli import main
from specdraft.config import load_config
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import COMMITTED
from specdraft.train import loop
from specdraft.checkpoint.untrained_state import check_fingerprint, draft_fingerprint
from specdraft.train.interrupt import TrainingInterrupted
from specdraft.checkpoint.slots import committed_slots, file_entry, verify_slot

FAMILIES = {
    "glide": {},
    "eagle3": {"draft.type": "eagle3", "draft.ttt_steps": 2, "draft.draft_vocab_size": 200},
    "dflash": {"draft.type": "dflash", "draft.num_layers": 1, "draft.block_size": 4, "draft.max_anchors": 16},
    "dspark": {
        "draft.type": "dspark",
        "draft.num_layers": 1,
        "draft.block_size": 4,
        "draft.max_anchors": 16,
        "draft.markov_rank": 8,
    },
}
ELASTIC_TOLERANCE = 1e-5  # as in test_distributed.py: another world size or thread count adds in another order


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def wide_target(tiny_target_dir, work):
    """The tiny target with intermediate_size 640 (random weights; same tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = work / "wide_target"
    config = LlamaConfig.from_pretrained(tiny_target_dir)
    config.intermediate_size = 640
    torch.manual_seed(0)
    return save_target(LlamaForCausalLM(config), out, tiny_target_dir)


def overrides(target, data_dir, work, name, **extra) -> list:
    """2 sequences per rank per micro-batch: global batch 4 on 2 ranks, 2 x 2 accumulation on one."""
    return run_overrides(target, data_dir, work / name, work / "cache", **{"per_device_batch_size": 2, **extra})


def wide_run(target, data_dir, work, name, threads=1, **extra):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return train_run(target, data_dir, work, name, per_device_batch_size=2, **extra).losses
    finally:
        torch.set_num_threads(before)


def assert_close(resumed, straight):
    assert len(resumed) == len(straight) > 0
    assert max(abs(a - b) for a, b in zip(resumed, straight)) <= ELASTIC_TOLERANCE, (resumed, straight)


@pytest.fixture(scope="module")
def two_ranks(wide_target, data_dir, work):
    """On 2 ranks (1 thread each, torchrun's default): each family at ZeRO-2 to step 4 (saved at 2
    and 4); a GLIDE run that only rank 1 is signalled in (SIGTERM in its 3rd forward, step 3), then
    the same command again."""
    runs = [
        {
            "name": f"two_{family}",
            "overrides": overrides(
                wide_target, data_dir, work, f"two_{family}", zero_stage=2, max_steps=4, save_steps=2, **extra
            ),
        }
        for family, extra in FAMILIES.items()
    ]
    signalled = overrides(wide_target, data_dir, work, "signalled", zero_stage=2, max_steps=4, save_steps=2)
    runs += [
        {"name": "signalled", "overrides": signalled, "signal": {"rank": 1, "forward": 3}},
        {"name": "signalled_again", "overrides": signalled},
    ]
    (work / "runs.json").write_text(json.dumps([dict(r, overrides=[str(o) for o in r["overrides"]]) for r in runs]))
    proc = torchrun(REPO / "tests" / "resume_script.py", work / "runs.json", work, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((work / f"results_rank{rank}.json").read_text()) for rank in (0, 1)]


# -- signals ---------------------------------------------------------------------------------------


def test_sigterm_stops_at_a_step_boundary_commits_it_and_the_resume_continues_exactly(
    tiny_target_dir, data_dir, tmp_path
):
    """A subprocess `specdraft train` sent SIGTERM between saves (save_steps=5): it commits the step it
    stopped after and its export, prints the line, exits 143; the same command again continues with
    the losses of a run never interrupted. A second SIGTERM during that save exits at once (143):
    the half-written slot is never committed, and the run resumes from the slot before it."""
    args = dict(max_steps=40, save_steps=5, keep_last=3)
    config = tmp_path / "run.yaml"
    config.write_text(
        "".join(
            f"{o.replace('=', ': ', 1)}\n"
            for o in run_overrides(tiny_target_dir, data_dir, tmp_path / "unused", tmp_path / "cache", **args)
        )
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "signal_script.py"), config, tmp_path, "5"],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    straight = train_run(tiny_target_dir, data_dir, tmp_path, "straight", **args).losses

    once = report["once"]
    lines = [line for line in once["stdout"].splitlines() if line.startswith("interrupted")]
    assert once["exit"] == 143 and len(lines) == 1, once
    stopped = int(
        re.fullmatch(
            r"interrupted at step (\d+): checkpoint step_\1 committed; rerun the same command "
            r"to resume",
            lines[0],
        ).group(1)
    )
    assert stopped - once["signalled_after"] in (1, 2)  # the next step boundary (or the one after: see the script)
    assert "specdraft: SIGTERM: stopping after this step" in once["stderr"]
    assert stopped % 5 and stopped > 5  # past the last periodic save
    run_dir = tmp_path / "once"
    assert committed_slots(run_dir / "ckpt")[-1].name == f"step_{stopped}"
    assert (run_dir / f"step_{stopped}" / "model.safetensors").is_file()  # its export too
    resumed = train_run(tiny_target_dir, data_dir, tmp_path, "once", **args).losses
    assert resumed == straight[stopped:]  # exact float equality

    twice = report["twice"]
    assert twice["exit"] == 143 and "SIGTERM again (rank 0): exiting now without saving" in twice["stderr"], twice
    assert "interrupted at step" not in twice["stdout"]
    run_dir = tmp_path / "twice"
    newest = committed_slots(run_dir / "ckpt")[-1]
    assert int(newest.name.split("_")[1]) <= twice["signalled_after"]  # the interrupted save never committed
    verify_slot(newest)
    assert not [p for p in run_dir.glob("step_*") if int(p.name.split("_")[1]) > twice["signalled_after"]]
    resumed = train_run(tiny_target_dir, data_dir, tmp_path, "twice", **args).losses
    assert resumed == straight[int(newest.name.split("_")[1]) :]


def test_sigint_in_process_exits_130_and_gives_back_the_callers_handlers(
    tiny_target_dir, data_dir, tmp_path, monkeypatch
):
    real, calls = loop.forward_step, []

    def forward_step(*args):  # Ctrl-C during the 7th step
        calls.append(None)
        if len(calls) == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(loop, "forward_step", forward_step)
    logs = []
    cfg = load_config(
        None, run_overrides(tiny_target_dir, data_dir, tmp_path / "run", tmp_path / "cache", max_steps=10, save_steps=5)
    )
    with pytest.raises(TrainingInterrupted) as stop:
        loop.train(cfg, log=logs.append)
    assert (stop.value.code, stop.value.step, stop.value.signum) == (130, 7, signal.SIGINT)
    assert logs[-1] == "interrupted at step 7: checkpoint step_7 committed; rerun the same command to resume"
    assert [s.name for s in committed_slots(tmp_path / "run" / "ckpt")] == ["step_5", "step_7"]
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(two_ranks):
    for rank in (0, 1):
        assert {k: two_ranks[rank]["signalled"][k] for k in ("exit", "step", "signal")} == {
            "exit": 143,
            "step": 3,
            "signal": signal.SIGTERM,
        }, rank
    assert two_ranks[0]["signalled"]["committed"] == ["step_2", "step_3"]
    assert two_ranks[0]["signalled_again"]["losses"] == two_ranks[0]["two_glide"]["losses"][3:]


# -- pickles ---------------------------------------------------------------------------------------


class _Trap:
    """Unpickling this creates the marker file (open(marker, "w")): code run by a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def trapped_run(tiny_target_dir, data_dir, work):
    """A finished ZeRO-2 run whose newest slot's optimizer state is a trap, its sha256 in the
    manifest (a slot someone shared, with a valid manifest)."""
    run_dir = work / "trapped"
    train_run(tiny_target_dir, data_dir, work, "trapped", zero_stage=2, max_steps=4, save_steps=2)
    slot = run_dir / "ckpt" / "step_4"
    optim = next(slot.glob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": _Trap(work / "MARKER")}, optim)
    record = json.loads((slot / COMMITTED).read_text())
    record["files"][optim.name] = file_entry(optim)
    (slot / COMMITTED).write_text(json.dumps(record))
    return run_dir


def _snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["resume", "resume at ZeRO-3", "consolidate", "export"])
def test_a_booby_trapped_optimizer_state_is_refused_without_running_it(
    trapped_run, tiny_target_dir, data_dir, work, tmp_path, capsys, command
):
    """Resume at the same stage (DeepSpeed's engine), at another (the universal conversion), and the
    offline commands (zero_to_fp32): one line, exit 2, the trap never runs, nothing changes."""
    slot = trapped_run / "ckpt" / "step_4"
    before = _snapshot(trapped_run)
    if command.startswith("resume"):
        config = tmp_path / "c.yaml"
        config.write_text(
            "".join(
                f"{o.replace('=', ': ', 1)}\n"
                for o in run_overrides(
                    tiny_target_dir,
                    data_dir,
                    tmp_path / "new",
                    work / "cache",
                    max_steps=6,
                    save_steps=2,
                    resume=slot,
                    zero_stage=3 if "ZeRO-3" in command else 2,
                )
            )
        )
        argv = ["train", str(config)]
    else:
        argv = [command, str(trapped_run)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    optim = next(slot.glob("*optim_states.pt"))
    assert err == (
        f"specdraft: error: {optim}: refusing to load it: its pickle calls io.open (a specdraft "
        f"checkpoint holds tensors and DeepSpeed's LossScaler, ZeroStageEnum, fragment_address only; "
        f"unpickling more could run code)"
    )
    assert not (work / "MARKER").exists()
    assert _snapshot(trapped_run) == before


def test_auto_resume_moves_a_trapped_slot_aside_and_resumes_the_one_before(
    trapped_run, tiny_target_dir, data_dir, work, tmp_path
):
    run_dir = tmp_path / "auto"
    shutil.copytree(trapped_run, run_dir)
    logs = []
    cfg = load_config(
        None, run_overrides(tiny_target_dir, data_dir, run_dir, work / "cache", zero_stage=2, max_steps=4, save_steps=2)
    )
    loop.train(cfg, log=logs.append)
    assert not (work / "MARKER").exists()
    assert any(line.startswith("resume: skipped") and "io.open" in line for line in logs), logs
    assert any(line.endswith("at step 2") and "resumed from" in line for line in logs), logs
    assert (run_dir / "ckpt" / "step_4.rejected").is_dir()


# -- portability -----------------------------------------------------------------------------------


def test_the_fingerprint_is_the_bytes_whatever_the_thread_count():
    """A float sum of 40000 values differs in its last bits between 1 and 2 threads (seed 1);
    the fingerprint does not, and still tells a 1-ulp change and a dtype change apart."""
    tensor = torch.randn(40000, generator=torch.Generator().manual_seed(1)) * 0.02
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draft_fingerprint({"w": tensor})
        sums = [float(tensor.double().sum()), float(tensor.double().pow(2).sum())]
        torch.set_num_threads(2)
        assert draft_fingerprint({"w": tensor}) == one
        assert [float(tensor.double().sum()), float(tensor.double().pow(2).sum())] != sums  # what sums did
        legacy = {"draft_fingerprint": {"w": sums}}  # a slot saved before the sha256s
        check_fingerprint(Path("slot"), {"w": tensor}, legacy)  # resumes at 2 threads
    finally:
        torch.set_num_threads(before)
    check_fingerprint(Path("slot"), {"w": tensor}, {"draft_sha256": one})
    nudged = tensor.clone()
    nudged[123] = torch.nextafter(nudged[123], torch.tensor(1.0))
    for wrong, record in (
        (nudged, {"draft_sha256": one}),
        (tensor.double(), {"draft_sha256": one}),
        (tensor * 1.001, legacy),
    ):
        with pytest.raises(SpecdraftError, match=r"^slot: the draft weights loaded do not match the saved ones \(w "):
            check_fingerprint(Path("slot"), {"w": wrong}, record)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_slot_resumes_at_another_thread_count_zero_stage_and_world_size(
    wide_target, data_dir, work, two_ranks, family
):
    """Saved with 1 thread (ZeRO-0 and ZeRO-2, 1 rank; ZeRO-2 on 2 ranks), resumed with 2 threads at
    ZeRO-0, ZeRO-2, ZeRO-3 and on 1 rank: never refused, and the losses continue."""
    extra = FAMILIES[family]
    straight = {
        stage: wide_run(
            wide_target,
            data_dir,
            work,
            f"{family}{stage}",
            zero_stage=stage,
            max_steps=4,
            save_steps=2,
            gradient_accumulation_steps=2,
            **extra,
        )
        for stage in (0, 2)
    }
    cases = [(0, 0, f"{family}0"), (2, 2, f"{family}2"), (2, 3, f"{family}2"), (2, 2, f"two_{family}")]
    for saved, stage, source in cases:
        resumed = wide_run(
            wide_target,
            data_dir,
            work,
            f"{source}_at{stage}",
            threads=2,
            zero_stage=stage,
            max_steps=4,
            save_steps=2,
            resume=work / source / "ckpt" / "step_2",
            **extra,
        )
        reference = two_ranks[0][source]["losses"] if source.startswith("two_") else straight[saved]
        assert_close(resumed, reference[2:])
