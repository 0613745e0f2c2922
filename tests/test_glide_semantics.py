"""What GLIDE learns, pinned: a per-position reference, exact visibility boundaries, label
alignment, and training logits == drafting logits at every lag.

Everything touches the code under test through the small adapters in the first section (build the
target, the draft, the features; run the forward, the training loss, the drafter), so moving GLIDE
onto another interface means editing those adapters only.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

import specdraft.drafts.objectives as objectives_module  # GLIDE's CE goes through shared_head_objective
from helpers import random_llama
from specdraft.drafts.base import LossBatch
from specdraft.config import DraftConfig
from specdraft.decode.cache import cache_length, forward, new_cache
from specdraft.drafts.glide.decode import GlideDrafter
from specdraft.drafts.registry import build_draft
from specdraft.target.capture import CaptureRequest, capture
from specdraft.train.model import TargetWithDraft

torch.set_num_threads(1)

VOCAB = 128
HIDDEN = 64
HEADS = 4


# -- adapters: the only place that knows how GLIDE is called ---------------------------------


def build_target(kv_heads=2, vocab=VOCAB, seed=0, init=0.2):
    return random_llama(
        vocab=vocab, hidden=HIDDEN, heads=HEADS, kv_heads=kv_heads, init=init, seed=seed, max_positions=4096
    )


def build_glide(target, window, max_lag, final_norm=False, seed=0):
    """A GLIDE draft with random weights of a realistic scale and non-trivial norms."""
    cfg = OmegaConf.structured(DraftConfig(sliding_window=window, max_lag=max_lag, final_norm=final_norm))
    draft = build_draft(cfg, target.config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return draft


def features(target, ids, positions=None):
    """What the target hands the draft for (B, T) ids at (T,) positions."""
    B, T = ids.shape
    positions = torch.arange(T) if positions is None else positions
    return capture(target.model, ids, positions.expand(B, T), CaptureRequest(last_layer_kv=True))


def draft_hidden(draft, feats, lag):
    """The draft's training forward at one lag: hidden states (B, T, H) at every position."""
    return draft.forward_sequence(feats.input_embeds, feats.cos, feats.sin, feats.last_keys, feats.last_values, lag)


def draft_hidden_kv(draft, feats, lag, keys, values, embeds=None):
    """draft_hidden with the target K/V (and optionally the input embeddings) replaced."""
    embeds = feats.input_embeds if embeds is None else embeds
    return draft.forward_sequence(embeds, feats.cos, feats.sin, keys, values, lag)


def training_loss(draft, target, ids, loss_mask, lag, positions=None, chunk_size=5):
    """The real training path: TargetWithDraft (target pass + draft loss)."""
    model = TargetWithDraft(target, draft, loss_chunk_size=chunk_size)
    options = {"lag": lag}
    if positions is not None:
        options["position_ids"] = positions
    return model(ids, loss_mask, **options)


class _Recorder:
    def __init__(self, original):
        self.original, self.calls = original, []

    def __call__(self, hidden, weight, labels, chunk_size=1024):
        self.calls.append((hidden.detach().clone(), labels.clone()))
        return self.original(hidden, weight, labels, chunk_size)


def training_predictions(monkeypatch, draft, target, ids, loss_mask, lag, positions=None):
    """What the training loss trains on: (hidden (N, H), labels (N,)) in the loss's row order."""
    recorder = _Recorder(objectives_module.chunked_cross_entropy)
    monkeypatch.setattr(objectives_module, "chunked_cross_entropy", recorder)
    training_loss(draft, target, ids, loss_mask, lag, positions)
    monkeypatch.setattr(objectives_module, "chunked_cross_entropy", recorder.original)
    assert len(recorder.calls) == 1
    return recorder.calls[0]


def loss_given_hidden(draft, feats, ids, loss_mask, lag, hidden):
    """The training loss with the draft's hidden states replaced by `hidden` (B, T, H)."""
    original = draft.forward_sequence
    draft.forward_sequence = lambda *args, **kwargs: hidden
    try:
        return draft.training_loss(
            LossBatch(feats, LM_HEAD_IDENTITY, ids, loss_mask, chunk_size=3, options={"lag": lag})
        )
    finally:
        draft.forward_sequence = original


def make_drafter(draft, target):
    return GlideDrafter(draft, target)


def record_drafter_logits(drafter):
    """Spy on the drafter's one draft call: a list of (index (T,), logits (R, T, V)) per call."""
    calls = []
    original = drafter._logits

    def spy(ids, index, cross_limit, target_cache, cache):
        out = original(ids, index, cross_limit, target_cache, cache)
        calls.append((index.clone(), out.clone()))
        return out

    drafter._logits = spy
    return calls


# -- the reference: one position at a time, attention by hand --------------------------------


def _rms(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean() + eps))


def _rope(v, cos, sin):
    # v, cos, sin (D,): pairs (i, i + D/2) rotate together (the Llama convention)
    half = v.shape[0] // 2
    rotated = torch.cat([-v[half:], v[:half]])
    return v * cos + rotated * sin


def _softmax_weighted(query, keys, values):
    """softmax(q.k / sqrt(D)) weighted sum over a list of (key, value) vectors."""
    scores = [torch.dot(query, k) / math.sqrt(query.shape[0]) for k in keys]
    top = max(float(s.detach()) for s in scores)
    weights = [torch.exp(s - top) for s in scores]
    total = sum(weights)
    return sum(w / total * v for w, v in zip(weights, values))


def reference_hidden(draft, embeds, cos, sin, target_keys, target_values, lag):
    """GLIDE by its definition, for one sequence: embeds (T, H), cos/sin (T, D), target K/V
    (KV, T, D) -> hidden (T, H). Query t sees draft positions s with 0 <= t - s < window and
    target positions s <= t - lag; no target position at all -> no cross-attention output."""
    d = draft.dims
    P = dict(draft.named_parameters())
    T, D = embeds.shape[0], d.head_dim
    group = d.num_heads // d.num_kv_heads
    target_group = d.num_heads // target_values.shape[0]

    def heads(weight, x, count, t, rotate=True):
        flat = weight @ x
        out = [flat[h * D : (h + 1) * D] for h in range(count)]
        return [_rope(v, cos[t], sin[t]) for v in out] if rotate else out

    normed = [_rms(embeds[s], P["input_layernorm.weight"], d.rms_norm_eps) for s in range(T)]
    keys = [heads(P["self_attn.k_proj.weight"], normed[s], d.num_kv_heads, s) for s in range(T)]
    values = [heads(P["self_attn.v_proj.weight"], normed[s], d.num_kv_heads, s, rotate=False) for s in range(T)]
    out = []
    for t in range(T):
        x = embeds[t]
        queries = heads(P["self_attn.q_proj.weight"], normed[t], d.num_heads, t)
        seen = [s for s in range(T) if 0 <= t - s < d.sliding_window]
        attended = [
            _softmax_weighted(queries[h], [keys[s][h // group] for s in seen], [values[s][h // group] for s in seen])
            for h in range(d.num_heads)
        ]
        x = x + P["self_attn.o_proj.weight"] @ torch.cat(attended)

        y = _rms(x, P["cross_layernorm.weight"], d.rms_norm_eps)
        queries = heads(P["cross_attn.q_proj.weight"], y, d.num_heads, t)
        seen = [s for s in range(T) if s <= t - lag]
        if seen:
            attended = [
                _softmax_weighted(
                    queries[h],
                    [target_keys[h // target_group, s] for s in seen],
                    [target_values[h // target_group, s] for s in seen],
                )
                for h in range(d.num_heads)
            ]
            x = x + P["cross_attn.o_proj.weight"] @ torch.cat(attended)

        y = _rms(x, P["post_attention_layernorm.weight"], d.rms_norm_eps)
        gate, up = P["mlp.gate_proj.weight"] @ y, P["mlp.up_proj.weight"] @ y
        x = x + P["mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up)
        if d.final_norm:
            x = _rms(x, P["norm.weight"], d.rms_norm_eps)
        out.append(x)
    return torch.stack(out)


def reference_target_inputs(target, ids, positions):
    """Embeddings, rotary tables and last-layer K/V straight from transformers' own forward."""
    B, T = ids.shape
    with torch.no_grad():
        out = target(input_ids=ids, position_ids=positions.expand(B, T), use_cache=True)
        embeds = target.get_input_embeddings()(ids)
        cos, sin = target.model.rotary_emb(embeds, positions.expand(B, T))
    last = out.past_key_values.layers[-1]
    return embeds, cos, sin, last.keys, last.values


def reference_loss(draft, target, ids, loss_mask, lag, positions):
    """(mean CE, per-row hidden (B, T, H), counted (t, label) list) by the definition."""
    embeds, cos, sin, keys, values = reference_target_inputs(target, ids, positions)
    head = target.lm_head.weight
    total, counted, hidden = 0.0, [], []
    for b in range(ids.shape[0]):
        h = reference_hidden(draft, embeds[b], cos[b], sin[b], keys[b], values[b], lag)
        hidden.append(h)
        for t in range(lag, ids.shape[1] - 1):  # hidden[t] predicts ids[t + 1]
            if loss_mask[b, t + 1]:
                logits = head @ h[t]
                label = int(ids[b, t + 1])
                total = total + torch.logsumexp(logits, 0) - logits[label]
                counted.append((b, t, label))
    return total / len(counted), torch.stack(hidden), counted


# -- 1. the vectorised draft equals the reference --------------------------------------------

T = 14
WINDOW = 5  # shorter than T


def holey_mask(B, T, generator):
    mask = (torch.rand(B, T, generator=generator) > 0.3).long()
    mask[:, T // 2 : T // 2 + 3] = 0  # a hole wider than one token
    mask[0, -1] = 1
    return mask


def anchor_positions(T, sinks=2, offset=1000):
    positions = torch.arange(T)
    positions[sinks:] += offset  # a jump after the sink tokens
    return positions


CASES = [dict(lag=lag, positions=pos, kv_heads=2) for lag in (1, 2, 3) for pos in ("plain", "anchor")]
CASES += [dict(lag=2, positions="plain", kv_heads=4), dict(lag=3, positions="anchor", kv_heads=1, final_norm=True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_logits_and_gradients_equal_the_per_position_reference(case, monkeypatch):
    lag, max_lag = case["lag"], 3
    target = build_target(kv_heads=case["kv_heads"])
    draft = build_glide(target, WINDOW, max_lag, final_norm=case.get("final_norm", False), seed=lag)
    generator = torch.Generator().manual_seed(lag)
    B = 2
    ids = torch.randint(0, VOCAB, (B, T), generator=generator)
    mask = holey_mask(B, T, generator)
    positions = anchor_positions(T) if case["positions"] == "anchor" else torch.arange(T)

    ref_loss, ref_hidden, counted = reference_loss(draft, target, ids, mask, lag, positions)
    draft.zero_grad()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in draft.named_parameters()}

    # logits of the forward, every position (those without target context included)
    feats = features(target, ids, positions)
    with torch.no_grad():
        hidden = draft_hidden(draft, feats, lag)
    head = target.lm_head.weight
    torch.testing.assert_close(hidden @ head.t(), ref_hidden.detach() @ head.t(), rtol=1e-4, atol=1e-4)

    # what the loss trains on: exactly the reference's (position, label) pairs, in order
    rows, labels = training_predictions(
        monkeypatch, draft, target, ids, mask, lag, None if case["positions"] == "plain" else positions
    )
    assert labels.tolist() == [label for _, _, label in counted]
    expected_rows = torch.stack([ref_hidden[b, t] for b, t, _ in counted]).detach()
    torch.testing.assert_close(rows, expected_rows, rtol=1e-4, atol=1e-4)

    draft.zero_grad()
    out = training_loss(draft, target, ids, mask, lag, None if case["positions"] == "plain" else positions)
    out.loss.backward()
    assert int(out.tokens) == len(counted)
    torch.testing.assert_close(out.loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for name, p in draft.named_parameters():
        assert ref_grads[name].abs().sum() > 0, name  # every parameter is exercised
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_anchor_offset_positions_reach_the_draft_rope(monkeypatch):
    """The jump in position ids changes the loss (RoPE saw it) — and the reference agrees above."""
    target = build_target()
    draft = build_glide(target, WINDOW, 3)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = training_loss(draft, target, ids, mask, 2).loss
        shifted = training_loss(draft, target, ids, mask, 2, anchor_positions(T)).loss
    assert abs(plain.item() - shifted.item()) > 1e-4


def test_lags_are_drawn_from_one_to_max_lag():
    target = build_target()
    for max_lag in (1, 3, 4):
        draft = build_glide(target, WINDOW, max_lag)
        lags = {draft.sample_batch_options(torch.Generator().manual_seed(s), T)["lag"] for s in range(60)}
        assert lags == set(range(1, max_lag + 1))


# -- 2. visibility at the exact boundary, both sides -----------------------------------------

BOUNDARY_T = 20


@pytest.fixture(scope="module")
def boundary_setup():
    target = build_target()
    ids = torch.randint(0, VOCAB, (1, BOUNDARY_T), generator=torch.Generator().manual_seed(3))
    return target, features(target, ids)


def _perturbed(tensor, position, seed):
    out = tensor.clone()
    out[:, :, position] += torch.randn(out[:, :, position].shape, generator=torch.Generator().manual_seed(seed))
    return out


@pytest.mark.parametrize("lag", [1, 2, 3, 4])
def test_target_kv_visible_up_to_t_minus_lag_and_not_one_further(boundary_setup, lag):
    target, feats = boundary_setup
    draft = build_glide(target, window=BOUNDARY_T, max_lag=4)
    with torch.no_grad():
        base = draft_hidden(draft, feats, lag)
        for t in (lag, lag + 1, 9, BOUNDARY_T - 1):
            for which in ("keys", "values"):
                for position, visible in ((t - lag + 1, False), (t - lag, True)):
                    if which == "keys" and visible and position == 0:
                        continue  # one visible key: softmax gives it weight 1 whatever it is
                    keys, values = feats.last_keys, feats.last_values
                    if which == "keys":
                        keys = _perturbed(keys, position, seed=t)
                    else:
                        values = _perturbed(values, position, seed=t)
                    out = draft_hidden_kv(draft, feats, lag, keys, values)
                    if visible:
                        assert (out[0, t] - base[0, t]).abs().max() > 1e-3, (t, lag, which, position)
                    else:
                        torch.testing.assert_close(out[0, t], base[0, t], rtol=0, atol=1e-6)
            # everything later than the limit at once: still invisible
            keys = feats.last_keys.clone()
            keys[:, :, t - lag + 1 :] += 3.0
            values = feats.last_values.clone()
            values[:, :, t - lag + 1 :] += 3.0
            out = draft_hidden_kv(draft, feats, lag, keys, values)
            torch.testing.assert_close(out[0, : t + 1], base[0, : t + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("lag", [1, 3])
def test_queries_before_the_lag_get_no_cross_attention(boundary_setup, lag):
    """t < lag reads no target position: any target K/V gives the same output there."""
    target, feats = boundary_setup
    draft = build_glide(target, window=BOUNDARY_T, max_lag=4)
    with torch.no_grad():
        base = draft_hidden(draft, feats, lag)
        out = draft_hidden_kv(draft, feats, lag, feats.last_keys * 3 + 1, feats.last_values * -2 + 1)
        torch.testing.assert_close(out[0, :lag], base[0, :lag], rtol=0, atol=1e-6)
        assert (out[0, lag] - base[0, lag]).abs().max() > 1e-3
        # and the no-context output equals the draft without its cross-attention block
        draft.cross_attn.o_proj.weight.zero_()
        without = draft_hidden(draft, feats, lag)
    torch.testing.assert_close(base[0, :lag], without[0, :lag], rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_self_attention_sees_t_minus_window_plus_one_and_not_t_minus_window(boundary_setup, window):
    target, feats = boundary_setup
    draft = build_glide(target, window=window, max_lag=4)
    lag = 1
    with torch.no_grad():
        base = draft_hidden(draft, feats, lag)
        for t in (window, window + 2, BOUNDARY_T - 1):
            for position, visible in ((t - window, False), (t - window + 1, True)):
                if position == t:  # window 1: the query itself, changed through its own input
                    continue
                embeds = feats.input_embeds.clone()
                embeds[0, position] += torch.randn(HIDDEN, generator=torch.Generator().manual_seed(t))
                out = draft_hidden_kv(draft, feats, lag, feats.last_keys, feats.last_values, embeds)
                if visible:
                    assert (out[0, t] - base[0, t]).abs().max() > 1e-3, (t, window, position)
                else:
                    torch.testing.assert_close(out[0, t], base[0, t], rtol=0, atol=1e-6)


# -- 3. alignment: each counted position is trained on the next token ------------------------

ALIGN_V = HIDDEN  # vocab == hidden, lm_head = identity: the hidden state IS the logits
LM_HEAD_IDENTITY = torch.eye(ALIGN_V)


def next_token(current):
    return (current * 3 + 1) % ALIGN_V


@pytest.fixture(scope="module")
def align_setup():
    target = build_target(vocab=ALIGN_V)
    draft = build_glide(target, window=4, max_lag=3)
    T = 12
    ids = torch.zeros(2, T, dtype=torch.long)
    ids[:, 0] = torch.tensor([5, 11])
    for t in range(1, T):
        ids[:, t] = next_token(ids[:, t - 1])
    assert not (ids[:, 1:] == ids[:, :-1]).any()  # "repeat the current token" is a different answer
    mask = torch.ones_like(ids)
    mask[0, 6] = 0  # holes: position 5 of row 0 and position 8 of row 1 predict masked tokens
    mask[1, 9] = 0
    return draft, features(target, ids), ids, mask


def _loss_with_candidate(draft, feats, ids, mask, lag, b, t, token):
    hidden = torch.zeros(ids.shape[0], ids.shape[1], ALIGN_V)
    hidden[b, t, token] = 8.0  # position t puts its mass on `token`; every other row is uniform
    return float(loss_given_hidden(draft, feats, ids, mask, lag, hidden).loss)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_loss_is_minimal_exactly_at_the_next_token_of_each_counted_position(align_setup, lag):
    draft, feats, ids, mask = align_setup
    B, T = ids.shape
    for b in range(B):
        for t in range(T):
            losses = torch.tensor([_loss_with_candidate(draft, feats, ids, mask, lag, b, t, k) for k in range(ALIGN_V)])
            counted = t >= lag and t + 1 < T and bool(mask[b, t + 1])
            if counted:
                assert int(losses.argmin()) == int(next_token(ids[b, t])) == int(ids[b, t + 1]), (b, t)
                assert int((losses == losses.min()).sum()) == 1  # the only minimum
            else:  # t < lag, the last position, masked labels: the prediction is not trained at all
                assert bool((losses == losses[0]).all()), (b, t, lag)


@pytest.mark.parametrize("lag", [1, 3])
def test_labels_of_uncounted_positions_change_neither_loss_nor_gradient(align_setup, lag):
    draft, feats, ids, mask = align_setup
    B, T = ids.shape
    hidden = torch.randn(B, T, ALIGN_V, generator=torch.Generator().manual_seed(lag), requires_grad=True)

    def loss_and_grad(labels):
        hidden.grad = None
        out = loss_given_hidden(draft, feats, labels, mask, lag, hidden)
        out.loss.backward()
        return out.loss.detach(), hidden.grad.clone()

    base_loss, base_grad = loss_and_grad(ids)
    for b in range(B):
        for t in range(T - 1):  # the label of position t is ids[b, t + 1]
            changed = ids.clone()
            changed[b, t + 1] = (changed[b, t + 1] + 17) % ALIGN_V
            loss, grad = loss_and_grad(changed)
            if t >= lag and mask[b, t + 1]:
                assert float((loss - base_loss).abs()) > 1e-4, (b, t)
                assert (grad[b, t] - base_grad[b, t]).abs().max() > 1e-4
            else:
                assert torch.equal(loss, base_loss), (b, t)
                assert torch.equal(grad, base_grad), (b, t)


def test_a_trained_draft_predicts_the_next_token_not_the_current_one():
    """End to end through TargetWithDraft: fit the batch, then argmax at every counted position
    is next_token(current) (the other way round would be the identity)."""
    target = build_target(vocab=ALIGN_V, seed=1)
    draft = build_glide(target, window=3, max_lag=2)
    model = TargetWithDraft(target, draft, loss_chunk_size=16)
    generator = torch.Generator().manual_seed(0)
    T = 16
    start = torch.randint(0, ALIGN_V, (4,), generator=generator)
    ids = torch.zeros(4, T, dtype=torch.long)
    ids[:, 0] = start
    for t in range(1, T):
        ids[:, t] = next_token(ids[:, t - 1])
    mask = torch.ones_like(ids)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for step in range(300):
        optimizer.zero_grad()
        out = model(ids, mask, lag=1 + step % 2)
        out.loss.backward()
        optimizer.step()
        if int(out.correct) == int(out.tokens):
            break
    lag = 2
    with torch.no_grad():
        logits = draft_hidden(draft, features(target, ids), lag) @ target.lm_head.weight.t()
    predicted = logits.argmax(-1)[:, lag : T - 1]
    assert torch.equal(predicted, next_token(ids[:, lag : T - 1]))


# -- 4. training logits == drafting logits, at every lag the drafter drafts at ---------------


def training_logits_at(monkeypatch, draft, target, sequence, lag, position):
    """The training loss's logits for position `position` of `sequence` at lag `lag`."""
    ids = torch.as_tensor(sequence)[None]
    rows, labels = training_predictions(monkeypatch, draft, target, ids, torch.ones_like(ids), lag)
    row = position - lag  # all-ones mask: rows are positions lag .. T-2 in order
    assert int(labels[row]) == int(ids[0, position + 1])
    return (rows[row] @ target.lm_head.weight.t()).float()


@pytest.fixture(scope="module")
def decode_setup():
    target = build_target(vocab=VOCAB, init=0.2)
    draft = build_glide(target, window=6, max_lag=4, seed=7).eval()
    return target, draft


def _rounds(target, seed):
    """Yield (tokens, target cache) for decoding rounds of varying accepted lengths."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (11,), generator=generator)  # longer than the window
    cache = new_cache(target)
    forward(target, cache, tokens[:-1], torch.arange(len(tokens) - 1))
    for advance in (2, 1, 4):
        yield tokens, cache
        n = cache_length(cache)
        new = torch.randint(0, VOCAB, (advance,), generator=generator)
        forward(target, cache, torch.cat([tokens[-1:], new[:-1]]), torch.arange(n, n + advance))
        tokens = torch.cat([tokens, new])


def test_chain_drafting_logits_equal_training_logits_at_lag_j(decode_setup, monkeypatch):
    target, draft = decode_setup
    drafter = make_drafter(draft, target)
    drafter.start()
    gamma = 4
    generator = torch.Generator().manual_seed(1)
    for tokens, cache in _rounds(target, seed=2):
        n = cache_length(cache)
        calls = record_drafter_logits(drafter)
        proposal = drafter.propose_chain(tokens, cache, gamma, 1.0, generator)
        assert len(calls) == gamma  # catch-up (ends at x_n), then tokens 1 .. gamma-1
        sequence = tokens.tolist() + proposal.tokens.tolist()
        for j in range(1, gamma + 1):  # token j: query at index n + j - 1, target K/V <= n - 1
            index, logits = calls[j - 1]
            assert int(index[-1]) == n + j - 1
            expected = training_logits_at(monkeypatch, draft, target, sequence, lag=j, position=n + j - 1)
            torch.testing.assert_close(logits[0, -1], expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(proposal.q[j - 1], torch.softmax(expected, -1), rtol=1e-4, atol=1e-5)


def test_tree_drafting_logits_equal_training_logits_at_lag_depth(decode_setup, monkeypatch):
    target, draft = decode_setup
    drafter = make_drafter(draft, target)
    drafter.start()
    widths = [3, 2, 2, 2]
    for tokens, cache in _rounds(target, seed=4):
        n = cache_length(cache)
        calls = record_drafter_logits(drafter)
        tree = drafter.propose_tree(tokens, cache, widths)
        depth = tree.depth
        assert len(calls) == len(widths)  # catch-up, then one call per expanded depth
        for node in range(len(tree)):
            d = int(depth[node])
            path, walk = [], node
            while walk >= 0:
                path.insert(0, int(tree.tokens[walk]))
                walk = int(tree.parents[walk])
            sequence = tokens.tolist() + path
            if d < len(widths):  # the node was expanded: its row at depth d reads lag d + 1
                row = int((depth[:node] == d).sum())  # frontier rows are the depth-d nodes in order
                index, logits = calls[d]
                assert int(index[-1]) == n + d
                expected = training_logits_at(monkeypatch, draft, target, sequence + [0], lag=d + 1, position=n + d)
                torch.testing.assert_close(logits[row, -1], expected, rtol=1e-4, atol=1e-4)
        root = training_logits_at(monkeypatch, draft, target, tokens.tolist() + [0], lag=1, position=n)
        torch.testing.assert_close(calls[0][1][0, -1], root, rtol=1e-4, atol=1e-4)
