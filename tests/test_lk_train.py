"""The LK losses (draft.loss: lk_alpha | lk_lambda, SpecForge's) train EAGLE-3 and P-EAGLE: the
loss falls and the logged acceptance sum_v min(p, q) rises. Their values and gradients against the
formulas: tests/test_loss_formulas.py. A draft vocab smaller than the target's (64 of 512) so the
acceptance reads the target's whole-vocabulary normaliser."""

import json

import pytest

from helpers import train_run

CASES = {
    "eagle3-lk_lambda": {"draft.type": "eagle3", "draft.loss": "lk_lambda", "draft.ttt_steps": 2},
    "peagle-lk_alpha": {"draft.type": "peagle", "draft.loss": "lk_alpha", "draft.num_depths": 3,
                        "draft.mask_token_id": 3},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_lk_loss_trains_and_raises_the_acceptance(case, tiny_target_dir, data_dir, tmp_path):
    result = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=60, save_steps=60,
                       **{"draft.draft_vocab_size": 64, **CASES[case]})
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accept = [r["objective/accept"] for r in rows if "objective/accept" in r]
    loss = CASES[case]["draft.loss"]
    assert len(accept) == 60 and all(f"objective/{loss}" in r for r in rows if "loss" in r)
    assert sum(accept[-5:]) / 5 > accept[0] + 0.05, accept
    assert all(0.0 <= a <= 1.0 for a in accept)
