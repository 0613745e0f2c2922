"""Training objectives (ce, soft_ce, kl, tv, mixtures): each equals a plain-PyTorch reference, in
loss and gradients, chunked or not; zero exactly at q = p; finite in bf16; config parsing."""

import math
import shlex

import pytest
import torch
import torch.nn.functional as F

from specdraft.drafts.base import LossBatch
from specdraft.config import DraftConfig, load_config
from specdraft.drafts.loss import chunked_cross_entropy
from specdraft.drafts.objectives import CE, chunked_objective
from specdraft.drafts.objective_options import LK_OBJECTIVES, OBJECTIVES, parse_objective

# the LK losses (temperature 1 only) have their own reference tests: tests/test_loss_formulas.py
SUMMED = [name for name in OBJECTIVES if name not in LK_OBJECTIVES]
from specdraft.errors import SpecdraftError

torch.set_num_threads(1)

N, H, V = 13, 16, 40  # rows, hidden, vocab


def tensors(seed=0, dtype=torch.float32, teacher_hidden_size=H, vocab=V):
    g = torch.Generator().manual_seed(seed)
    student_hidden = torch.randn(N, H, generator=g).to(dtype)
    student_weight = (torch.randn(vocab, H, generator=g) * 0.7).to(dtype)
    teacher_hidden = torch.randn(N, teacher_hidden_size, generator=g).to(dtype)
    teacher_weight = (torch.randn(vocab, teacher_hidden_size, generator=g) * 0.7).to(dtype)
    labels = torch.randint(0, vocab, (N,), generator=g)
    return student_hidden, student_weight, teacher_hidden, teacher_weight, labels


def reference_terms(z, t, labels, temperature):
    """Each objective summed over rows, from whole (N, V) logits with autograd-able ops."""
    log_q = F.log_softmax(z / temperature, dim=-1)
    log_p = F.log_softmax(t / temperature, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    return {
        "ce": F.cross_entropy(z, labels, reduction="sum"),
        "soft_ce": -(p * log_q).sum(),
        "kl": F.kl_div(log_q, log_p, log_target=True, reduction="sum"),
        "tv": 0.5 * (p - q).abs().sum(),
    }


def run(objective, hidden, weight, t_hidden, t_weight, labels, chunk_size=4, train_weight=False):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(train_weight)
    out = chunked_objective(hidden, weight, t_hidden, t_weight, labels, objective, chunk_size)
    out.loss.backward()
    return out, hidden.grad, weight.grad


@pytest.mark.parametrize("spec", SUMMED + ["0.9*tv + 0.1*ce", "0.5*kl+0.25*soft_ce+tv+2*ce"])
@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen_head", "trained_head"])
def test_objective_equals_a_plain_pytorch_reference_in_loss_and_gradients(spec, train_weight):
    objective = parse_objective(spec, temperature=0.7)
    hidden, weight, t_hidden, t_weight, labels = tensors()
    out, grad_hidden, grad_weight = run(
        objective, hidden, weight, t_hidden, t_weight, labels, train_weight=train_weight
    )

    ref_hidden = hidden.clone().requires_grad_(True)
    ref_weight = weight.clone().requires_grad_(train_weight)
    terms = reference_terms(ref_hidden @ ref_weight.t(), t_hidden @ t_weight.t(), labels, 0.7)
    ref_loss = sum(w * terms[name] for name, w in objective.weights)
    ref_loss.backward()

    torch.testing.assert_close(out.loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_hidden, ref_hidden.grad, rtol=1e-4, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(grad_weight, ref_weight.grad, rtol=1e-4, atol=1e-6)
    else:
        assert grad_weight is None
    for name, value in out.terms.items():  # every reported term, tv included when there is a teacher
        torch.testing.assert_close(value, terms[name].detach(), rtol=1e-5, atol=1e-5)
    assert ("tv" in out.terms) == objective.needs_teacher


@pytest.mark.parametrize("spec", ["0.9*tv + 0.1*ce", "kl", "ce", "lk_lambda"])
def test_a_trained_tail_of_a_frozen_head_gets_the_gradient_autograd_gives_its_columns(spec):
    """DSpark's head [lm_head | markov_w2]: weight_tail is the trained w2; its gradient (and the
    hidden rows') equal autograd's through the whole concatenated weight, the frozen columns get
    none, and the loss is the same as without a tail. lk_lambda takes the recomputing path."""
    objective = parse_objective(spec, temperature=1.0 if spec == "lk_lambda" else 0.7)
    hidden, weight, t_hidden, t_weight, labels = tensors()
    rank = 5
    frozen, tail = weight[:, : H - rank], weight[:, H - rank :].clone().requires_grad_(True)
    ours = hidden.clone().requires_grad_(True)
    out = chunked_objective(
        ours, torch.cat([frozen, tail], dim=1), t_hidden, t_weight, labels, objective, 4, weight_tail=tail
    )
    out.loss.backward()

    ref_hidden, ref_tail = hidden.clone().requires_grad_(True), tail.detach().clone().requires_grad_(True)
    ref = chunked_objective(
        ref_hidden, torch.cat([frozen, ref_tail], dim=1), t_hidden, t_weight, labels, objective, 4
    )  # the recomputing path, through the whole weight
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.grad, ref_hidden.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(tail.grad, ref_tail.grad, rtol=1e-5, atol=1e-7)
    assert tail.grad.shape == (V, rank) and torch.count_nonzero(tail.grad) > 0
    if spec != "lk_lambda":  # and both equal plain autograd on whole logits
        plain_hidden, plain_tail = hidden.clone().requires_grad_(True), tail.detach().clone().requires_grad_(True)
        terms = reference_terms(
            plain_hidden @ torch.cat([frozen, plain_tail], 1).t(), t_hidden @ t_weight.t(), labels, 0.7
        )
        sum(w * terms[name] for name, w in objective.weights).backward()
        torch.testing.assert_close(tail.grad, plain_tail.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ours.grad, plain_hidden.grad, rtol=1e-4, atol=1e-6)


def test_a_tail_of_no_rows_is_connected_and_the_tail_must_be_the_weights_columns():
    tail = torch.randn(V, 3, requires_grad=True)
    out = chunked_objective(
        torch.zeros(0, H, requires_grad=True),
        torch.cat([torch.randn(V, H - 3), tail], 1),
        torch.zeros(0, H),
        torch.randn(V, H),
        torch.zeros(0, dtype=torch.long),
        parse_objective("tv"),
        4,
        weight_tail=tail,
    )
    out.loss.backward()
    assert tail.grad.shape == (V, 3) and torch.count_nonzero(tail.grad) == 0
    with pytest.raises(ValueError, match=r"weight_tail \(7, 3\): not columns of \(40, 16\)"):
        chunked_objective(*tensors()[:4], None, parse_objective("tv"), 4, weight_tail=torch.zeros(7, 3))


def test_a_mixture_equals_the_weighted_sum_of_its_terms():
    hidden, weight, t_hidden, t_weight, labels = tensors(seed=1)
    mixed, mixed_grad, _ = run(parse_objective({"tv": 0.9, "ce": 0.1}, 1.3), hidden, weight, t_hidden, t_weight, labels)
    tv, tv_grad, _ = run(parse_objective("tv", 1.3), hidden, weight, t_hidden, t_weight, labels)
    ce, ce_grad, _ = run(parse_objective("ce", 1.3), hidden, weight, t_hidden, t_weight, labels)
    torch.testing.assert_close(mixed.loss, 0.9 * tv.loss + 0.1 * ce.loss)
    torch.testing.assert_close(mixed_grad, 0.9 * tv_grad + 0.1 * ce_grad)
    assert mixed.terms["tv"] == tv.terms["tv"] and mixed.terms["ce"] == ce.terms["ce"]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_kl_and_tv_are_zero_exactly_when_q_equals_p_and_soft_ce_is_the_teachers_entropy(temperature):
    hidden, weight, _, _, labels = tensors(seed=2)
    for name in ("kl", "tv", "soft_ce"):
        # the student IS the teacher: same hidden states, same head
        out, grad, _ = run(parse_objective(name, temperature), hidden, weight, hidden, weight, labels, chunk_size=N)
        log_p = F.log_softmax(hidden @ weight.t() / temperature, dim=-1)
        entropy = -(log_p.exp() * log_p).sum()
        assert out.terms["tv"].item() == 0.0
        if name == "kl":
            assert out.loss.item() == 0.0
            assert torch.count_nonzero(grad) == 0  # q - p is exactly 0
        if name == "tv":
            assert out.loss.item() == 0.0
            assert torch.count_nonzero(grad) == 0  # sign(q - p) is exactly 0
        if name == "soft_ce":
            assert out.loss.item() == pytest.approx(entropy.item(), rel=1e-6)  # H(p), up to summation order
            assert torch.count_nonzero(grad) == 0  # same gradient as KL
    # and KL is not zero a hair away from q = p
    out, _, _ = run(parse_objective("kl"), hidden + 1e-2, weight, hidden, weight, labels)
    assert out.loss.item() > 0


@pytest.mark.parametrize("spec", SUMMED + ["0.9*tv + 0.1*ce"])
def test_chunked_equals_unchunked_loss_and_gradients(spec):
    objective = parse_objective(spec, 0.8)
    hidden, weight, t_hidden, t_weight, labels = tensors(seed=3)
    whole, whole_grad, whole_wgrad = run(
        objective, hidden, weight, t_hidden, t_weight, labels, chunk_size=N, train_weight=True
    )
    for chunk in (1, 3, 5):
        out, grad, wgrad = run(
            objective, hidden, weight, t_hidden, t_weight, labels, chunk_size=chunk, train_weight=True
        )
        torch.testing.assert_close(out.loss, whole.loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wgrad, whole_wgrad, rtol=1e-5, atol=1e-6)
        assert out.correct == whole.correct


@pytest.mark.parametrize("spec", SUMMED + ["0.9*tv + 0.1*ce"])
def test_gradients_are_finite_with_bf16_inputs_and_follow_the_fp32_ones(spec):
    objective = parse_objective(spec, 0.7)
    # (a seed without a near-tie q_j ~ p_j on a large entry: TV's gradient jumps there)
    bf16 = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in tensors(seed=5)]
    out, grad, wgrad = run(objective, *bf16, train_weight=True)
    ref, ref_grad, ref_wgrad = run(
        objective, *[x.float() if x.is_floating_point() else x for x in bf16], train_weight=True
    )
    assert grad.dtype == wgrad.dtype == torch.bfloat16
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and torch.isfinite(wgrad).all()
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=1e-2)
    for ours, exact in ((grad, ref_grad), (wgrad, ref_wgrad)):  # bf16 rounding: ~0.5% of the norm
        assert float((ours.float() - exact).norm() / exact.norm()) < 0.03


def test_ce_objective_equals_the_existing_chunked_cross_entropy():
    hidden, weight, _, _, labels = tensors(seed=5)
    out, grad, _ = run(CE, hidden, weight, None, None, labels, chunk_size=4)
    h = hidden.clone().requires_grad_(True)
    total, correct = chunked_cross_entropy(h, weight, labels, chunk_size=4)
    total.backward()
    assert torch.equal(out.loss, total.detach()) and int(out.correct) == int(correct)
    # the CE's in-place gradient (softmax - onehot, computed in its buffer) orders its float ops
    # differently from the objective's: equal up to the last bit of fp32
    torch.testing.assert_close(grad, h.grad, rtol=1e-6, atol=1e-7)


def test_restricted_vocab_teacher_is_the_target_distribution_renormalised_over_the_draft_vocab():
    """EAGLE-3's teacher: the target's logits at the draft vocabulary's ids (lm_head rows), softmax
    over those; the student's own head spans the draft vocabulary and is trained."""
    full_vocab, draft_ids = 50, torch.tensor([3, 7, 8, 20, 21, 33, 40, 49])
    g = torch.Generator().manual_seed(6)
    target_hidden = torch.randn(N, 24, generator=g)  # the target may be wider than the student
    target_head = torch.randn(full_vocab, 24, generator=g)
    hidden = torch.randn(N, H, generator=g)
    draft_head = torch.randn(len(draft_ids), H, generator=g)
    labels = torch.randint(0, len(draft_ids), (N,), generator=g)
    objective = parse_objective("soft_ce + 0.5*ce", 1.0)
    out, grad, wgrad = run(
        objective, hidden, draft_head, target_hidden, target_head[draft_ids], labels, train_weight=True
    )

    ref_h, ref_w = hidden.clone().requires_grad_(True), draft_head.clone().requires_grad_(True)
    full = target_hidden @ target_head.t()  # (N, full_vocab)
    p = F.softmax(full[:, draft_ids], dim=-1)
    z = ref_h @ ref_w.t()
    ref = -(p * F.log_softmax(z, -1)).sum() + 0.5 * F.cross_entropy(z, labels, reduction="sum")
    ref.backward()
    torch.testing.assert_close(out.loss, ref.detach())
    torch.testing.assert_close(grad, ref_h.grad)
    torch.testing.assert_close(wgrad, ref_w.grad)


def test_accuracy_counts_label_hits_or_teacher_argmax_hits_without_labels():
    hidden, weight, t_hidden, t_weight, labels = tensors(seed=7)
    z, t = hidden @ weight.t(), t_hidden @ t_weight.t()
    with_labels = chunked_objective(hidden, weight, t_hidden, t_weight, labels, parse_objective("tv+ce"), 4)
    without = chunked_objective(hidden, weight, t_hidden, t_weight, None, parse_objective("kl"), 4)
    assert int(with_labels.correct) == int((z.argmax(-1) == labels).sum())
    assert torch.equal(with_labels.argmax, z.argmax(-1)) and torch.equal(without.argmax, z.argmax(-1))
    assert int(without.correct) == int((z.argmax(-1) == t.argmax(-1)).sum())
    labels[:] = z.argmax(-1)
    assert int(chunked_objective(hidden, weight, None, None, labels, CE, 4).correct) == N


def test_no_rows_gives_a_connected_zero_loss():
    hidden = torch.zeros(0, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    out = chunked_objective(
        hidden,
        weight,
        torch.zeros(0, H),
        torch.randn(V, H),
        torch.zeros(0, dtype=torch.long),
        parse_objective("tv+ce"),
        4,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and hidden.grad.shape == (0, H) and torch.count_nonzero(weight.grad) == 0
    assert set(out.terms) == {"tv", "ce"}


def test_every_tensor_is_made_on_the_inputs_device():
    """On the meta device a stray CPU tensor fails the op that meets it."""
    hidden, weight, t_hidden, t_weight, labels = (x.to("meta") for x in tensors())
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = chunked_objective(hidden, weight, t_hidden, t_weight, labels, parse_objective("tv+kl+soft_ce+ce"), 4)
    out.loss.backward()
    assert out.loss.device.type == out.correct.device.type == hidden.grad.device.type == "meta"
    tail = torch.zeros(V, 3, device="meta", requires_grad=True)  # DSpark's trained tail
    chunked_objective(
        hidden, weight.detach(), t_hidden, t_weight, labels, parse_objective("tv+ce"), 4, weight_tail=tail
    ).loss.backward()
    assert tail.grad.device.type == "meta"
    assert all(v.device.type == "meta" for v in out.terms.values())


# -- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, weights",
    [
        ("ce", (("ce", 1.0),)),
        ("tv", (("tv", 1.0),)),
        ("0.9*tv + 0.1*ce", (("ce", 0.1), ("tv", 0.9))),
        ("0.9 * tv+0.1*ce", (("ce", 0.1), ("tv", 0.9))),
        ("1e-1*kl + soft_ce", (("soft_ce", 1.0), ("kl", 0.1))),
        ({"tv": 0.9, "ce": 0.1}, (("ce", 0.1), ("tv", 0.9))),
        ({"tv": 1, "ce": 0}, (("tv", 1.0),)),  # a zero weight drops the term
    ],
)
def test_parse_objective(spec, weights):
    objective = parse_objective(spec, 0.7)
    assert objective.weights == weights and objective.temperature == 0.7
    assert objective.needs_teacher == any(n != "ce" for n, _ in weights)


@pytest.mark.parametrize(
    "spec, temperature, message",
    [
        ("tvv", 1.0, "unknown objective 'tvv' (choose from ce, soft_ce, kl, tv, lk_alpha, lk_lambda)"),
        ({"tv": 0.9, "cee": 0.1}, 1.0, "unknown objective 'cee'"),
        ("0.9*tv + -0.1*ce", 1.0, "weight of 'ce' must be >= 0, got -0.1"),
        ({"tv": -1}, 1.0, "weight of 'tv' must be >= 0, got -1"),
        ({"tv": "lots"}, 1.0, "weight of 'tv' must be a number, got 'lots'"),
        ("much*tv", 1.0, "weight of 'tv' must be a number, got 'much'"),
        ("tv + tv", 1.0, "objective 'tv' given twice"),
        ({"tv": 0, "ce": 0}, 1.0, "no objective has a positive weight"),
        ("tv +", 1.0, "cannot read ''"),
        (3, 1.0, "expected an objective name"),
        ("tv", 0.0, "must be a number > 0, got 0.0"),
    ],
)
def test_parse_objective_rejects_with_one_line(spec, temperature, message):
    with pytest.raises(SpecdraftError) as err:
        parse_objective(spec, temperature)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "draft.loss=tvv",
            "key 'draft.loss': unknown objective 'tvv' (choose from ce, soft_ce, kl, tv, lk_alpha, lk_lambda)",
        ),
        ("draft.loss={tv: 0.9, ce: -0.1}", "key 'draft.loss': weight of 'ce' must be >= 0, got -0.1"),
        ("draft.distill_temperature=0", "key 'draft.distill_temperature': must be > 0, got 0.0"),
        ("eval_temperature=-0.5", "key 'eval_temperature': must be >= 0, got -0.5"),
        ("draft.distill_tokens=prompts", "key 'draft.distill_tokens': must be one of answers, all, got 'prompts'"),
        ("draft.loss=ce", None),  # valid alone; with distill_tokens=all below it is not
        (
            "draft.loss=lk_alpha",
            "key 'draft.loss': lk_alpha is an LK loss, trained by draft.type eagle3 and peagle only, not 'glide'",
        ),
        (
            "draft.type=dflash draft.loss=lk_lambda",
            "lk_lambda is an LK loss, trained by draft.type eagle3 and peagle only, not 'dflash'",
        ),
        (
            "draft.type=eagle3 draft.loss='lk_alpha + lk_lambda'",
            "key 'draft.loss': lk_alpha and lk_lambda are two modes of one loss; choose one",
        ),
        (
            "draft.type=peagle draft.loss=lk_lambda draft.distill_temperature=0.7",
            "key 'draft.loss': the LK losses compare the target's and the draft's sampling distributions at temperature 1; "
            "draft.distill_temperature is 0.7",
        ),
    ],
)
def test_a_bad_objective_in_the_config_is_one_line_and_exit_2(tmp_path, capsys, override, expected):
    from specdraft.cli import main

    (tmp_path / "target").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"target: {tmp_path / 'target'}\ndata_files: {tmp_path}/d.jsonl\n"
        f"output_dir: {tmp_path / 'out'}\ndraft:\n  loss: {{tv: 0.9, ce: 0.1}}\n"
    )
    override = shlex.split(override) if override.startswith("draft.type=") else [override]  # several keys
    overrides = override if expected else [*override, "draft.distill_tokens=all"]
    expected = expected or "key 'draft.distill_tokens': 'all' needs a teacher term in draft.loss"
    assert main(["train", str(config), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and expected in err
    assert not (tmp_path / "out").exists()


def test_distill_tokens_all_reaches_every_family_and_needs_a_teacher_term(tmp_path):
    """'all' moves the teacher terms onto every token; a family whose default objective has no
    teacher (GLIDE's ce) refuses it without draft.loss, EAGLE-3's soft_ce default takes it."""
    from specdraft.drafts.objective_options import objective_from_options

    (tmp_path / "target").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    base = [f"target={tmp_path / 'target'}", f"data_files={tmp_path}/d.jsonl", "draft.distill_tokens=all"]
    with pytest.raises(SpecdraftError, match="'all' needs a teacher term in draft.loss .*; ce learns answers only"):
        load_config(None, base)
    eagle = load_config(None, base + ["draft.type=eagle3"])
    assert objective_from_options(eagle.draft, "soft_ce").all_tokens
    glide = load_config(None, base + ["draft.loss=0.9*tv + 0.1*ce"])
    objective = objective_from_options(glide.draft, "ce")
    assert objective.all_tokens and str(objective) == "0.1*ce + 0.9*tv (T=1, all tokens)"
    assert not objective_from_options(load_config(None, base[:2] + ["draft.loss=tv"]).draft, "ce").all_tokens


def test_over_rows_keeps_ce_the_mean_over_answer_rows():
    objective = parse_objective("0.9*tv + 0.1*ce")
    assert objective.over_rows(10, 4).weights == (("ce", 0.1 * 10 / 4), ("tv", 0.9))
    assert objective.over_rows(10, 10) is objective and objective.over_rows(10, 0) is objective
    assert parse_objective("tv").over_rows(10, 4) == parse_objective("tv")


def test_the_config_takes_a_sum_or_a_mapping_and_a_zero_weight_drops_a_term(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    base = [f"target={tmp_path / 'target'}", f"data_files={tmp_path}/d.jsonl"]
    cfg = load_config(None, base + ["draft.loss=0.9*tv + 0.1*ce", "draft.distill_temperature=0.7"])
    assert parse_objective(cfg.draft.loss, cfg.draft.distill_temperature).weights == (("ce", 0.1), ("tv", 0.9))
    config = tmp_path / "run.yaml"
    config.write_text("draft:\n  loss: {tv: 0.9, ce: 0.1}\n")
    cfg = load_config(str(config), base + ["draft.loss.ce=0"])
    assert parse_objective(cfg.draft.loss).weights == (("tv", 0.9),)
    assert load_config(None, base).draft.loss is None  # the family's default
    with pytest.raises(SpecdraftError, match="key 'draft.loss': expected an objective name, .* got a list"):
        load_config(None, base + ["draft.loss=[tv]"])
    with pytest.raises(SpecdraftError, match="cannot merge"):  # a list over a YAML mapping: one line too
        load_config(str(config), base + ["draft.loss=[tv]"])


# -- GLIDE trained with a distillation objective -------------------------------------------------


@pytest.mark.parametrize("distill_tokens", ["answers", "all"])
def test_glide_distills_the_targets_own_next_token_distribution(distill_tokens):
    """The teacher of position t is the target's distribution over token t+1 (its real logits).
    'answers': on the same counted positions as the hard-label CE. 'all': TV on every position
    with target context, prompt tokens included, while CE stays the mean over the answer tokens.
    Loss, logged terms, accuracy and every draft gradient match a whole-tensor reference."""
    from omegaconf import OmegaConf

    from helpers import random_llama
    from specdraft.drafts.registry import build_draft
    from specdraft.target.capture import capture

    target = random_llama(vocab=128, init=0.1)
    cfg = OmegaConf.structured(
        DraftConfig(sliding_window=6, loss="0.9*tv + 0.1*ce", distill_temperature=0.7, distill_tokens=distill_tokens)
    )
    draft = build_draft(cfg, target.config)
    T, lag = 20, 2
    ids = torch.randint(0, 128, (2, T))
    mask = (torch.rand(2, T) < 0.7).long()
    assert draft.capture_request().final_hidden  # asked for only when the loss reads the target
    assert not build_draft(OmegaConf.structured(DraftConfig()), target.config).capture_request().final_hidden
    feats = capture(target.model, ids, torch.arange(T)[None].expand(2, T), draft.capture_request())
    out = draft.training_loss(LossBatch(feats, target.lm_head.weight, ids, mask, chunk_size=5, options={"lag": lag}))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    draft.zero_grad()

    index = torch.arange(T)
    hidden = draft(
        feats.input_embeds,
        feats.cos,
        feats.sin,
        feats.last_keys,
        feats.last_values,
        cross_limit=index - lag,
        index=index,
    )
    answer = mask[:, 1:].bool() & (index[None, :-1] >= lag)  # t predicts an answer token, with context
    taught = answer if distill_tokens == "answers" else (index[None, :-1] >= lag).expand(2, T - 1)
    z = (hidden @ target.lm_head.weight.t())[:, :-1]
    t = target(ids).logits[:, :-1]  # the target's own logits, from a plain forward
    tv = reference_terms(z[taught], t[taught], ids[:, 1:][taught], 0.7)["tv"]
    ce = reference_terms(z[answer], t[answer], ids[:, 1:][answer], 0.7)["ce"]
    ref = 0.9 * tv / taught.sum() + 0.1 * ce / answer.sum()
    ref.backward()
    assert int(out.tokens) == int(taught.sum()) and (distill_tokens == "all") == (taught.sum() > answer.sum())
    assert int(out.correct) == int((z[taught].argmax(-1) == ids[:, 1:][taught]).sum())  # vs the data's token
    terms_mean = {name: float(num / den) for name, (num, den) in out.metrics.items()}
    assert set(terms_mean) == {"objective/ce", "objective/tv"}
    assert terms_mean["objective/tv"] == pytest.approx(float(tv.detach() / taught.sum()), rel=1e-5)
    assert terms_mean["objective/ce"] == pytest.approx(float(ce.detach() / answer.sum()), rel=1e-5)
    torch.testing.assert_close(out.loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for name, p in draft.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "metrics, perplexity",
    [
        ({}, math.exp(2.0)),  # plain CE: exp(loss)
        (
            {
                "objective/ce": (torch.tensor(3.0), torch.tensor(4)),
                "objective/tv": (torch.tensor(1.0), torch.tensor(4)),
            },
            math.exp(0.75),
        ),  # a mixture: exp(its CE term), not exp(0.9 tv + 0.1 ce)
        ({"objective/tv": (torch.tensor(1.0), torch.tensor(4))}, None),  # no CE at all: no perplexity
    ],
)
def test_perplexity_is_exp_of_a_cross_entropy_or_absent(monkeypatch, metrics, perplexity):
    from types import SimpleNamespace

    from specdraft.train.metrics import LossWindow

    monkeypatch.setattr("specdraft.train.metrics.all_reduce", lambda t: t.clone())  # a world of one
    window = LossWindow()
    window.add(
        SimpleNamespace(loss=torch.tensor(2.0), tokens=torch.tensor(4), correct=torch.tensor(1), metrics=metrics)
    )
    window.end_step()
    _, values = window.reduce()
    assert values.get("perplexity") == (None if perplexity is None else pytest.approx(perplexity, rel=1e-12))


# -- draft.distill_tokens: all never teaches a window's padding ---------------------------------

PADDED_FAMILIES = {  # the families with teacher terms, small, each with a teacher objective
    "glide": dict(loss="soft_ce"),
    "eagle3": dict(ttt_steps=2, draft_vocab_size=64),
    "peagle": dict(num_depths=3, draft_vocab_size=64, mask_token_id=3),
    "dflash": dict(loss="kl", num_layers=1, block_size=4, max_anchors=16),
    "dspark": dict(loss="kl", num_layers=1, block_size=4, max_anchors=16, markov_rank=8),
}


@pytest.mark.parametrize("family", sorted(PADDED_FAMILIES))
def test_distill_tokens_all_never_teaches_a_windows_padding(family):
    """A whole-packed window ends in padding (a document of its own, no labels). 'all' teaches the
    conversations' every token, never the padding: the loss is the same whatever the padding holds.
    It used to teach it, and a run from the feature cache (which stores no padding) parted from the
    online run (SmolLM2 GLIDE, 200 steps: 3.6406 against 3.6403). Control: without the window's
    token mask the padding is taught and the loss moves with it."""
    from omegaconf import OmegaConf

    from helpers import random_llama
    from specdraft.drafts.base import HostBatch
    from specdraft.drafts.eagle3.vocab import vocab_maps
    from specdraft.drafts.registry import build_draft
    from specdraft.train.model import target_features

    T, V = 32, 128
    target = random_llama(vocab=V, init=0.1)
    cfg = OmegaConf.structured(DraftConfig(type=family, distill_tokens="all", **PADDED_FAMILIES[family]))
    draft = build_draft(cfg, target.config)
    if hasattr(draft, "set_vocab_maps"):
        draft.set_vocab_maps(*vocab_maps(torch.arange(V, 0, -1).numpy(), 64))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, V, (2, T), generator=generator)
    # row 0: one conversation of 20 tokens, then padding; row 1: 12 + 14 tokens, then padding
    documents = torch.tensor([[0] * 20 + [1] * 12, [0] * 12 + [1] * 14 + [2] * 6])
    token_mask = torch.tensor([[1] * 20 + [0] * 12, [1] * 26 + [0] * 6])
    loss_mask = torch.zeros(2, T, dtype=torch.long)
    loss_mask[0, 10:20], loss_mask[1, 6:12], loss_mask[1, 19:26] = 1, 1, 1
    index = torch.arange(T)
    starts = torch.where(
        torch.cat([torch.ones(2, 1, dtype=torch.bool), documents[:, 1:] != documents[:, :-1]], 1), index, 0
    )
    positions = index - starts.cummax(1).values
    options = draft.sample_batch_options(torch.Generator().manual_seed(1), T)

    def loss(padding_ids, mask_of_tokens):
        x = torch.where(token_mask.bool(), ids, padding_ids)
        feats = target_features(target.model, draft.capture_request(), x, positions, documents)
        host = HostBatch(x, loss_mask, documents, mask_of_tokens)
        out = draft.training_loss(
            LossBatch(feats, target.lm_head.weight, x, loss_mask, 7, host=host, documents=documents, options=options)
        )
        return float(out.loss.detach()), int(out.tokens)

    zeros, others = torch.zeros_like(ids), torch.randint(4, V, (2, T), generator=generator)
    assert loss(zeros, token_mask) == loss(others, token_mask)
    assert loss(zeros, None) != loss(others, None)  # the control: padding taught
