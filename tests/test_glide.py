"""GLIDE draft: what each query may see, the chunked loss, and no dead parameters."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.config import DraftConfig
from specdraft.drafts import build_draft
from specdraft.drafts.glide import SlidingWindowCache
from specdraft.drafts.loss import chunked_cross_entropy
from specdraft.target.model import target_features
from specdraft.train.model import TargetWithDraft

T = 24


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def make_draft(target, window=6, max_lag=4):
    cfg = OmegaConf.structured(DraftConfig(sliding_window=window, max_lag=max_lag))
    draft = build_draft(cfg, target.config)
    with torch.no_grad():  # non-trivial norms so every path carries signal
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return draft


def draft_outputs(draft, feats, lag):
    index = torch.arange(T)
    return draft(feats.input_embeds, feats.cos, feats.sin, feats.last_keys, feats.last_values,
                 cross_limit=index - lag, index=index)


def features(target, ids):
    return target_features(target.model, ids, torch.arange(ids.shape[1])[None])


@pytest.mark.parametrize("lag", [1, 3])
def test_future_tokens_never_change_the_output(target, lag):
    draft = make_draft(target)
    ids = torch.randint(0, 128, (1, T))
    base = draft_outputs(draft, features(target, ids), lag)
    for t in (5, 12, T - 2):
        changed = ids.clone()
        changed[0, t + 1:] = (changed[0, t + 1:] + 7) % 128
        out = draft_outputs(draft, features(target, changed), lag)
        torch.testing.assert_close(out[0, :t + 1], base[0, :t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(out[0, t + 1:], base[0, t + 1:])  # the perturbation is real


# Visibility at the exact boundaries (target K/V at t - lag vs t - lag + 1, the window edge) is
# pinned in test_glide_semantics.py.


def test_incremental_decoding_with_sliding_cache_matches_full_pass(target):
    window = 5
    draft = make_draft(target, window=window)
    feats = features(target, torch.randint(0, 128, (1, T)))
    index = torch.arange(T)
    limit = torch.clamp(index - 2, min=-1)
    full = draft(feats.input_embeds, feats.cos, feats.sin, feats.last_keys, feats.last_values, limit, index)
    cache = SlidingWindowCache(window)
    for t in range(T):
        sl = slice(t, t + 1)
        step = draft(feats.input_embeds[:, sl], feats.cos[:, sl], feats.sin[:, sl], feats.last_keys,
                     feats.last_values, limit[sl], index[sl], cache=cache)
        torch.testing.assert_close(step[0, 0], full[0, t], rtol=1e-5, atol=1e-5)
        assert len(cache) <= window


def test_chunked_cross_entropy_equals_full_softmax():
    torch.manual_seed(1)
    hidden = torch.randn(53, 32, requires_grad=True)
    weight = torch.randn(300, 32)
    labels = torch.randint(0, 300, (53,))
    loss, correct = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
    loss.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ weight.t()
    reference = F.cross_entropy(logits, labels, reduction="sum")
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-4, atol=1e-5)
    assert int(correct) == int((logits.argmax(-1) == labels).sum())


def test_every_draft_parameter_gets_a_gradient_and_target_none(target):
    draft = make_draft(target)
    model = TargetWithDraft(target, draft, loss_chunk_size=7)
    ids = torch.randint(0, 128, (2, T))
    out = model(ids, torch.ones_like(ids), lag=2)
    out.loss.backward()
    dead = [n for n, p in draft.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []
    assert all(p.grad is None for p in target.parameters())
    # lag 2: the first two positions have no target context and leave the loss
    assert out.tokens == 2 * (T - 1 - 2)
    assert {k.split(".")[0] for k in model.state_dict()} == {"model", "lm_head", "draft_model"}
    assert not any(k.startswith("draft_model.") and "embed" in k for k in model.state_dict())


def test_anchor_offset_positions_reach_target_and_draft(target):
    cfg = OmegaConf.structured(DraftConfig(anchor_offset=True, max_sink_tokens=4, max_position_offset=1000))
    draft = build_draft(cfg, target.config)
    draws = [draft.sample_batch_options(torch.Generator().manual_seed(seed), T) for seed in range(20)]
    sinks = [int((o["position_ids"] == torch.arange(T)).cumprod(0).sum()) for o in draws]
    assert set(sinks) == set(range(5))  # s in [0, max_sink_tokens]
    options = draws[sinks.index(2)]
    positions = options["position_ids"]
    assert (positions[:2] == torch.arange(2)).all() and positions[2] > 2
    assert (positions.diff()[2:] == 1).all()  # the rest keeps its spacing, shifted as a block
    model = TargetWithDraft(target, draft)
    ids = torch.randint(0, 128, (1, T))
    shifted = model(ids, torch.ones_like(ids), **options).loss
    plain = model(ids, torch.ones_like(ids), lag=options["lag"]).loss
    assert torch.isfinite(shifted) and shifted.item() != plain.item()  # RoPE saw other positions
    keys = target_features(target.model, ids, options["position_ids"][None]).last_keys
    plain_keys = target_features(target.model, ids, torch.arange(T)[None]).last_keys
    torch.testing.assert_close(keys[:, :, :2], plain_keys[:, :, :2])  # sinks keep positions 0, 1
    assert not torch.allclose(keys[:, :, 2:], plain_keys[:, :, 2:])  # the rest rotated elsewhere
