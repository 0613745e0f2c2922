"""2 CPU ranks over gloo (torchrun): ZeRO-2 and ZeRO-3 train, agree, and resume bit-identically."""

import json

import pytest

from helpers import REPO, torchrun, write_chat_files


@pytest.fixture(scope="module")
def dist_work(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def dist_data(dist_work):
    write_chat_files(dist_work / "data")
    return dist_work / "data"


@pytest.fixture(scope="module")
def two_rank_results(tiny_target_dir, dist_work, dist_data):
    work = dist_work
    data_dir = dist_data
    out = work / "results.json"
    proc = torchrun(REPO / "tests" / "dist_script.py", tiny_target_dir, data_dir, work, out, port=29611)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def test_two_ranks_train_at_zero2_and_zero3_with_the_same_first_loss(two_rank_results):
    first = {stage: r["full"][0] for stage, r in two_rank_results.items()}
    assert first[2] == pytest.approx(first[3], abs=1e-5)
    for r in two_rank_results.values():
        assert len(r["full"]) == 12
        assert min(r["full"][-3:]) < r["full"][0]


@pytest.mark.parametrize("stage", [2, 3])
def test_two_rank_resume_is_bit_identical(two_rank_results, stage):
    r = two_rank_results[stage]
    assert r["resumed"] == r["full"][6:]


def test_two_rank_checkpoint_at_one_rank_fails_naming_both_sizes(two_rank_results, tiny_target_dir, dist_work):
    from specdraft.config import load_config
    from specdraft.errors import SpecdraftError
    from specdraft.train.loop import train

    work = dist_work
    cfg = load_config(None, [f"target={tiny_target_dir}", f"data_files={work}/data/*.jsonl",
                             f"data_cache_dir={work}/cache", "max_seq_length=64", "per_device_batch_size=2",
                             "max_steps=12", "save_steps=6", "zero_stage=2", f"output_dir={work}/one_rank",
                             f"resume={work}/a2/ckpt/step_6"])
    with pytest.raises(SpecdraftError, match=r"saved with 2 rank\(s\) at ZeRO-2, this run has 1 rank\(s\) at ZeRO-2"):
        train(cfg, log=lambda *a: None)
    stage_changed = load_config(None, [*(f"{k}={v}" for k, v in cfg.items() if k in ("target", "data_files",
                                "data_cache_dir", "max_seq_length", "output_dir")), "per_device_batch_size=2",
                                "zero_stage=3", f"resume={work}/a2/ckpt/step_6"])
    with pytest.raises(SpecdraftError, match=r"at ZeRO-2, this run has 1 rank\(s\) at ZeRO-3"):
        train(stage_changed, log=lambda *a: None)
    assert not (work / "one_rank").exists()


def test_deepspeed_launcher_runs_the_module_on_two_ranks(tiny_target_dir, dist_work, dist_data):
    """`deepspeed --num_gpus 2 --module specdraft train ...` (it appends --local_rank=K)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers import run_overrides

    out = dist_work / "launcher"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = Path(sys.executable).parent / "deepspeed"
    args = run_overrides(tiny_target_dir, dist_data, out, dist_work / "cache", max_steps=2, save_steps=2,
                         per_device_batch_size=2)
    proc = subprocess.run([str(launcher), "--num_gpus", "2", "--master_port", "29631", "--module", "specdraft",
                           "train", str(REPO / "configs" / "demo.yaml"), *args, "eval_prompts=null"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout + proc.stderr
    assert (out / "ckpt" / "step_2" / "COMMITTED").is_file() and (out / "step_2" / "model.safetensors").is_file()
