"""target.capture: exactly what was asked, in vLLM's layer convention, only as deep as needed."""

import pytest
import torch
from transformers import DynamicCache

from helpers import random_llama
from specdraft.target.capture import CaptureRequest, capture

T = 12
LAYERS = 4


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=128, layers=LAYERS, init=0.02)


def reference(target, ids, positions):
    with torch.no_grad():
        return target.model(
            ids,
            position_ids=positions,
            past_key_values=DynamicCache(config=target.config),
            use_cache=True,
            output_hidden_states=True,
        )


def test_layer_ids_are_layer_inputs_and_final_hidden_is_normed(target):
    ids = torch.randint(0, 128, (2, T))
    positions = torch.arange(T)[None].expand(2, T)
    ref = reference(target, ids, positions)
    features = capture(
        target.model, ids, positions, CaptureRequest(layers=(0, 1, 3, LAYERS), last_layer_kv=True, final_hidden=True)
    )
    assert sorted(features.hidden) == [0, 1, 3, LAYERS]
    torch.testing.assert_close(features.hidden[0], target.model.embed_tokens(ids))  # input of layer 0
    for layer in (1, 3):  # input of layer i = output of layer i - 1
        torch.testing.assert_close(features.hidden[layer], ref.hidden_states[layer])
    # id L: the last layer's output before the final norm
    torch.testing.assert_close(target.model.norm(features.hidden[LAYERS]), ref.last_hidden_state)
    assert not torch.allclose(features.hidden[LAYERS], ref.last_hidden_state)
    torch.testing.assert_close(features.final_hidden, ref.last_hidden_state)
    torch.testing.assert_close(features.last_keys, ref.past_key_values.layers[-1].keys)
    torch.testing.assert_close(features.last_values, ref.past_key_values.layers[-1].values)


def test_capture_stops_at_the_deepest_layer_asked_for(target):
    calls = []
    handles = [
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, layer in enumerate(target.model.layers)
    ]
    try:
        ids = torch.randint(0, 128, (1, T))
        features = capture(target.model, ids, torch.arange(T)[None], CaptureRequest(layers=(1, 2)))
        assert calls == [0, 1]  # layer 2's input is layer 1's output: layers 2, 3 never run
        assert features.final_hidden is None and features.last_keys is None
        calls.clear()
        capture(target.model, ids, torch.arange(T)[None], CaptureRequest(layers=(1,), final_hidden=True))
        assert calls == [0, 1, 2, 3]  # the final hidden needs the whole stack
    finally:
        for h in handles:
            h.remove()


def test_jumping_positions_keep_a_plain_causal_mask(target):
    """Anchor-Offset positions jump on purpose; transformers would read a jump as the border of a
    packed sequence when no cache is passed. The capture must still attend across the jump."""
    ids = torch.randint(0, 128, (1, T))
    positions = torch.arange(T)[None].clone()
    positions[:, 3:] += 500
    features = capture(target.model, ids, positions, CaptureRequest(layers=(LAYERS,)))
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 128  # a token before the jump
    after = capture(target.model, changed, positions, CaptureRequest(layers=(LAYERS,)))
    assert not torch.allclose(after.hidden[LAYERS][0, 5:], features.hidden[LAYERS][0, 5:])  # seen across it


def test_merged_requests_ask_for_both():
    merged = CaptureRequest(layers=(3, 1)).merged(CaptureRequest(layers=(1, 2), final_hidden=True))
    assert merged == CaptureRequest(layers=(1, 2, 3), last_layer_kv=False, final_hidden=True)
