"""What a draft reads from the frozen target, and the one pass that produces exactly that.

    request = draft.capture_request()        # CaptureRequest(layers=(2, 16, 29), final_hidden=True)
    features = capture(base_model, input_ids, position_ids, request)

Layer ids follow vLLM / speculators: id i is the hidden state at the INPUT of decoder layer i
(the residual stream after layers 0..i-1); id L (the layer count) is the output of the last layer,
before the final norm. The target's own K/V cache is passed in so that transformers builds a plain
causal mask: without a cache it reads jumps in position_ids as borders of packed sequences, and
Anchor-Offset positions jump on purpose.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn
from transformers import DynamicCache


@dataclass(frozen=True)
class CaptureRequest:
    layers: Tuple[int, ...] = ()  # hidden states at the input of these decoder layers
    last_layer_kv: bool = False  # the last decoder layer's K/V, RoPE applied
    final_hidden: bool = False  # final-norm output: what the target's lm_head reads
    token_embeddings: Tuple[int, ...] = ()  # input embeddings of these token ids (DFlash's MASK)

    def merged(self, other: "CaptureRequest") -> "CaptureRequest":
        return CaptureRequest(layers=tuple(sorted(set(self.layers) | set(other.layers))),
                              last_layer_kv=self.last_layer_kv or other.last_layer_kv,
                              final_hidden=self.final_hidden or other.final_hidden,
                              token_embeddings=tuple(dict.fromkeys(self.token_embeddings + other.token_embeddings)))

    def needs_whole_stack(self, num_layers: int) -> bool:
        return self.last_layer_kv or self.final_hidden or num_layers in self.layers


@dataclass
class TargetFeatures:
    """What one target pass gives a draft (all computed under no_grad)."""

    input_embeds: torch.Tensor  # (B, T, H) target embeddings of the input tokens
    cos: torch.Tensor  # (B, T, D) target rotary tables at the input positions
    sin: torch.Tensor  # (B, T, D)
    hidden: Dict[int, torch.Tensor]  # layer id -> (B, T, H)
    last_keys: Optional[torch.Tensor] = None  # (B, KV, T, D) last layer's keys, RoPE applied
    last_values: Optional[torch.Tensor] = None  # (B, KV, T, D)
    final_hidden: Optional[torch.Tensor] = None  # (B, T, H) after the final norm
    token_embeds: Optional[torch.Tensor] = None  # (N, H) embeddings of request.token_embeddings


class _DeepEnough(Exception):
    """Raised by the recorder once the deepest requested layer input is seen: the rest of the
    decoder stack is not run."""


def _is_zero3_partitioned(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def record_layer_inputs(base_model: nn.Module, layers: Sequence[int],
                        stop_at_deepest: bool = False) -> Iterator[Dict[int, torch.Tensor]]:
    """While active, every forward of `base_model` records the hidden state entering each of
    `layers` (id L: entering the final norm) into the yielded dict.

    stop_at_deepest: abandon the forward right after the deepest one is recorded (the caller
    catches `_DeepEnough` via `capture`). Under ZeRO-3 the whole stack always runs: abandoning a
    forward would leave a layer's gathered parameters behind.
    """
    recorded: Dict[int, torch.Tensor] = {}
    num_layers = len(base_model.layers)
    stop = stop_at_deepest and not _is_zero3_partitioned(base_model)
    deepest = max(layers) if layers else None
    handles = []

    def make_hook(layer_id: int):
        def hook(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            recorded[layer_id] = hidden
            if stop and layer_id == deepest:
                raise _DeepEnough()
        return hook

    for layer_id in layers:
        module = base_model.norm if layer_id == num_layers else base_model.layers[layer_id]
        handles.append(module.register_forward_pre_hook(make_hook(layer_id), with_kwargs=True))
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture(base_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
            request: CaptureRequest, attention_mask: Optional[torch.Tensor] = None) -> TargetFeatures:
    """One target pass over (B, T) tokens, only as deep as `request` needs -> TargetFeatures."""
    embeds = base_model.embed_tokens(input_ids)
    cos, sin = base_model.rotary_emb(embeds, position_ids)
    num_layers = len(base_model.layers)
    whole = request.needs_whole_stack(num_layers)
    features = TargetFeatures(input_embeds=embeds, cos=cos, sin=sin, hidden={})
    if request.token_embeddings:  # a module call, so ZeRO-3 gathers the table as for `embeds`
        ids = torch.tensor(request.token_embeddings, dtype=torch.long, device=input_ids.device)
        features.token_embeds = base_model.embed_tokens(ids)
    if not request.layers and not whole:
        return features
    cache = DynamicCache(config=base_model.config)  # plain causal mask (see the module doc)
    with record_layer_inputs(base_model, request.layers, stop_at_deepest=not whole) as recorded:
        try:
            out = base_model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask,
                             past_key_values=cache, use_cache=True)
        except _DeepEnough:
            out = None
    features.hidden = {layer: recorded[layer] for layer in request.layers}
    if request.last_layer_kv:
        last = cache.layers[-1]
        features.last_keys, features.last_values = last.keys, last.values
    if request.final_hidden:
        features.final_hidden = out.last_hidden_state
    return features
