"""The mask the target gets: causal and inside each document, never inferred from position jumps.

Without a mask and a cache, transformers reads any jump in position ids as the border of a packed
sequence; Anchor-Offset positions jump on purpose. These tests pin what the target sees.
"""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from helpers import random_llama
from specdraft.drafts.base import LossBatch
from specdraft.config import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.target.attention import document_attention
from specdraft.target.capture import CaptureRequest, capture
from specdraft.train.model import TargetWithDraft


def target_features(base_model, ids, positions, documents=None):
    """The capture GLIDE asks for, with the attention training gives it."""
    return capture(base_model, ids, positions, CaptureRequest(last_layer_kv=True), document_attention(documents))


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=128, init=0.02)


def anchor_positions(T, sinks, offset):
    positions = torch.arange(T)
    positions[sinks:] += offset
    return positions[None]


def test_a_sink_token_stays_visible_after_the_anchor_offset(target):
    T, sinks = 20, 3
    positions = anchor_positions(T, sinks, 1000)
    ids = torch.randint(0, 128, (1, T))
    changed = ids.clone()
    changed[0, 1] = (changed[0, 1] + 5) % 128  # a sink token
    base = target_features(target.model, ids, positions).last_keys
    after = target_features(target.model, changed, positions).last_keys
    assert not torch.allclose(base[:, :, sinks:], after[:, :, sinks:])  # later tokens still read the sink
    # the trap this guards against: no mask, no cache -> the jump is read as a sequence border
    with torch.no_grad():
        trap = [
            target.model(input_ids=x, position_ids=positions, use_cache=False).last_hidden_state for x in (ids, changed)
        ]
    torch.testing.assert_close(trap[0][:, sinks:], trap[1][:, sinks:])


def test_without_documents_the_capture_equals_the_cached_causal_pass(target):
    """No border in the batch: the explicit 2-D mask gives what the old DynamicCache path gave."""
    ids = torch.randint(0, 128, (2, 16))
    positions = anchor_positions(16, 2, 500).expand(2, -1)
    feats = target_features(target.model, ids, positions)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(feats.last_keys, cache.layers[-1].keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats.last_values, cache.layers[-1].values, rtol=0, atol=1e-6)


def packed(lengths):
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return documents, positions


def test_a_document_border_is_respected_by_the_target(target):
    lengths = [9, 15]
    documents, positions = packed(lengths)
    ids = torch.randint(0, 128, (1, sum(lengths)))
    feats = target_features(target.model, ids, positions, documents)
    alone = target_features(target.model, ids[:, 9:], torch.arange(15)[None])
    torch.testing.assert_close(feats.last_keys[:, :, 9:], alone.last_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats.last_values[:, :, 9:], alone.last_values, rtol=1e-5, atol=1e-5)
    changed = ids.clone()
    changed[0, :9] = (changed[0, :9] + 3) % 128  # all of document 0
    other = target_features(target.model, changed, positions, documents)
    torch.testing.assert_close(other.last_values[:, :, 9:], feats.last_values[:, :, 9:], rtol=0, atol=1e-6)
    assert not torch.allclose(other.last_values[:, :, :9], feats.last_values[:, :, :9])


@pytest.mark.parametrize("lag", [1, 3])
def test_packed_loss_is_the_sum_of_each_documents_loss(target, lag):
    """Target, draft and labels all stay inside documents: the packed row's summed loss equals
    the sum over its documents run one by one."""
    draft = build_draft(OmegaConf.structured(DraftConfig(sliding_window=6, max_lag=4)), target.config)
    model = TargetWithDraft(target, draft, loss_chunk_size=5)
    lengths = [7, 2, 12, 9]
    documents, positions = packed(lengths)
    ids = torch.randint(0, 128, (1, sum(lengths)))
    loss_mask = torch.randint(0, 2, ids.shape)
    out = model(ids, loss_mask, document_positions=positions, document_ids=documents, lag=lag)
    total, tokens, start = 0.0, 0, 0
    for n in lengths:
        part = model(ids[:, start : start + n], loss_mask[:, start : start + n], lag=lag)
        total, tokens, start = total + part.loss.item() * int(part.tokens), tokens + int(part.tokens), start + n
    assert int(out.tokens) == tokens
    assert out.loss.item() * int(out.tokens) == pytest.approx(total, rel=1e-5, abs=1e-4)


def test_glide_capture_skips_what_nobody_reads_and_keeps_one_layer_of_kv(target, monkeypatch):
    """GLIDE asks for the last layer's K/V: that layer's attention output, its MLP and the final
    norm never run, no other layer's K/V is kept, and the K/V and the draft loss equal those of
    a full cached pass (the old capture)."""
    from specdraft.target import capture as capture_module

    calls = {"mlp": 0, "norm": 0, "o_proj": 0}
    last = target.model.layers[-1]
    hooks = [
        last.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1)),
        last.self_attn.o_proj.register_forward_hook(lambda *a: calls.__setitem__("o_proj", calls["o_proj"] + 1)),
        target.model.norm.register_forward_hook(lambda *a: calls.__setitem__("norm", calls["norm"] + 1)),
    ]
    stored = []
    original = capture_module._LastLayerKV.update

    def spy(self, key_states, value_states, layer_idx, *args, **kwargs):
        stored.append(layer_idx)
        return original(self, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(capture_module._LastLayerKV, "update", spy)
    ids = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16)[None].expand(2, -1)
    try:
        feats = target_features(target.model, ids, positions)
        assert calls == {"mlp": 0, "norm": 0, "o_proj": 0}
        assert stored == [0, 1]  # every layer hands its K/V over; only the last is kept
        full = capture(target.model, ids, positions, CaptureRequest(last_layer_kv=True, final_hidden=True))
        assert calls == {"mlp": 1, "norm": 1, "o_proj": 1}  # asked for the final hidden: the whole stack
    finally:
        for hook in hooks:
            hook.remove()
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(feats.last_keys, cache.layers[-1].keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(full.last_values, cache.layers[-1].values, rtol=0, atol=1e-6)
    draft = build_draft(OmegaConf.structured(DraftConfig(sliding_window=6, max_lag=4)), target.config)
    old = type(feats)(
        input_embeds=feats.input_embeds,
        cos=feats.cos,
        sin=feats.sin,
        hidden={},
        last_keys=cache.layers[-1].keys,
        last_values=cache.layers[-1].values,
    )
    loss_mask = torch.ones_like(ids)
    new_loss = draft.training_loss(LossBatch(feats, target.lm_head.weight, ids, loss_mask, 0, options={"lag": 2})).loss
    old_loss = draft.training_loss(LossBatch(old, target.lm_head.weight, ids, loss_mask, 0, options={"lag": 2})).loss
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-6, atol=1e-6)


def test_a_sliding_window_shorter_than_the_sequences_is_accepted():
    """The capture applies each layer's window (tests/test_capture_architectures.py): a target
    whose windowed layers are shorter than max_seq_length trains at it (was refused)."""
    from transformers import MistralConfig, Qwen2Config

    from specdraft.target.checks import check_sequence_length

    check_sequence_length(MistralConfig(sliding_window=64, max_position_embeddings=512), 128, "train.yaml")
    check_sequence_length(
        Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=1, num_hidden_layers=2),
        128,
        "train.yaml",
    )


def test_a_window_as_long_as_the_sequence_captures_what_transformers_computes():
    """At T <= window the windowed layers attend causally: the capture equals transformers' forward."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    )
    model = MistralForCausalLM(config).eval().requires_grad_(False)
    ids = torch.randint(0, 128, (2, 32))
    positions = torch.arange(32)[None]
    features = capture(model.model, ids, positions, CaptureRequest(layers=(1,)))
    expected = model.model(ids, position_ids=positions, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(features.hidden[1], expected, rtol=1e-5, atol=1e-5)
