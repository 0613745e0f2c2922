"""2 CPU ranks over gloo (torchrun): ZeRO-2 and ZeRO-3 train, agree, and resume bit-identically."""

import json

import pytest

from helpers import REPO, torchrun, write_chat_files


@pytest.fixture(scope="module")
def two_rank_results(tiny_target_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("dist")
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
