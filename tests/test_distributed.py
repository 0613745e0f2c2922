"""2 CPU ranks over gloo (torchrun): ZeRO-2 and ZeRO-3 train, agree, and resume bit-identically."""

import json

import pytest

from helpers import REPO, torchrun, write_chat_files


@pytest.fixture(scope="module")
def dist_work(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def two_rank_results(tiny_target_dir, dist_work):
    work = dist_work
    data_dir = work / "data"
    write_chat_files(data_dir)
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
