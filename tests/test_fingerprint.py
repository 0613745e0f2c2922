"""A resume that is right is never refused: the proof that a load brought the draft back compares
the saved weights bit for bit (a digest of each tensor's bytes), not float sums whose last bits
follow the reduction's thread count (the families' resumes across threads, world sizes and ZeRO
stages: tests/test_resume.py)."""

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.checkpoint.untrained_state import FINGERPRINT_KEY, check_fingerprint, draft_fingerprint


def test_the_fingerprint_is_the_bytes_one_changed_bit_differs_and_threads_do_not_matter(tmp_path):
    weights = {
        "w": torch.randn(513, 257, generator=torch.Generator().manual_seed(0)),
        "b": torch.randn(257, generator=torch.Generator().manual_seed(1)).bfloat16(),
    }
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draft_fingerprint(weights)
        torch.set_num_threads(2)
        two = draft_fingerprint(weights)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    check_fingerprint(tmp_path, {k: v.clone() for k, v in weights.items()}, {FINGERPRINT_KEY: one})
    nudged = weights["w"].clone()
    nudged[7, 3] = torch.nextafter(nudged[7, 3], torch.tensor(float("inf")))  # the last bit of one entry
    with pytest.raises(SpecdraftError, match=r"do not match the saved ones \(w differs\)"):
        check_fingerprint(tmp_path, {**weights, "w": nudged}, {FINGERPRINT_KEY: one})
    # same values, another dtype: not the saved tensor
    with pytest.raises(SpecdraftError, match="do not match"):
        check_fingerprint(tmp_path, {**weights, "b": weights["b"].float()}, {FINGERPRINT_KEY: one})
