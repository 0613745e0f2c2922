"""2 CPU ranks over gloo (torchrun): ZeRO 1-3 train, agree, resume bit-identically at the same size,
and resume elastically (2 -> 1, 1 -> 2 ranks; ZeRO-2 -> ZeRO-3) through DeepSpeed's universal format.

Loss tolerance across world sizes: the sampler gives every micro-batch the same sequences and the
same per-batch randomness at any world size (global micro-batch index), so a resumed run computes
the same gradients as a straight one up to the order of float additions (an all-reduce over ranks
vs accumulation on one rank). Measured over 6 steps after resume (losses ~5): 0 for 2 -> 1 at
ZeRO 1-3 and 1 -> 2 at ZeRO-1/2, 2.7e-7 for 2 ranks ZeRO-2 -> 1 rank ZeRO-3, <= 5e-7 for ZeRO-2 <-> 3.
A wrong optimizer state is far larger: DeepSpeed's shared Adam `step` after a ZeRO-3 universal
load (worked around in checkpoint.py) gave 3.4e-5 at the 2nd step and 7.8e-3 at the 6th. The
tolerance, 1e-5, sits between.
"""

import json
import shutil

import pytest
import torch

from helpers import (
    MOMENTS,
    REPO,
    capturing_save,
    free_port,
    keep_universal_copies,
    launch_env,
    run_overrides,
    state_file,
    torchrun,
    universal_optimizer_state,
    write_chat_files,
)
from specdraft.config import load_config
from specdraft.rundir.layout import universal_dir
from specdraft.checkpoint import manager as checkpoint, slots
from specdraft.train.loop import train

ELASTIC_TOLERANCE = 1e-5
quiet = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def dist_work(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def dist_data(dist_work):
    write_chat_files(dist_work / "data")
    return dist_work / "data"


def config(target, work, data, name, stage, *extra):
    """The dist script's run: global batch 4 = 2 ranks x 2, or 1 rank x 2 x 2 accumulation."""
    overrides = run_overrides(
        target,
        data,
        f"{work}/{name}",
        f"{work}/cache",
        per_device_batch_size=2,
        max_steps=12,
        save_steps=6,
        zero_stage=stage,
    )
    return load_config(None, [*overrides, *extra])


@pytest.fixture(scope="module")
def one_rank_runs(tiny_target_dir, dist_work, dist_data):
    """Straight 1-rank runs at ZeRO-1/2 (the 1 -> 2 sources), with their state at step 6."""
    original = checkpoint.CheckpointManager.save
    checkpoint.CheckpointManager.save = capturing_save(original, 6)
    try:
        return {
            stage: train(
                config(tiny_target_dir, dist_work, dist_data, f"one{stage}", stage, "gradient_accumulation_steps=2"),
                **quiet,
            ).losses
            for stage in (1, 2)
        }
    finally:
        checkpoint.CheckpointManager.save = original


@pytest.fixture(scope="module")
def two_rank_results(tiny_target_dir, dist_work, dist_data, one_rank_runs):
    out = dist_work / "results.json"
    proc = torchrun(REPO / "tests" / "dist_script.py", tiny_target_dir, dist_data, dist_work, out, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def shrunk_runs(tiny_target_dir, dist_work, dist_data, two_rank_results):
    """2 -> 1 rank at ZeRO 1-3 (accumulation 1 in the config: the resume makes it 2)."""
    undo = keep_universal_copies(dist_work / "copies")
    try:
        return {
            stage: train(
                config(
                    tiny_target_dir,
                    dist_work,
                    dist_data,
                    f"shrunk{stage}",
                    stage,
                    f"resume={dist_work}/two{stage}/ckpt/step_6",
                ),
                **quiet,
            ).losses
            for stage in (1, 2, 3)
        }
    finally:
        undo()


def test_two_ranks_train_at_zero1_2_3_with_the_same_first_loss(two_rank_results):
    first = [two_rank_results[f"full{stage}"][0] for stage in (1, 2, 3)]
    assert first[0] == pytest.approx(first[1], abs=1e-5) and first[1] == pytest.approx(first[2], abs=1e-5)
    for stage in (1, 2, 3):
        losses = two_rank_results[f"full{stage}"]
        assert len(losses) == 12 and min(losses[-3:]) < losses[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_rank_resume_is_bit_identical(two_rank_results, stage):
    assert two_rank_results[f"resumed{stage}"] == two_rank_results[f"full{stage}"][6:]


def _close(resumed, straight):
    assert len(resumed) == len(straight) == 6
    worst = max(abs(a - b) for a, b in zip(resumed, straight))
    print(f"max |resumed - straight| = {worst:.2e}")
    assert worst <= ELASTIC_TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_rank_checkpoint_resumes_on_one_rank(two_rank_results, shrunk_runs, stage):
    _close(shrunk_runs[stage], two_rank_results[f"full{stage}"][6:])


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_checkpoint_resumes_on_two_ranks(two_rank_results, one_rank_runs, stage):
    _close(two_rank_results[f"grown{stage}"], one_rank_runs[stage][6:])


@pytest.mark.parametrize("source", ["two1", "two2", "two3", "one1", "one2"])
def test_universal_copy_holds_the_original_fp32_weights_and_adam_moments(
    two_rank_results, shrunk_runs, dist_work, source
):
    captured = torch.load(state_file(dist_work / source, 6), weights_only=True)
    converted = universal_optimizer_state(dist_work / "copies" / source)
    assert set(converted) == set(captured) and captured
    for name in captured:
        for key in MOMENTS:
            assert torch.equal(converted[name][key], captured[name][key]), (name, key)


def test_conversion_leaves_the_slot_alone_and_is_reused(tiny_target_dir, dist_work, dist_data, shrunk_runs, capsys):
    """The copy goes into the resuming run's ckpt/, never into the run the slot belongs to, and a
    second resume of that run from the same slot reuses it."""
    slot = dist_work / "two2" / "ckpt" / "step_6"
    slots.verify_slot(slot)  # the original still matches its manifest
    assert not (slot.parent / "latest_universal").exists()  # ds_to_universal's stray pointer stayed in its temp dir
    assert not [p for p in slot.parent.iterdir() if "universal" in p.name]  # nothing written into that run
    logs = []
    resume = f"resume={slot}"
    train(config(tiny_target_dir, dist_work, dist_data, "shrunk2_again", 2, resume, "max_steps=6"), log=logs.append)
    universal = universal_dir(dist_work / "shrunk2_again" / "ckpt" / "step_6")
    assert any(line.startswith("resume: converted step_6") and line.endswith(str(universal)) for line in logs), logs
    before = {p: p.stat().st_mtime_ns for p in universal.rglob("*")}
    logs.clear()
    mtimes = {}

    def look(*args):  # the copy as it is just before the first save prunes it
        mtimes.update({p: p.stat().st_mtime_ns for p in universal.rglob("*")})
        return original(*args)

    original = slots.prune
    slots.prune = look
    try:
        again = train(config(tiny_target_dir, dist_work, dist_data, "shrunk2_again", 2, resume), log=logs.append)
    finally:
        slots.prune = original
    assert any(line.startswith(f"resume: reusing {universal}") for line in logs), logs
    assert any("gradient_accumulation_steps 1 -> 2" in line for line in logs), logs
    assert mtimes == before
    assert again.losses == shrunk_runs[2]


def test_every_rank_fsyncs_its_own_files_before_the_commit(two_rank_results, dist_work):
    for rank in (0, 1):
        events = json.loads((dist_work / f"events_rank{rank}.json").read_text())
        synced = {path for kind, path in events if kind == "fsync"}
        slot = dist_work / "two3" / "ckpt" / "step_6"
        own = {
            str(slot / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"),
            str(slot / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
        }
        assert own <= synced, (rank, own - synced)
        other = {str(slot / f"zero_pp_rank_{1 - rank}_mp_rank_00_optim_states.pt")}
        assert not other & synced  # nobody fsyncs (or needs to read) another rank's files


def test_every_rank_verifies_each_checkpoint_file_before_it_is_loaded(two_rank_results, dist_work):
    for rank in (0, 1):
        events = json.loads((dist_work / f"events_rank{rank}.json").read_text())
        verified, loaded = set(), []
        for kind, path in events:
            if kind == "verified":
                verified.add(path)
            elif kind == "loaded" and ".tmp/" not in path:  # ds_to_universal's own scratch files
                loaded.append(path)
                assert path in verified, (rank, path)
        # this rank's own ZeRO-3 shard and the universal fragments were among them
        assert any(f"two3/ckpt/step_6/zero_pp_rank_{rank}_" in p for p in loaded)
        assert any("step_6.universal/zero/" in p for p in loaded)


def test_two_rank_zero2_checkpoint_resumes_at_zero3_on_one_rank(
    tiny_target_dir, dist_work, dist_data, two_rank_results
):
    """A world size change and a stage change at once."""
    losses = train(
        config(tiny_target_dir, dist_work, dist_data, "shrunk2to3", 3, f"resume={dist_work}/two2/ckpt/step_6"), **quiet
    ).losses
    _close(losses, two_rank_results["full2"][6:])


def test_deepspeed_launcher_runs_the_module_on_two_ranks(tiny_target_dir, dist_work, dist_data):
    """`deepspeed --num_gpus 2 --module specdraft train ...` (it appends --local_rank=K)."""
    import subprocess
    import sys
    from pathlib import Path

    out = dist_work / "launcher"
    launcher = Path(sys.executable).parent / "deepspeed"
    args = run_overrides(
        tiny_target_dir, dist_data, out, dist_work / "cache", max_steps=2, save_steps=2, per_device_batch_size=2
    )
    proc = subprocess.run(
        [
            str(launcher),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "specdraft",
            "train",
            str(REPO / "configs" / "demo.yaml"),
            *args,
            "eval_prompts=null",
        ],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout + proc.stderr
    assert (out / "ckpt" / "step_2" / "COMMITTED").is_file() and (out / "step_2" / "model.safetensors").is_file()


def test_rank0_failures_reach_every_rank_and_a_private_checkpoint_dir_is_refused(tiny_target_dir, dist_work, dist_data):
    out = dist_work / "failures.json"
    proc = torchrun(REPO / "tests" / "failure_script.py", tiny_target_dir, dist_data, dist_work, out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {
        "commit": "saving step 2 failed: Input/output error",
        "prune": "deleting an old checkpoint slot failed (Permission denied)",
        "export": "writing the draft export failed (No space left on device)",
        "metrics": "metrics disk gone",  # a failed write is one line on every rank
        "not_shared": "must be on a filesystem every node shares",
    }
    for case, text in expected.items():
        ranks = report[case]
        assert ranks["0"] == ranks["1"], (case, ranks)  # the same error, on both ranks
        kind, message = ranks["0"]
        assert text in message and "\n" not in message, (case, message)
        assert kind == "SpecdraftError", (case, kind)
    # the failed commit left no committed slot behind; the run whose prune failed kept its new slot
    assert not slots.committed_slots(dist_work / "fail_commit" / "ckpt")
    assert [s.name for s in slots.committed_slots(dist_work / "fail_prune" / "ckpt")] == ["step_2", "step_4"]
    shutil.rmtree(dist_work / "fail_commit")
