"""GLIDE draft: what each query may see, the chunked loss, and no dead parameters."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import random_llama
from specdraft.drafts.base import LossBatch
from specdraft.config import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts.glide.model import SlidingWindowCache
from specdraft.drafts.loss import LOGITS_CHUNK_BYTES, chunked_cross_entropy, default_chunk_size
from specdraft.target.capture import CaptureRequest, capture
from specdraft.train.model import TargetWithDraft

T = 24


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=128, init=0.02)


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
    return draft(
        feats.input_embeds,
        feats.cos,
        feats.sin,
        feats.last_keys,
        feats.last_values,
        cross_limit=index - lag,
        index=index,
    )


def target_features(base_model, ids, position_ids):
    return capture(base_model, ids, position_ids, CaptureRequest(last_layer_kv=True))


def features(target, ids):
    return target_features(target.model, ids, torch.arange(ids.shape[1])[None])


@pytest.mark.parametrize("lag", [1, 3])
def test_future_tokens_never_change_the_output(target, lag):
    draft = make_draft(target)
    ids = torch.randint(0, 128, (1, T))
    base = draft_outputs(draft, features(target, ids), lag)
    for t in (5, 12, T - 2):
        changed = ids.clone()
        changed[0, t + 1 :] = (changed[0, t + 1 :] + 7) % 128
        out = draft_outputs(draft, features(target, changed), lag)
        torch.testing.assert_close(out[0, : t + 1], base[0, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(out[0, t + 1 :], base[0, t + 1 :])  # the perturbation is real


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
        step = draft(
            feats.input_embeds[:, sl],
            feats.cos[:, sl],
            feats.sin[:, sl],
            feats.last_keys,
            feats.last_values,
            limit[sl],
            index[sl],
            cache=cache,
        )
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


@pytest.mark.parametrize(
    "window,length,lag", [(4, 24, 1), (6, 25, 3), (16, 24, 2), (24, 24, 2), (40, 24, 4), (5, 24, 30)]
)
def test_training_attention_without_masks_equals_the_dense_mask_path(target, window, length, lag):
    """The training path (is_causal / blocked band, no (T, T) mask) gives what the general
    masked path gives, outputs and loss, on a batch without document borders."""
    draft = make_draft(target, window=window)
    ids = torch.randint(0, 128, (2, length))
    feats = target_features(target.model, ids, torch.arange(length)[None].expand(2, -1))
    index = torch.arange(length)
    dense = draft(
        feats.input_embeds,
        feats.cos,
        feats.sin,
        feats.last_keys,
        feats.last_values,
        cross_limit=index - lag,
        index=index,
    )
    fast = draft.forward_sequence(feats.input_embeds, feats.cos, feats.sin, feats.last_keys, feats.last_values, lag)
    torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-5)
    weight = target.lm_head.weight
    mask = (index[None, :-1] >= lag).expand(2, -1)
    labels = ids[:, 1:][mask]
    dense_loss, _ = chunked_cross_entropy(dense[:, :-1][mask], weight, labels, 16)
    fast_loss = draft.training_loss(
        LossBatch(feats, weight, ids, torch.ones_like(ids), chunk_size=16, options={"lag": lag})
    ).loss
    torch.testing.assert_close(fast_loss * max(labels.numel(), 1), dense_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,lag", [(4, 1), (7, 2), (20, 2), (64, 3)])
def test_documents_attend_only_inside_themselves(target, window, lag):
    """Packed documents: each one's draft outputs equal a run of that document alone."""
    draft = make_draft(target, window=window)
    borders = [0, 9, 10, 23, 30]  # documents of 9, 1, 13 and 7 tokens
    length = borders[-1]
    documents = torch.zeros(1, length, dtype=torch.long)
    positions = torch.zeros(1, length, dtype=torch.long)
    for d, (s, e) in enumerate(zip(borders, borders[1:])):
        documents[0, s:e] = d
        positions[0, s:e] = torch.arange(e - s)
    ids = torch.randint(0, 128, (1, length))
    embeds = target.model.embed_tokens(ids)
    cos, sin = target.model.rotary_emb(embeds, positions)
    keys, values = torch.randn(2, 1, 2, length, 16).unbind(0)  # any target K/V: (1, KV, T, D)
    packed = draft.forward_sequence(embeds, cos, sin, keys, values, lag, documents)
    for s, e in zip(borders, borders[1:]):
        alone = draft.forward_sequence(
            embeds[:, s:e], cos[:, s:e], sin[:, s:e], keys[:, :, s:e], values[:, :, s:e], lag
        )
        torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-5, atol=1e-5)


def test_default_loss_chunk_is_sized_from_the_vocab():
    assert default_chunk_size(151936) == 384  # 384 x 151936 x 4 B = 222 MiB of fp32 logits
    assert default_chunk_size(32000) == 2048
    assert default_chunk_size(10_000_000) == 64  # never fewer than 64 rows
    for vocab in (4096, 32000, 151936):
        assert default_chunk_size(vocab) * vocab * 4 <= LOGITS_CHUNK_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_chunked_loss_equals_the_reference(dtype):
    """Loss, gradient and hits of the in-place chunks equal F.cross_entropy on full logits,
    at every chunk size (one row, uneven, the default)."""
    torch.manual_seed(2)
    hidden = torch.randn(70, 32, dtype=dtype)
    weight = torch.randn(300, 32, dtype=dtype)
    labels = torch.randint(0, 300, (70,))
    logits = hidden.float() @ weight.float().t()
    ref_hidden = hidden.float().clone().requires_grad_()
    reference = F.cross_entropy(ref_hidden @ weight.float().t(), labels, reduction="sum")
    reference.backward()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    for chunk in (1, 17, 0):
        h = hidden.detach().clone().requires_grad_()
        loss, correct = chunked_cross_entropy(h, weight, labels, chunk_size=chunk)
        loss.backward()
        torch.testing.assert_close(loss, reference, **tol)
        torch.testing.assert_close(h.grad.float(), ref_hidden.grad, **tol)
        if dtype == torch.float32:
            assert int(correct) == int((logits.argmax(-1) == labels).sum())
