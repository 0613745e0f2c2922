"""DSpark: DFlash + a Markov head (which token each slot's bias reads) + a confidence head (what it
is trained towards, where decoding stops), exact semantics on a tiny Llama target (vocab 128)."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import random_llama
from specdraft.drafts.base import LossBatch
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.drafts import DraftConfig, check_family_keys, draft_family
from specdraft.drafts.dflash.blocks import loss_weights, sample_training_blocks
from specdraft.drafts.dspark import train as dspark_train
from specdraft.drafts.dspark.model import DSparkDraft
from specdraft.drafts.dspark.train import acceptance_targets
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture

torch.set_num_threads(1)
VOCAB, T = 128, 24
HEAD_TYPES = ("vanilla", "gated", "rnn")


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=VOCAB, layers=4, max_positions=256, init=0.02)


def make_draft(target, **overrides):
    values = dict(type="dspark", num_layers=2, block_size=4, max_anchors=5, markov_rank=8)
    values.update(overrides)
    cfg = OmegaConf.structured(DraftConfig(**values))
    DSparkDraft.validate_config(cfg, target.config, "test", max_seq_length=T)
    draft = DSparkDraft.from_target_config(target.config, cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # realistic scales so every path carries signal
        for p in draft.parameters():
            if p is not draft.mask_delta:
                p.copy_(
                    torch.rand(p.shape, generator=generator) + 0.5
                    if p.dim() == 1
                    else torch.randn(p.shape, generator=generator) * 0.3
                )
    return draft


def features(target, draft, ids):
    B, L = ids.shape
    return capture(target.model, ids, torch.arange(L).expand(B, L), draft.capture_request())


def blocks_at(draft, ids, anchors):
    blocks = sample_training_blocks(ids, torch.ones_like(ids), draft.layout, anchors.shape[1], 0)
    blocks.anchors = anchors
    return blocks


def test_each_slots_previous_token_is_the_token_before_the_one_it_predicts():
    ids = torch.arange(100, 124)[None]
    for sample_from_anchor, expected in ((False, [10, 10, 11, 12]), (True, [10, 11, 12, 13])):
        layout_first = 0 if sample_from_anchor else 1
        blocks = sample_training_blocks(ids, torch.ones_like(ids), _layout(sample_from_anchor), 1, 0)
        blocks.anchors = torch.tensor([[10]])
        assert (blocks.previous_tokens(ids, layout_first)[0, 0] - 100).tolist() == expected


def _layout(sample_from_anchor):
    from specdraft.drafts.dflash.blocks import BlockLayout

    return BlockLayout(4, sample_from_anchor)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_the_markov_bias_of_a_slot_reads_its_previous_token_only(target, head_type):
    """vanilla/gated: changing slot k's previous token changes slot k's logits only; rnn: slots >= k.
    The bias is markov_w2(m) added to the target's lm_head logits (vanilla: m = markov_w1[prev])."""
    draft = make_draft(target, markov_head_type=head_type).eval()
    hidden = torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(2))
    previous = torch.tensor([[[5, 5, 9, 17]]])
    weight = draft.head_weight(target.lm_head.weight)
    with torch.no_grad():
        base = draft.block_head(hidden, previous, weight)
        changed = previous.clone()
        changed[..., 2] = 40
        other = draft.block_head(hidden, changed, weight)
        differs = [(base.logits()[..., s, :] - other.logits()[..., s, :]).abs().max() > 1e-4 for s in range(4)]
        assert differs == [False, False, True, head_type == "rnn"]
        confidence_differs = [bool((base.confidence[..., s] - other.confidence[..., s]).abs() > 1e-6) for s in range(4)]
        assert confidence_differs == [False, False, True, False]  # reads markov_w1[prev] of its own slot
        if head_type == "vanilla":
            expected = hidden @ target.lm_head.weight.t() + draft.markov_head.markov_w2(
                draft.markov_head.markov_w1(previous)
            )
            torch.testing.assert_close(base.logits(), expected, rtol=1e-5, atol=1e-5)


def test_the_confidence_target_is_one_minus_tv_or_greedy_agreement():
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(6, 16, generator=g), torch.randn(6, 12, generator=g)
    weight, teacher_weight = torch.randn(40, 16, generator=g), torch.randn(40, 12, generator=g)
    z, t = student @ weight.t(), teacher @ teacher_weight.t()
    z[0] = t[0] * 0.1  # the same argmax, different distributions
    student[0] = torch.linalg.lstsq(weight, z[0][:, None]).solution[:, 0]
    z = student @ weight.t()
    for T_ in (1.0, 0.7):
        p, q = torch.softmax(t / T_, -1), torch.softmax(z / T_, -1)
        torch.testing.assert_close(
            acceptance_targets(student, weight, teacher, teacher_weight, T_, 4),
            1 - 0.5 * (p - q).abs().sum(-1),
            rtol=1e-5,
            atol=1e-5,
        )
    greedy = acceptance_targets(student, weight, teacher, teacher_weight, 0.0, 4)
    assert greedy.tolist() == (z.argmax(-1) == t.argmax(-1)).float().tolist() and greedy[0] == 1.0


@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.7])
def test_the_loss_adds_the_confidence_bce_against_each_slots_acceptance(
    target, sample_from_anchor, temperature, monkeypatch
):
    """loss = (sum_j w_j [objective_j + alpha BCE(conf_j, a_j)]) / counted, a_j from the draft's
    (Markov-biased) logits at slot j and the target's distribution at anchor + j. At the objective's
    temperature (1) a_j is the objective's own per-row tv; at 0 and 0.7 it is computed apart."""
    draft = make_draft(
        target,
        sample_from_anchor=sample_from_anchor,
        confidence_temperature=temperature,
        loss="tv",
        confidence_loss_weight=0.5,
    )
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(4))
    feats = features(target, draft, ids)
    passes = []  # acceptance_targets: a second pass over the vocab, only where the objective's differs
    monkeypatch.setattr(dspark_train, "acceptance_targets", lambda *a: passes.append(1) or acceptance_targets(*a))
    out = draft.training_loss(
        LossBatch(feats, target.lm_head.weight, ids, torch.ones_like(ids), 0, options={"anchor_seed": 5})
    )
    assert (len(passes) > 0) == (temperature != 1.0)
    blocks = draft.training_blocks(ids, torch.ones_like(ids), 5)
    with torch.no_grad():
        hidden = draft.training_hidden(feats, blocks)
        head = draft.block_head(
            hidden, blocks.previous_tokens(ids, draft.layout.first_slot), draft.head_weight(target.lm_head.weight)
        )
        logits = head.logits()
    first, weights = draft.layout.first_slot, loss_weights(draft.layout, draft.dims.loss_decay_gamma)
    total, bce_total, count = 0.0, 0.0, 0
    for b in range(2):
        for a in range(blocks.anchors.shape[1]):
            for j in range(draft.layout.predictions):
                if not blocks.counted[b, a, j]:
                    continue
                anchor = int(blocks.anchors[b, a])
                z = logits[b, a, first + j]
                t = feats.final_hidden[b, anchor + j] @ target.lm_head.weight.t()
                p, q = torch.softmax(t, -1), torch.softmax(z, -1)
                tv = 0.5 * float((p - q).abs().sum())
                p, q = torch.softmax(t / (temperature or 1), -1), torch.softmax(z / (temperature or 1), -1)
                at_temperature = 1 - 0.5 * float((p - q).abs().sum())
                accepted = float(z.argmax() == t.argmax()) if temperature == 0 else at_temperature
                bce = float(
                    F.binary_cross_entropy_with_logits(head.confidence[b, a, first + j], torch.tensor(accepted))
                )
                total += weights[j] * (tv + 0.5 * bce)
                bce_total += bce
                count += 1
    assert count == int(out.tokens) > 0
    assert float(out.loss.detach()) == pytest.approx(total / count, rel=1e-4)
    bce_sum, n = out.metrics["confidence/bce"]
    assert float(bce_sum) / int(n) == pytest.approx(bce_total / count, rel=1e-4)
    assert {"confidence/brier", "confidence/accuracy", "objective/tv"} <= set(out.metrics)
    out.loss.backward()  # the heads learn: markov_w2 and the confidence head receive gradients
    assert draft.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert draft.confidence_head.proj.weight.grad.abs().sum() > 0


def drafter_at(draft, target, feats, n, threshold=None):
    drafter = draft.make_drafter(target)
    if threshold is not None:
        drafter.confidence_threshold = threshold
    drafter.observe_target({k: h[0, :n] for k, h in feats.hidden.items()}, 0)
    return drafter


class _Cache:  # the drafter reads only the target cache's length
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_the_drafter_computes_trainings_logits_and_confidences_slot_by_slot(target, head_type, sample_from_anchor):
    """Teacher-forced with the tokens the drafter drew, training's block at anchor n gives the
    drafter's chain: each proposal is the argmax of training's slot given the earlier proposals."""
    draft = make_draft(target, markov_head_type=head_type, sample_from_anchor=sample_from_anchor).eval()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(6))
    n = 9
    feats = features(target, draft, ids)
    chain = drafter_at(draft, target, feats, n).propose_chain(ids[0, : n + 1], _Cache(n), 10, 0.0, None)
    assert len(chain) == draft.layout.predictions
    forced = ids.clone()
    forced[0, n + 1 : n + 1 + len(chain)] = chain.tokens
    blocks = blocks_at(draft, forced, torch.tensor([[n]]))
    with torch.no_grad():
        head = draft.block_head(
            draft.training_hidden(feats, blocks),
            blocks.previous_tokens(forced, draft.layout.first_slot),
            draft.head_weight(target.lm_head.weight),
        )
    assert chain.tokens.tolist() == head.logits()[0, 0, draft.layout.first_slot :].argmax(-1).tolist()


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_each_tree_node_is_scored_by_the_slots_of_its_own_path(target, head_type, sample_from_anchor):
    """A node at depth d fills slot first + d reading its parent's token (the root's children read
    the anchor); its score is the sum of its path's log-probs, each slot teacher-forced with the
    path (for rnn the state runs along the path)."""
    draft = make_draft(target, markov_head_type=head_type, sample_from_anchor=sample_from_anchor).eval()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(10))
    n = 9
    feats = features(target, draft, ids)
    tree = drafter_at(draft, target, feats, n).propose_tree(ids[0, : n + 1], _Cache(n), [3, 2, 2])
    assert len(tree) == 7
    for node in range(len(tree)):
        path, i = [], node
        while i >= 0:
            path.append(int(tree.tokens[i]))
            i = int(tree.parents[i])
        path.reverse()
        forced = ids.clone()
        forced[0, n + 1 : n + 1 + len(path)] = torch.tensor(path)
        blocks = blocks_at(draft, forced, torch.tensor([[n]]))
        with torch.no_grad():
            head = draft.block_head(
                draft.training_hidden(feats, blocks),
                blocks.previous_tokens(forced, draft.layout.first_slot),
                draft.head_weight(target.lm_head.weight),
            )
        logprobs = torch.log_softmax(head.logits()[0, 0, draft.layout.first_slot :], dim=-1)
        assert float(tree.scores[node].detach()) == pytest.approx(
            sum(float(logprobs[d, t]) for d, t in enumerate(path)), abs=1e-4
        )


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_the_confidence_stop_drops_the_first_slot_below_the_threshold_and_all_after(target, sample_from_anchor):
    draft = make_draft(target, block_size=6, sample_from_anchor=sample_from_anchor).eval()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(7))
    n = 9
    feats = features(target, draft, ids)
    full = drafter_at(draft, target, feats, n).propose_chain(ids[0, : n + 1], _Cache(n), 10, 0.0, None)
    forced = ids.clone()
    forced[0, n + 1 : n + 1 + len(full)] = full.tokens
    blocks = blocks_at(draft, forced, torch.tensor([[n]]))
    with torch.no_grad():
        head = draft.block_head(
            draft.training_hidden(feats, blocks),
            blocks.previous_tokens(forced, draft.layout.first_slot),
            draft.head_weight(target.lm_head.weight),
        )
    confidence = torch.sigmoid(head.confidence[0, 0, draft.layout.first_slot :]).tolist()  # of each predicting slot
    for stop in range(len(confidence) + 1):
        # a threshold just above slot `stop`'s confidence, below every earlier slot's: stop there
        earlier = min(confidence[:stop], default=1.0)
        if stop < len(confidence) and confidence[stop] < earlier:
            threshold = (confidence[stop] + earlier) / 2
            chain = drafter_at(draft, target, feats, n, threshold).propose_chain(
                ids[0, : n + 1], _Cache(n), 10, 0.0, None
            )
            assert chain.tokens.tolist() == full.tokens[:stop].tolist()
    nothing = drafter_at(draft, target, feats, n, 1.0).propose_chain(ids[0, : n + 1], _Cache(n), 10, 0.0, None)
    assert len(nothing) == 0 or min(confidence) >= 1.0
    tree = drafter_at(draft, target, feats, n, 1.0).propose_tree(ids[0, : n + 1], _Cache(n), [2, 2, 2])
    assert len(tree) == 0


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_greedy_decoding_with_the_confidence_stop_is_the_targets_own_output(target, threshold):
    draft = make_draft(target, block_size=5, markov_head_type="rnn").eval()
    drafter = draft.make_drafter(target)
    drafter.confidence_threshold = threshold
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(8)).tolist()
    plain = generate_plain(target, prompt, max_new_tokens=20)
    for tree in (None, [3, 2, 2]):
        spec = speculative_generate(target, drafter, prompt, max_new_tokens=20, gamma=4, tree=tree)
        assert spec.tokens == plain.tokens


@pytest.mark.parametrize("shape", [dict(gamma=3), dict(tree=[2, 2])], ids=["chain", "tree"])
def test_sampling_with_the_confidence_stop_matches_the_target_distribution(shape):
    """Vocab 8, T = 1, a threshold that stops some blocks early: the first three tokens' joint is
    the target's (chi-square), as test_decode checks every family without the stop."""
    from test_decode import chi2_critical, chi2_statistic, three_token_joint, tiny_llama

    V = 8
    target = tiny_llama(vocab=V, hidden=32, layers=1, init=0.5, seed=3)
    draft = make_draft(target, num_layers=1, markov_rank=4).eval()
    ids = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(9))
    blocks = draft.training_blocks(ids, torch.ones_like(ids), 0)
    with torch.no_grad():  # confidences on both sides of the threshold: centre the logits on 0
        head = draft.block_head(
            draft.training_hidden(features(target, draft, ids), blocks),
            blocks.previous_tokens(ids, 1),
            draft.head_weight(target.lm_head.weight),
        )
        draft.confidence_head.proj.bias.sub_(head.confidence.median())
    drafter = draft.make_drafter(target)
    drafter.confidence_threshold = 0.5
    prompt = [1, 5, 2, 1, 5]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(V**3)
    drafted = []
    for _ in range(1000):
        out = speculative_generate(
            target, drafter, prompt, max_new_tokens=3, temperature=1.0, generator=generator, **shape
        )
        x1, x2, x3 = out.tokens
        counts[(x1 * V + x2) * V + x3] += 1
        drafted += out.drafted
    assert 0 < sum(drafted) and min(drafted) < max(drafted)  # the stop cut some blocks short
    stat, dof = chi2_statistic(counts, three_token_joint(target, prompt, V))
    assert stat < chi2_critical(dof), (stat, dof)


def test_bad_dspark_input_is_a_one_line_error(target):
    for key, value, match in (
        ("markov_rank", 0, "markov_rank.*> 0"),
        ("markov_rank", -3, "markov_rank"),
        ("confidence_threshold", 1.5, r"confidence_threshold.*\[0, 1\]"),
        ("confidence_threshold", -0.1, "confidence_threshold"),
        ("markov_head_type", "joint", "markov_head_type"),
    ):
        cfg = OmegaConf.structured(DraftConfig(type="dspark", **{key: value}))
        with pytest.raises(SpecdraftError, match=match) as err:
            DSparkDraft.validate_config(cfg, target.config, "cfg.yaml", max_seq_length=T)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecdraftError, match="markov_rank.*not a key of draft.type 'dflash'.*dspark"):
        check_family_keys(draft_family("dflash"), ["block_size", "markov_rank"], "cfg.yaml")
