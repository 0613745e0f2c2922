"""The LK losses (draft.loss: lk_alpha | lk_lambda, SpecForge's) in EAGLE-3 and P-EAGLE: the loss
falls and the logged acceptance sum_v min(p, q) rises in training (a draft vocab smaller than the
target's, 64 of 512, so the acceptance reads the target's whole-vocabulary normaliser); EAGLE-3's
whole loss and gradients against SpecForge's per-step formula; an lk_lambda run resumes
bit-identically. The chunked objective against the formulas: tests/test_loss_formulas.py."""

import json

import pytest
import torch

from helpers import train_run
from test_eagle3 import target  # noqa: F401 (the fixture)

CASES = {
    "eagle3-lk_lambda": {"draft.type": "eagle3", "draft.loss": "lk_lambda", "draft.ttt_steps": 2},
    "peagle-lk_alpha": {
        "draft.type": "peagle",
        "draft.loss": "lk_alpha",
        "draft.num_depths": 3,
        "draft.mask_token_id": 3,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_lk_loss_trains_and_raises_the_acceptance(case, tiny_target_dir, data_dir, tmp_path):
    result = train_run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "run",
        max_steps=60,
        save_steps=60,
        **{"draft.draft_vocab_size": 64, **CASES[case]},
    )
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    accept = [r["objective/accept"] for r in rows if "objective/accept" in r]
    loss = CASES[case]["draft.loss"]
    assert len(accept) == 60 and all(f"objective/{loss}" in r for r in rows if "loss" in r)
    assert sum(accept[-5:]) / 5 > accept[0] + 0.05, accept
    assert all(0.0 <= a <= 1.0 for a in accept)


# -- EAGLE-3's whole loss against SpecForge's per-step formula (float64 transcription) ------------


def specforge_step(z, p_on_draft, p_renorm, mask, mode, counted):
    """One TTT step as SpecForge computes it: alpha_r = sum min(p_on_draft, softmax z); alpha mode
    -sum of log alpha_r (0 where alpha_r = 0); lambda mode lam = exp(-sg(mean alpha over the kept
    rows)), lam KL + (1 - lam)(1 - alpha) summed; both over `counted` rows (specdraft's in_vocab
    rows: a dropped row adds nothing and the mean stays over every counted row)."""
    m = mask.double()
    q = torch.softmax(z, -1)
    alpha = torch.minimum(p_on_draft, q).sum(-1)
    if mode == "alpha":
        return -(torch.where(alpha > 0, torch.log(alpha), 0.0) * m).sum() / counted
    kl = (p_renorm * (torch.log(p_renorm) - torch.log_softmax(z, -1))).sum(-1)
    lam = torch.exp(-((alpha * m).sum() / m.sum()).detach())
    return lam * (kl * m).sum() / counted + (1 - lam) * ((1 - alpha) * m).sum() / counted


@pytest.mark.parametrize("mode", ["alpha", "lambda"])
@pytest.mark.parametrize("teacher_rows", ["in_vocab", "all"])
def test_eagle3_lk_is_specforge_per_step_weighted_0_8_to_the_k(target, mode, teacher_rows):  # noqa: F811
    """Each TTT step: SpecForge's LK against the target restricted to the draft vocab (80 of 96;
    acceptance: its probabilities before renormalising), over the step's counted rows; steps
    weighted 0.8^k; the gradient of every parameter."""
    from specdraft.drafts.eagle3.vocab import draft_to_target_ids
    from specdraft.train.model import TargetWithDraft
    from test_eagle3 import T, VOCAB, eagle3_for, features_of

    draft = eagle3_for(target, loss=f"lk_{mode}", teacher_rows=teacher_rows)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[:, 3:6] = 0
    feats = features_of(target, draft, ids)
    out = TargetWithDraft(target, draft, loss_chunk_size=5)(ids, mask)
    params = list(draft.parameters())
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)

    used = draft_to_target_ids(draft.d2t)
    heads = draft.unroll(draft.aux_hidden(feats), feats.input_embeds, 3)
    full = feats.final_hidden @ target.lm_head.weight.t()
    ref, alpha_sum, rows = 0.0, 0.0, 0
    for k, head in enumerate(heads):
        counted = torch.zeros_like(mask, dtype=torch.bool)
        counted[:, : T - 2 - k] = mask[:, 2 + k :].bool()
        z = draft.logits(head)[counted]
        teacher = full[:, 1 + k :][counted[:, : T - 1 - k]]
        keep = (
            torch.isin(teacher.argmax(-1), used) if teacher_rows == "in_vocab" else torch.ones(len(z), dtype=torch.bool)
        )
        ref = ref + 0.8**k * specforge_step(
            z.double(),
            torch.softmax(teacher.double(), -1)[:, used],
            torch.softmax(teacher[:, used].double(), -1),
            keep,
            mode,
            int(counted.sum()),
        )
        on_draft = torch.softmax(teacher, -1)[:, used]
        alpha_sum += float((torch.minimum(on_draft, torch.softmax(z.detach(), -1)).sum(-1) * keep).sum())
        rows += int(counted.sum())
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    torch.testing.assert_close(out.loss.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
    total, count = out.metrics["objective/accept"]
    assert float(total) == pytest.approx(alpha_sum, rel=1e-5) and int(count) == rows


def test_an_lk_lambda_run_resumes_bit_identically(tiny_target_dir, data_dir, tmp_path):
    """lam is recomputed from the batch after a resume: the resumed steps' losses are the straight run's."""
    extra = {"draft.type": "eagle3", "draft.ttt_steps": 2, "draft.loss": "lk_lambda", "draft.draft_vocab_size": 64}
    straight = train_run(tiny_target_dir, data_dir, tmp_path, "straight", max_steps=6, save_steps=3, **extra)
    resumed = train_run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "resumed",
        max_steps=6,
        save_steps=3,
        resume=tmp_path / "straight" / "ckpt" / "step_3",
        **extra,
    )
    assert len(resumed.losses) == 3 and resumed.losses == straight.losses[3:]
