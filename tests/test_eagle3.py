"""EAGLE-3: the vectorised TTT unroll against a slow per-position reference, what each TTT step's
query may see, which token each position predicts, the draft vocabulary, train <-> inference
logits, lossless decoding, and the bad-input errors."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import random_llama
from specdraft.config import DraftConfig
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.drafts.registry import build_draft
from specdraft.drafts.eagle3 import model as eagle3_module, train as eagle3_train
from specdraft.drafts.eagle3.layer import default_target_layers
from specdraft.drafts.eagle3.model import ttt_visibility
from specdraft.drafts.eagle3.vocab import count_target_tokens, draft_to_target_ids, vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture
from specdraft.train.model import TargetWithDraft

torch.set_num_threads(1)

VOCAB = 96
DRAFT_VOCAB = 80
T = 16


def llama(layers=4, vocab=VOCAB, hidden=64, init=0.2, seed=0):
    return random_llama(vocab=vocab, hidden=hidden, layers=layers, init=init, seed=seed)


def eagle3_for(target, seed=0, draft_vocab=DRAFT_VOCAB, ttt_steps=3, **options):
    cfg = OmegaConf.structured(DraftConfig(type="eagle3", draft_vocab_size=draft_vocab, ttt_steps=ttt_steps, **options))
    draft = build_draft(cfg, target.config)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=generator).numpy()
    draft.set_vocab_maps(*vocab_maps(counts, draft.dims.draft_vocab_size))
    with torch.no_grad():  # weights of a realistic scale, non-trivial norms
        for p in draft.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            else:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
    return draft


@pytest.fixture(scope="module")
def target():
    return llama()


def features_of(target, draft, ids):
    return capture(target.model, ids, torch.arange(ids.shape[1])[None].expand_as(ids), draft.capture_request())


# -- the slow reference -------------------------------------------------------------------------


def reference_unroll(draft, aux, embeds, steps):
    """Position by position, step by step: query (k, t) embeds x_{t+1+k} at position t+1+k and
    attends to step-0 keys at s <= t plus the key of each step 1..k at t (itself last)."""
    d = draft.dims
    layer = draft.layers[0]
    attn = layer.self_attn
    T = aux.shape[1]
    group = d.num_heads // d.num_kv_heads
    hidden_in = draft.fuse(aux)[0]  # (T, H)
    keys, values = {}, {}  # (step, t) -> (KV, D)
    heads = []
    for k in range(steps):
        outs = []
        for t in range(T):
            token = embeds[0, t + 1 + k] if t + 1 + k < T else torch.zeros_like(embeds[0, 0])
            cos, sin = draft.rotary_emb(embeds[:, :1], torch.tensor([[t + 1 + k]]))
            normed = layer.hidden_norm(hidden_in[t])
            residual = normed if d.norm_before_residual else hidden_in[t]
            x = torch.cat([layer.input_layernorm(token), normed])
            q = attn.q_proj(x).view(d.num_heads, d.head_dim)
            key = attn.k_proj(x).view(d.num_kv_heads, d.head_dim)
            rot = lambda v: v * cos[0] + torch.cat([-v[..., d.head_dim // 2 :], v[..., : d.head_dim // 2]], -1) * sin[0]
            q, key = rot(q), rot(key)
            keys[k, t], values[k, t] = key, attn.v_proj(x).view(d.num_kv_heads, d.head_dim)
            visible = [(0, s) for s in range(t + 1)] + [(j, t) for j in range(1, k + 1)]
            K = torch.stack([keys[v] for v in visible], dim=1)  # (KV, S, D)
            V = torch.stack([values[v] for v in visible], dim=1)
            K, V = K.repeat_interleave(group, 0), V.repeat_interleave(group, 0)
            weights = torch.softmax((q[:, None] * K).sum(-1) / d.head_dim**0.5, dim=-1)  # (heads, S)
            out = residual + attn.o_proj((weights[..., None] * V).sum(1).flatten())
            out = out + layer.mlp(layer.post_attention_layernorm(out))
            outs.append(out)
        out = torch.stack(outs)
        normed = draft.norm(out)
        heads.append(normed)
        hidden_in = normed if d.norm_output else out
    return heads


def reference_loss(draft, feats, lm_head_weight, ids, mask, steps, decay):
    heads = reference_unroll(draft, draft.aux_hidden(feats), feats.input_embeds, steps)
    used = draft_to_target_ids(draft.d2t)
    total = 0.0
    for k, head in enumerate(heads):
        terms = []
        for t in range(T - 2 - k):
            if mask[0, t + 2 + k]:
                full = feats.final_hidden[0, t + 1 + k] @ lm_head_weight.t()  # the full target logits
                p = torch.softmax(full[used], -1)  # restricted and renormalised
                terms.append(-(p * torch.log_softmax(draft.lm_head(head[t]), -1)).sum())
        total = total + decay**k * torch.stack(terms).mean()
    return total, heads


@pytest.mark.parametrize(
    "flags",
    [{}, {"norm_before_residual": True, "norm_output": True}, {"fc_norm": True}, {"norm_before_fc": True}],
    ids=["default", "residual+output", "fc_norm", "norm_before_fc"],
)
def test_vectorised_ttt_equals_the_per_position_reference(target, flags):
    draft = eagle3_for(target, **flags)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 5:8] = 0
    feats = features_of(target, draft, ids)
    model = TargetWithDraft(target, draft, loss_chunk_size=5)
    fast = model(ids, mask)
    fast_grads = torch.autograd.grad(fast.loss, list(draft.parameters()))
    slow, slow_heads = reference_loss(draft, feats, target.lm_head.weight, ids, mask, 3, 0.8)
    slow_grads = torch.autograd.grad(slow, list(draft.parameters()))
    torch.testing.assert_close(fast.loss, slow, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(draft.named_parameters(), fast_grads, slow_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    fast_heads = draft.unroll(draft.aux_hidden(feats), feats.input_embeds, 3)
    for k in range(3):  # logits of every position at every step (beyond the labels too)
        torch.testing.assert_close(draft.logits(fast_heads[k][0]), draft.logits(slow_heads[k]), rtol=1e-5, atol=1e-5)


def test_ttt_visibility_mask():
    mask = ttt_visibility(5, 2, "cpu")
    assert mask.shape == (5, 15)
    for t in range(5):
        assert mask[t, :5].nonzero().flatten().tolist() == list(range(t + 1))  # step 0: causal
        assert mask[t, 5:].nonzero().flatten().tolist() == [t, 5 + t]  # steps 1, 2: the diagonal only


@pytest.mark.parametrize("k", [0, 1, 2])
def test_what_a_ttt_step_query_may_see(target, k):
    """Step k at index t reads target states at indices <= t and tokens up to x_{t+1+k}: nothing later."""
    draft = eagle3_for(target)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    feats = features_of(target, draft, ids)
    aux, embeds = draft.aux_hidden(feats), feats.input_embeds
    base = draft.unroll(aux, embeds, 3)[k][0]
    t = 6
    later_aux = aux.clone()
    later_aux[0, t + 1 :] += torch.randn_like(later_aux[0, t + 1 :])
    out = draft.unroll(later_aux, embeds, 3)[k][0]
    torch.testing.assert_close(out[: t + 1], base[: t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(out[t + 1], base[t + 1])
    later_tokens = embeds.clone()
    later_tokens[0, t + 2 + k :] += 1.0
    out = draft.unroll(aux, later_tokens, 3)[k][0]
    torch.testing.assert_close(out[: t + 1], base[: t + 1], rtol=0, atol=1e-6)
    own_token = embeds.clone()
    own_token[0, t + 1 + k] += 1.0  # the token step k embeds at index t
    out = draft.unroll(aux, own_token, 3)[k][0]
    assert not torch.allclose(out[t], base[t])
    torch.testing.assert_close(out[:t], base[:t], rtol=0, atol=1e-6)  # x_{t+1+k} is later for t' < t


def test_which_token_each_position_predicts_at_each_step(target, monkeypatch):
    """One loss-masked token at p: step k counts exactly index p-2-k, with label x_p and the
    target's distribution at position p-1 as the teacher."""
    draft = eagle3_for(target)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    p = 11
    mask = torch.zeros_like(ids)
    mask[0, p] = 1
    seen = []
    real = eagle3_train.ttt_step_loss

    def spy(student, head, teacher, rows, labels, objective, chunk, *rest):
        seen.append((student.detach().clone(), teacher.clone()))
        return real(student, head, teacher, rows, labels, objective, chunk, *rest)

    monkeypatch.setattr(eagle3_train, "ttt_step_loss", spy)
    feats = features_of(target, draft, ids)
    out = TargetWithDraft(target, draft)(ids, mask)
    heads = draft.unroll(draft.aux_hidden(feats), feats.input_embeds, 3)
    for k, (student, teacher) in enumerate(seen):
        torch.testing.assert_close(student, heads[k][0, p - 2 - k][None])
        torch.testing.assert_close(teacher, feats.final_hidden[0, p - 1][None])
        assert out.metrics[f"ttt_{k}/accuracy"][1] == 1
    # accuracy counts the draft's top-1 (mapped through d2t) against x_p
    top = draft_to_target_ids(draft.d2t)[draft.logits(heads[0][0, p - 2]).argmax()]
    assert int(out.correct) == int(top == ids[0, p])


def test_packed_conversations_keep_each_steps_label_in_the_rows_conversation(target):
    """Every token a label (distill_tokens: all), two conversations in the row: index t of step k
    counts only when x_{t+2+k} is in t's conversation."""
    draft = eagle3_for(target, loss="tv", distill_tokens="all")
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(4))
    documents = torch.zeros_like(ids)
    documents[0, 9:] = 1
    mask = torch.zeros_like(ids)  # no answer token at all: the teacher terms learn every token
    out = TargetWithDraft(target, draft)(ids, mask, document_ids=documents)
    for k in range(3):
        expected = sum(1 for t in range(T - 2 - k) if documents[0, t] == documents[0, t + 2 + k])
        assert int(out.metrics[f"ttt_{k}/loss"][1]) == expected == T - 2 - k - (2 + k)


def test_a_conversation_packed_after_another_computes_what_it_computes_alone(target):
    """Packed data under document_mask: every TTT step of the second conversation sees nothing of
    the first (and the first nothing of the second), so their heads equal each one's alone; rows
    whose input x_{t+1+k} already lies in the next conversation are not compared (not counted)."""
    draft = eagle3_for(target)
    first = 9
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(12))
    parts = [features_of(target, draft, ids[:, :first]), features_of(target, draft, ids[:, first:])]
    aux = torch.cat([draft.aux_hidden(p) for p in parts], 1)
    embeds = torch.cat([p.input_embeds for p in parts], 1)
    documents = torch.zeros_like(ids)
    documents[:, first:] = 1
    packed = draft.unroll(aux, embeds, 3, documents)
    alone = [draft.unroll(draft.aux_hidden(p), p.input_embeds, 3) for p in parts]
    for k in range(3):
        torch.testing.assert_close(packed[k][0, first:], alone[1][k][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[k][0, : first - 1 - k], alone[0][k][0, : first - 1 - k], rtol=1e-5, atol=1e-5)
    mixed = draft.unroll(aux, embeds, 3)  # without documents the second reads the first
    assert not torch.allclose(mixed[0][0, first:], alone[1][0][0], atol=1e-3)


def test_loss_weights_steps_by_decay(target):
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    losses = {}
    for decay in (0.8, 0.5):
        draft = eagle3_for(target, ttt_decay=decay)
        out = TargetWithDraft(target, draft)(ids, mask)
        per_step = [float(out.metrics[f"ttt_{k}/loss"][0] / out.metrics[f"ttt_{k}/loss"][1]) for k in range(3)]
        losses[decay] = (float(out.loss.detach()), per_step)
        assert float(out.loss.detach()) == pytest.approx(sum(decay**k * l for k, l in enumerate(per_step)), rel=1e-5)
    assert losses[0.8][1] == pytest.approx(losses[0.5][1], rel=1e-6)  # same draft, same steps


def test_target_layers_are_the_captured_layer_inputs(target):
    draft = eagle3_for(target, target_layers=[0, 2, 4])
    assert draft.capture_request().layers == (0, 2, 4) and draft.capture_request().final_hidden
    ids = torch.randint(0, VOCAB, (1, T))
    feats = features_of(target, draft, ids)
    hidden = target.model(ids, output_hidden_states=True).hidden_states
    aux = draft.aux_hidden(feats)
    torch.testing.assert_close(aux[..., :64], hidden[0])  # input of layer 0: the embeddings
    torch.testing.assert_close(aux[..., 64:128], hidden[2])
    torch.testing.assert_close(target.model.norm(aux[..., 128:]), hidden[4])  # id L: before the final norm


def test_default_layers_follow_vllm_and_shallow_targets_get_three_distinct():
    assert default_target_layers(32)[0] == [2, 16, 29]
    assert default_target_layers(28)[0] == [2, 14, 25]
    assert default_target_layers(3)[0] == [0, 1, 2]  # vLLM's own [2, 1, 0], in the servers' (increasing) order
    for layers in (2, 4, 5):
        ids, why = default_target_layers(layers)
        assert len(set(ids)) == 3 and all(0 <= i <= layers for i in ids) and "not three distinct" in why
    for layers in range(3, 40):  # increasing, distinct, and every one captured by vLLM (< L)
        ids = default_target_layers(layers)[0]
        assert ids == sorted(set(ids)) and len(ids) == 3 and max(ids) < layers
        assert layers < 4 or min(ids) >= 1  # and by SGLang (it has no id for the embeddings) when it can
    assert default_target_layers(4)[0] == [1, 2, 3]
    assert default_target_layers(2)[0] == [0, 1, 2]  # 2 layers: the last output too, native only


# -- the draft vocabulary -------------------------------------------------------------------------


class FakePacked:
    def __init__(self, tokens, mask):
        self.tokens, self.loss_mask = tokens, mask

    def __len__(self):
        return self.tokens.shape[0]


def test_draft_vocab_is_the_top_n_masked_tokens_streamed(monkeypatch):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(37, 11)).astype(np.uint32)
    mask = (rng.random((37, 11)) < 0.5).astype(np.uint8)
    monkeypatch.setattr("specdraft.drafts.eagle3.vocab.ROWS_PER_BLOCK", 4)  # many blocks
    counts = count_target_tokens(FakePacked(tokens, mask), 60)
    assert (counts == np.bincount(tokens[mask.astype(bool)].astype(np.int64), minlength=60)).all()
    d2t, t2d = vocab_maps(counts, 20)
    used = draft_to_target_ids(d2t)
    assert used.tolist() == sorted(used.tolist()) and t2d.sum() == 20 and t2d[used].all()
    threshold = counts[used.numpy()].min()
    assert all(counts[i] <= threshold for i in range(60) if not t2d[i])  # nothing more frequent left out
    # fewer distinct tokens than N: padded with the lowest unused ids
    d2t, t2d = vocab_maps(np.array([0, 0, 5, 0, 7, 0]), 4)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 4]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 0, 0, 1]


def test_draft_logits_map_to_target_ids_through_d2t(target):
    """The drafter's distribution over the target vocab puts draft id i's logit on i + d2t[i]."""
    draft = eagle3_for(target)
    drafter = draft.make_drafter(target)
    logits = torch.randn(DRAFT_VOCAB)
    full = drafter._target_logits(logits)
    used = draft_to_target_ids(draft.d2t)
    assert torch.equal(full[used], logits) and torch.isinf(full[~draft.t2d]).all()


# -- train <-> inference ------------------------------------------------------------------------


def test_drafter_logits_equal_the_training_unroll(target):
    """A chain drafted after a prompt scores the drafted tokens exactly as TTT steps 0..k-1 score
    the same sequence at index n-1 (target states of the prompt only)."""
    draft = eagle3_for(target, ttt_steps=4)
    drafter = draft.make_drafter(target)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    captured = []
    real = drafter._target_logits
    drafter._target_logits = lambda logits: captured.append(logits.clone()) or real(logits)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=12, gamma=4)
    first = captured[:4]  # round one: drafted tokens 1..4
    n = len(prompt)
    first_token = generate_plain(target, prompt, max_new_tokens=1).tokens[0]
    drafted = [int(draft_to_target_ids(draft.d2t)[l.argmax()]) for l in first]
    ids = torch.tensor([prompt + [first_token] + drafted[:-1]])
    feats = features_of(target, draft, ids)
    heads = draft.unroll(draft.aux_hidden(feats), feats.input_embeds, 4)
    for k in range(4):
        torch.testing.assert_close(
            first[k][0] if first[k].dim() > 1 else first[k], draft.logits(heads[k][0, n - 1]), rtol=1e-5, atol=1e-5
        )
    assert out.tokens == generate_plain(target, prompt, max_new_tokens=12).tokens


@pytest.mark.parametrize("shape", [dict(gamma=4), dict(tree=[3, 4, 4, 2])], ids=["chain", "tree"])
def test_eagle3_greedy_is_token_identical_to_target_greedy(target, shape):
    drafter = eagle3_for(target, seed=7).make_drafter(target)
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = speculative_generate(target, drafter, prompt, max_new_tokens=16, **shape)
        assert out.tokens == generate_plain(target, prompt, max_new_tokens=16).tokens


def test_eagle3_sampling_follows_the_target_distribution():
    """Rejection sampling with a draft vocab smaller than the target's: the tokens outside it still
    come out with the target's probabilities (through the residual)."""
    from test_decode import chi2_critical, chi2_statistic, three_token_joint

    V = 8
    target = llama(layers=2, vocab=V, hidden=32, init=0.5, seed=3)
    draft = eagle3_for(target, seed=4, draft_vocab=5, ttt_steps=2)
    prompt = [1, 5, 2]
    joint = three_token_joint(target, prompt, V)
    generator = torch.Generator().manual_seed(0)
    for shape in (dict(gamma=2), dict(tree=[2, 2])):
        counts = torch.zeros(V**3)
        drafter = draft.make_drafter(target)
        for _ in range(1000):
            x1, x2, x3 = speculative_generate(
                target, drafter, prompt, max_new_tokens=3, temperature=1.0, generator=generator, **shape
            ).tokens
            counts[(x1 * V + x2) * V + x3] += 1
        stat, dof = chi2_statistic(counts, joint)
        assert dof >= 10 and stat < chi2_critical(dof), (shape, stat, dof)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(target_layers=[1, 2, 9]), "key 'draft.target_layers': layer 9 is outside the target"),
        (dict(target_layers=[1, 1, 2]), "key 'draft.target_layers': needs 3 distinct layer ids"),
        (dict(draft_vocab_size=500), "key 'draft.draft_vocab_size': 500 is larger than the target vocab (96)"),
        (dict(fc_norm=True, norm_before_fc=True), "key 'draft.fc_norm'"),
    ],
)
def test_bad_eagle3_config_is_one_line(target, options, expected):
    cfg = OmegaConf.structured(DraftConfig(type="eagle3", **options))
    with pytest.raises(SpecdraftError) as err:
        eagle3_module.Eagle3Draft.validate_config(cfg, target.config, "run.yaml", 64)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_vocab_maps_that_disagree_are_refused(target):
    draft = eagle3_for(target, seed=0)
    other = eagle3_for(target, seed=1)
    with pytest.raises(SpecdraftError, match="slot_x: its d2t/t2d vocabulary maps disagree") as err:
        draft.load_extra_state(other.extra_state(), source="slot_x")
    assert "\n" not in str(err.value)
    fresh = build_draft(OmegaConf.structured(DraftConfig(type="eagle3", draft_vocab_size=DRAFT_VOCAB)), target.config)
    fresh.load_extra_state(draft.extra_state())  # a draft built without data takes the saved maps
    assert torch.equal(fresh.d2t, draft.d2t) and torch.equal(fresh.t2d, draft.t2d)


# -- draft.loss: EAGLE-3's own soft CE is one objective among the others ---------------------------


@pytest.mark.parametrize("teacher_rows", ["in_vocab", "all"])
@pytest.mark.parametrize("distill_tokens", ["answers", "all"])
def test_objectives_read_the_restricted_teacher_and_draft_vocab_labels(target, distill_tokens, teacher_rows):
    """`0.5*tv + 0.5*ce` at T=0.7: TV against the target restricted to the draft vocab, and CE on
    x_{t+2+k} as a draft-vocab label, skipped (no term, no gradient) where x_{t+2+k} is outside the
    draft vocab. 'answers': both over step k's answer rows. 'all': TV over every row of step k
    (x_{t+2+k} a prompt token too), CE still the mean over the answer rows. teacher_rows in_vocab
    (SpecForge's position_mask = t2d[target argmax] * loss_mask): TV only on the rows whose target
    top-1 over the whole vocab is a draft token, still divided by all counted rows."""
    draft = eagle3_for(
        target,
        loss="0.5*tv + 0.5*ce",
        distill_temperature=0.7,
        distill_tokens=distill_tokens,
        teacher_rows=teacher_rows,
    )
    assert draft.capture_request().final_hidden
    assert not eagle3_for(target, loss="ce").capture_request().final_hidden  # no teacher read, none captured
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[:, 3:6] = 0
    used = draft_to_target_ids(draft.d2t)
    assert not bool(torch.isin(ids, used).all())  # some labels fall outside the draft vocab
    feats = features_of(target, draft, ids)
    out = TargetWithDraft(target, draft, loss_chunk_size=5)(ids, mask)
    grads = torch.autograd.grad(out.loss, list(draft.parameters()), allow_unused=True)

    heads = draft.unroll(draft.aux_hidden(feats), feats.input_embeds, 3)
    to_draft = {int(t): i for i, t in enumerate(used)}
    full = feats.final_hidden @ target.lm_head.weight.t()  # (B, T, V) the target's own logits
    ref, kept_per_step = 0.0, []
    for k, head in enumerate(heads):
        answer = torch.zeros_like(mask, dtype=torch.bool)
        answer[:, : T - 2 - k] = mask[:, 2 + k :].bool()
        counted = answer.clone()
        if distill_tokens == "all":
            counted[:, : T - 2 - k] = True
        z = draft.logits(head)[counted] / 0.7
        teacher = full[:, 1 + k :][counted[:, : T - 1 - k]]  # (rows, V) the target at t+1+k
        p = torch.softmax(teacher[:, used] / 0.7, dim=-1)
        keep = (
            torch.isin(teacher.argmax(-1), used) if teacher_rows == "in_vocab" else torch.ones(len(p), dtype=torch.bool)
        )
        if teacher_rows == "in_vocab":
            kept_per_step.append(int(keep.sum()))
        tv = 0.5 * (p - torch.softmax(z, -1)).abs().sum(-1)[keep].sum()
        labels = ids[:, 2 + k :][answer[:, : T - 2 - k]]
        inside = [(r, to_draft[int(y)]) for r, y in enumerate(labels) if int(y) in to_draft]
        ce = sum(F.cross_entropy(draft.logits(head)[answer][r], torch.tensor(y)) for r, y in inside)
        ref = ref + 0.8**k * (0.5 * tv / counted.sum() + 0.5 * ce / answer.sum())
        assert int(out.metrics[f"ttt_{k}/loss"][1]) == int(counted.sum())
        assert (distill_tokens == "all") == bool(counted.sum() > answer.sum())
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()), allow_unused=True)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert {"objective/tv", "objective/ce"} <= set(out.metrics)
    if teacher_rows == "in_vocab":  # the selection drops some rows and keeps others
        counted_rows = [int(out.metrics[f"ttt_{k}/loss"][1]) for k in range(3)]
        assert 0 < sum(kept_per_step) < sum(counted_rows), (kept_per_step, counted_rows)
