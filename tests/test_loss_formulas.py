"""Issue 35's losses (D-PACE, LK) against direct transcriptions of their formulas: values and
gradients on random tensors; D-PACE also against speculators' own `dpace_loss_decay`."""

import json
import math

import pytest
import torch

from specdraft.drafts.lk import acceptance_rate, lk_loss, lk_ttt_loss
from specdraft.drafts.objectives import dpace_loss, dpace_weights
from speculators_env import run_in_speculators


def _ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(
        labels.shape
    )


def _dpace_by_hand(ce, mask, alpha):
    """The formula read slot by slot, in Python floats: s = (1-a) exp(-ce) + a (1 if masked),
    prefix_k = prod_{j<=k} s_j, w_k = m_k sum_{j>=k} prefix_j m_j."""
    blocks, S = ce.shape
    w = [[0.0] * S for _ in range(blocks)]
    for b in range(blocks):
        prefix, running = [], 1.0
        for k in range(S):
            s = (1 - alpha) * math.exp(-float(ce[b, k])) + alpha if mask[b, k] else 1.0
            running *= s
            prefix.append(running)
        for k in range(S):
            w[b][k] = float(mask[b, k]) * sum(prefix[j] * float(mask[b, j]) for j in range(k, S))
    return torch.tensor(w)


def _block_case(seed=0, blocks=5, S=6, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(blocks, S, V, generator=g) * 2
    labels = torch.randint(0, V, (blocks, S), generator=g)
    mask = torch.rand(blocks, S, generator=g) > 0.25
    mask[:, 0] = False  # DFlash's anchor slot
    return logits, labels, mask


@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_weights_and_loss_match_the_formula(alpha):
    logits, labels, mask = _block_case()
    ce = _ce(logits, labels)
    expected_w = _dpace_by_hand(ce, mask, alpha)
    torch.testing.assert_close(dpace_weights(ce, mask, alpha), expected_w, rtol=1e-6, atol=1e-6)
    if alpha == 1.0:  # s = 1 everywhere: w_k = number of counted slots from k on
        counted = mask.float().flip(-1).cumsum(-1).flip(-1) * mask
        torch.testing.assert_close(dpace_weights(ce, mask, alpha), counted)
    # value and gradient: the weights are constants, so d loss / d logits = w * d ce / d logits / (sum m + eps)
    x = logits.clone().requires_grad_(True)
    loss = dpace_loss(_ce(x, labels), mask, alpha)
    loss.backward()
    y = logits.clone().requires_grad_(True)
    by_hand = (expected_w * _ce(y, labels) * mask).sum() / (mask.sum() + 1e-5)
    by_hand.backward()
    torch.testing.assert_close(loss, by_hand, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)
    assert (x.grad[~mask] == 0).all()  # an uncounted slot (the anchor) learns nothing


def test_dpace_refuses_alpha_outside_0_1():
    with pytest.raises(ValueError, match=r"\(0, 1\], got 0"):
        dpace_weights(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.0)


SPECULATORS_DPACE = r"""
import json, sys, torch
from speculators.losses import dpace_loss_decay, loss_function, eager
case = json.loads(sys.argv[1])
logits = torch.tensor(case["logits"])          # [1, blocks*S, V]
targets = torch.tensor(case["targets"])        # target logits whose argmax is the label
mask = torch.tensor(case["mask"])              # [1, blocks*S]
S = case["S"]
from functools import partial
decay = partial(dpace_loss_decay, loss_mask=mask, block_size=S, dpace_alpha=case["alpha"])
x = logits.clone().requires_grad_(True)
loss = loss_function(x, targets, mask, torch.arange(mask.shape[1])[None] % S, loss_fn=eager.ce_loss, decay_fn=decay)
loss.backward()
ce = eager.ce_loss(logits, targets) * mask
w = dpace_loss_decay(None, mask, S, case["alpha"], ce)
print(json.dumps({"loss": loss.item(), "grad": x.grad.tolist(), "weights": w.tolist()}))
"""


def test_dpace_matches_speculators_own_function():
    logits, labels, mask = _block_case(seed=3)
    blocks, S, V = logits.shape
    targets = torch.nn.functional.one_hot(labels, V).float() * 10  # argmax = label
    case = {
        "logits": logits.reshape(1, -1, V).tolist(),
        "targets": targets.reshape(1, -1, V).tolist(),
        "mask": mask.reshape(1, -1).float().tolist(),
        "S": S,
        "alpha": 0.5,
    }
    theirs = run_in_speculators(SPECULATORS_DPACE, json.dumps(case))
    x = logits.clone().requires_grad_(True)
    ours = dpace_loss(_ce(x, labels), mask, 0.5)
    ours.backward()
    torch.testing.assert_close(
        dpace_weights(_ce(logits, labels), mask, 0.5),
        torch.tensor(theirs["weights"]).view(blocks, S),
        rtol=1e-5,
        atol=1e-6,
    )
    assert ours.item() == pytest.approx(theirs["loss"], rel=1e-5)
    torch.testing.assert_close(x.grad, torch.tensor(theirs["grad"]).view(blocks, S, V), rtol=1e-4, atol=1e-7)


def _lk_case(seed=0, N=9, Vd=7, V=10):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(N, Vd, generator=g) * 2
    target_full = torch.softmax(torch.randn(N, V, generator=g) * 2, dim=-1)
    on_draft = target_full[:, :Vd]  # the draft vocab: the first Vd target ids
    renorm = on_draft / on_draft.sum(-1, keepdim=True)
    mask = torch.rand(N, generator=g) > 0.3
    return draft, renorm, on_draft, mask


def _lk_by_hand(draft, renorm, on_draft, mask, mode, kl_scale=1.0, kl_decay=1.0):
    """Row by row: alpha_r = sum_v min(p_on_draft, softmax(z)); SpecForge's alpha / lambda modes."""
    alphas, kls = [], []
    for r in range(draft.shape[0]):
        q = torch.exp(draft[r] - torch.logsumexp(draft[r], 0))
        alphas.append(sum(torch.min(on_draft[r, v], q[v]) for v in range(draft.shape[1])))
        kls.append(sum(renorm[r, v] * (torch.log(renorm[r, v]) - torch.log(q[v])) for v in range(draft.shape[1])))
    kept = [r for r in range(draft.shape[0]) if mask[r]]
    if mode == "alpha":
        return -sum(torch.log(alphas[r]) for r in kept) / len(kept)
    mean_alpha = sum(alphas[r] for r in kept) / len(kept)
    lam = kl_scale * math.exp(-kl_decay * float(mean_alpha.detach()))
    return lam * sum(kls[r] for r in kept) / len(kept) + (1 - lam) * (1 - mean_alpha)


@pytest.mark.parametrize("mode,kl_scale,kl_decay", [("alpha", 1.0, 1.0), ("lambda", 1.0, 1.0), ("lambda", 0.7, 3.0)])
def test_lk_loss_matches_the_formula(mode, kl_scale, kl_decay):
    draft, renorm, on_draft, mask = _lk_case()
    x = draft.clone().requires_grad_(True)
    ours = lk_loss(x, renorm, on_draft, mask, mode, kl_scale, kl_decay)
    ours.backward()
    y = draft.clone().requires_grad_(True)
    by_hand = _lk_by_hand(y, renorm, on_draft, mask, mode, kl_scale, kl_decay)
    by_hand.backward()
    torch.testing.assert_close(ours, by_hand.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)
    assert (x.grad[~mask] == 0).all()


def test_lk_acceptance_reads_the_unrenormalised_target():
    draft, renorm, on_draft, mask = _lk_case(seed=1)
    alpha = acceptance_rate(on_draft, draft)
    assert (alpha <= on_draft.sum(-1) + 1e-6).all()  # never more than the target's draft-vocab mass
    assert (alpha < acceptance_rate(renorm, draft)).all()


def test_lk_lambda_weight_is_detached_and_matches_identities():
    draft, renorm, on_draft, mask = _lk_case(seed=2)
    # kl_scale = 0: lam = 0, the loss is 1 - mean alpha exactly
    alpha = acceptance_rate(on_draft, draft)
    expected = 1 - (alpha * mask).sum() / mask.sum()
    torch.testing.assert_close(lk_loss(draft, renorm, on_draft, mask, "lambda", kl_scale=0.0), expected)
    with pytest.raises(ValueError, match="lk mode"):
        lk_loss(draft, renorm, on_draft, mask, "beta")


def test_lk_ttt_steps_weigh_0_8_to_the_i():
    steps = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    assert lk_ttt_loss(steps).item() == pytest.approx(1.0 + 0.8 * 2.0 + 0.64 * 4.0)


# -- the LK losses as training computes them: the chunked objective against lk_loss above ---------


def _lk_training_case(seed=0, N=11, H=6, Ht=5, Vd=7, V=10):
    """A draft head over a draft vocab (the first Vd target ids) and a target over V: the chunked
    objective's inputs, and lk_loss's (the renormalised teacher, the unrenormalised acceptance)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    head = torch.randn(Vd, H, generator=g)
    final = torch.randn(N, Ht, generator=g)
    target_head = torch.randn(V, Ht, generator=g)
    keep = torch.rand(N, generator=g) > 0.3
    return hidden, head, final, target_head, keep


def _lk_reference(hidden, head, final, target_head, keep, mode):
    Vd = head.shape[0]
    t_full = final @ target_head.t()
    on_draft = torch.softmax(t_full, dim=-1)[:, :Vd]
    renorm = torch.softmax(t_full[:, :Vd], dim=-1)
    return keep.sum() * lk_loss(hidden @ head.t(), renorm, on_draft, keep, mode)


@pytest.mark.parametrize("name", ["lk_alpha", "lk_lambda"])
@pytest.mark.parametrize("chunk,frozen_head", [(3, False), (64, False), (3, True)])
def test_the_trained_lk_losses_equal_the_reference_with_gradients(name, chunk, frozen_head):
    """chunked_objective (what EAGLE-3 / P-EAGLE train on) = (counted rows) x lk_loss, the formula
    tested above: a sum over the teacher's kept rows, lambda from their mean acceptance; the
    acceptance reads the target over its whole vocab (teacher_lse), the KL the renormalised one."""
    from specdraft.drafts.loss import whole_vocab_pass
    from specdraft.drafts.objectives import chunked_objective
    from specdraft.drafts.objective_options import parse_objective

    hidden, head, final, target_head, keep = _lk_training_case()
    Vd = head.shape[0]
    a = [hidden.clone().requires_grad_(), head.clone().requires_grad_(not frozen_head)]
    out = chunked_objective(
        a[0],
        a[1],
        final,
        target_head[:Vd],
        None,
        parse_objective(name),
        chunk,
        teacher_keep=keep,
        teacher_lse=whole_vocab_pass(final, target_head, 4)[0],
    )
    out.loss.backward()
    b = [hidden.clone().requires_grad_(), head.clone().requires_grad_()]
    expected = _lk_reference(*b, final, target_head, keep, name[3:])
    expected.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[0].grad, b[0].grad, rtol=1e-5, atol=1e-6)
    if not frozen_head:  # a frozen head: the hidden-state gradient is made in the forward pass
        torch.testing.assert_close(a[1].grad, b[1].grad, rtol=1e-5, atol=1e-6)
    assert (a[0].grad[~keep] == 0).all()
    on_draft = torch.softmax(final @ target_head.t(), dim=-1)[:, :Vd]
    alpha = acceptance_rate(on_draft, hidden @ head.t())
    torch.testing.assert_close(out.terms["accept"], (alpha * keep).sum())  # the logged acceptance
    assert set(out.terms) == {name, "tv", "accept"}


def test_lk_lambda_reads_the_mean_acceptance_of_the_whole_sequence():
    """Under sequence parallelism each rank holds part of a step's rows: `reduce` sums lambda's
    statistics over the group, so the two halves' losses and gradients add up to the whole's."""
    from specdraft.drafts.objectives import chunked_objective
    from specdraft.drafts.objective_options import parse_objective

    hidden, head, final, target_head, keep = _lk_training_case(seed=4, N=12)
    Vd, objective = head.shape[0], parse_objective("lk_lambda")
    lse = torch.logsumexp(final @ target_head.t(), dim=-1)
    whole_h, whole_w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    whole = chunked_objective(whole_h, whole_w, final, target_head[:Vd], None, objective, 5, keep, lse)
    whole.loss.backward()
    halves = [slice(0, 5), slice(5, 12)]
    stats = [
        chunked_objective(hidden[s], head, final[s], target_head[:Vd], None, objective, 5, keep[s], lse[s])
        for s in halves
    ]
    part_h, part_w, total = hidden.clone().requires_grad_(), head.clone().requires_grad_(), 0.0
    for i, s in enumerate(halves):
        other = iter([stats[1 - i].terms["accept"], keep[halves[1 - i]].sum().float()])
        out = chunked_objective(
            part_h[s],
            part_w,
            final[s],
            target_head[:Vd],
            None,
            objective,
            5,
            keep[s],
            lse[s],
            reduce=lambda x: x + next(other),
        )
        out.loss.backward()
        total = total + out.loss.detach()
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(part_h.grad, whole_h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(part_w.grad, whole_w.grad, rtol=1e-5, atol=1e-7)
