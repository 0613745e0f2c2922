"""A resume that is right is never refused: the proof that a load brought the draft back compares
the saved weights bit for bit (a digest of each tensor's bytes), not float sums whose last bits
follow the reduction's thread count. Saved with 1 thread, resumed with 2, for every family."""

import pytest
import torch

from helpers import write_chat_files
from offline_runs import SAVE_STEPS, STEPS, run_config
from specdraft.drafts import FAMILIES
from specdraft.errors import SpecdraftError
from specdraft.train.frozen_state import check_fingerprint, draft_fingerprint
from specdraft.train.loop import train


def test_the_fingerprint_is_the_bytes_one_changed_bit_differs_and_threads_do_not_matter(tmp_path):
    weights = {"w": torch.randn(513, 257, generator=torch.Generator().manual_seed(0)),
               "b": torch.randn(257, generator=torch.Generator().manual_seed(1)).bfloat16()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draft_fingerprint(weights)
        torch.set_num_threads(2)
        two = draft_fingerprint(weights)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    check_fingerprint(tmp_path, {k: v.clone() for k, v in weights.items()}, {"draft_fingerprint": one})
    nudged = weights["w"].clone()
    nudged[7, 3] = torch.nextafter(nudged[7, 3], torch.tensor(float("inf")))  # the last bit of one entry
    with pytest.raises(SpecdraftError, match=r"do not match the saved ones \(1 tensors differ, e\.g\. w\)"):
        check_fingerprint(tmp_path, {**weights, "w": nudged}, {"draft_fingerprint": one})
    # same values, another dtype: not the saved tensor
    with pytest.raises(SpecdraftError, match="do not match"):
        check_fingerprint(tmp_path, {**weights, "b": weights["b"].float()}, {"draft_fingerprint": one})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_saved_with_one_thread_resumes_with_two(served_target_dir, tmp_path, family):
    write_chat_files(tmp_path / "data")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = train(run_config(served_target_dir, tmp_path / "data", tmp_path, family, "run",
                                 f"max_steps={SAVE_STEPS}"), log=lambda *a: None)
        torch.set_num_threads(2)
        lines = []
        resumed = train(run_config(served_target_dir, tmp_path / "data", tmp_path, family, "run"), log=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert len(first.losses) == SAVE_STEPS
    assert any(line.startswith("resumed from") and line.endswith(f"step_{SAVE_STEPS} at step {SAVE_STEPS}")
               for line in lines), lines
    assert len(resumed.losses) == STEPS - SAVE_STEPS
