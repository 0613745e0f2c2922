"""What a draft reads from the frozen target, and the one pass that produces exactly that.

    request = draft.capture_request()        # CaptureRequest(layers=(2, 16, 29), final_hidden=True)
    features = capture(base_model, input_ids, position_ids, request)

Layer ids follow vLLM / speculators: id i is the hidden state at the INPUT of decoder layer i
(the residual stream after layers 0..i-1); id L (the layer count) is the output of the last layer,
before the final norm.

Only what is asked for is computed and kept: the pass stops right after the deepest layer input
asked for, or right after the last layer has made its K/V (its attention, MLP and the final norm
then never run); K/V are kept for the last layer only, never a cache of every layer.

Attention builds no mask: transformers' own mask (B, 1, T, T) for packed documents is quadratic in
T (4.3 GB at 64k). The layers run our attention function (CORE_ATTENTION) instead, which calls a
core handed in per pass: causal attention inside each document (drafts/documents.py: slices on CPU,
flex block masks on CUDA) or plain causal SDPA. Nor is anything inferred from position_ids (without
a mask transformers reads jumps in them as borders; Anchor-Offset positions jump on purpose).
Under sequence parallelism (`shard`) each rank embeds and runs its own T/N tokens and the core sees
the whole sequence with h/N heads (parallel/sequence.py): every feature comes back per shard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

from specdraft.parallel.sequence import SequenceShard


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
        """The final norm's input or output is asked for: every layer runs to its end."""
        return self.final_hidden or num_layers in self.layers


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
    position_ids: Optional[torch.Tensor] = None  # (B, T) the positions cos/sin are at
    shard: Optional[SequenceShard] = None  # sequence parallelism: every (B, T, ...) above is this rank's T/N
    rotary: Optional[Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]] = None  # the target's RoPE
    #   at any position ids (B, N) -> cos, sin (B, N, D): for positions no input token has (DFlash's blocks)


class _DeepEnough(Exception):
    """Raised once everything requested exists (the deepest layer input, or the last layer's
    K/V): the rest of the decoder stack is not run."""


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


class _LastLayerKV(DynamicCache):
    """A cache that keeps only the last decoder layer's K/V (RoPE applied: what that layer attends
    with) and hands every other layer's K/V straight back, stored nowhere.

    stop: raise _DeepEnough once they are stored, so the last layer's attention, its MLP and the
    final norm never run.
    """

    def __init__(self, config, last_layer: int, stop: bool):
        super().__init__(config=config)
        self.last_layer = last_layer
        self.stop = stop
        self.keys: Optional[torch.Tensor] = None  # (B, KV, T, D)
        self.values: Optional[torch.Tensor] = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == self.last_layer:
            self.keys, self.values = key_states, value_states
            if self.stop:
                raise _DeepEnough()
        return key_states, value_states


CORE_ATTENTION = "specdraft_core"  # the attention function the target runs while capturing

# core(q (B, h, T, D), k, v (B, kv, T, D), scale) -> (B, h, T, D): causal over the whole sequence
CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float]], torch.Tensor]


def causal_attention(q, k, v, scale=None):
    """One document per row: plain causal SDPA (its fast kernels, no mask)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _core_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    specdraft_core: Optional[CoreAttention] = None, specdraft_shard: Optional[SequenceShard] = None,
                    **_):
    """transformers' attention-function signature: (B, h, T/N, D) inputs -> (B, T/N, h, D), None."""
    shard = specdraft_shard or SequenceShard.whole(query.shape[2])
    if sliding_window is not None and sliding_window < query.shape[2] * shard.size:
        raise NotImplementedError("capture: sliding-window target layers are not supported")
    out = shard.attention(specdraft_core, query, key, value, scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(CORE_ATTENTION, _core_attention)


@contextlib.contextmanager
def core_attention_implementation(base_model: nn.Module) -> Iterator[None]:
    """While active, the target's layers call CORE_ATTENTION (transformers reads the name at call time)."""
    config = base_model.config
    before = config._attn_implementation
    config._attn_implementation = CORE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.no_grad()
def capture(base_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
            request: CaptureRequest, attention: Optional[CoreAttention] = None,
            shard: Optional[SequenceShard] = None) -> TargetFeatures:
    """One target pass over (B, T) tokens, only as deep as `request` needs -> TargetFeatures.

    attention: the core every layer attends with (None: one document per row, causal_attention).
    shard: sequence parallelism; input_ids / position_ids are the whole (B, T) on every rank of
    the group, the features this rank's T/N tokens."""
    shard = shard or SequenceShard.whole(input_ids.shape[1])
    input_ids, position_ids = shard.local(input_ids), shard.local(position_ids.expand(input_ids.shape[0], -1))
    embeds = base_model.embed_tokens(input_ids)
    cos, sin = base_model.rotary_emb(embeds, position_ids)
    num_layers = len(base_model.layers)
    whole = request.needs_whole_stack(num_layers)
    features = TargetFeatures(input_embeds=embeds, cos=cos, sin=sin, hidden={}, position_ids=position_ids,
                              rotary=lambda positions: base_model.rotary_emb(embeds, positions),
                              shard=shard if shard.parallel else None)
    if request.token_embeddings:  # a module call, so ZeRO-3 gathers the table as for `embeds`
        # filled on the device (a tensor of a Python list would be a host-to-device copy per batch)
        ids = torch.stack([input_ids.new_full((), token) for token in request.token_embeddings])
        features.token_embeds = base_model.embed_tokens(ids)
    if not request.layers and not whole and not request.last_layer_kv:
        return features
    # Under ZeRO-3 (target partitioned) the whole stack always runs: abandoning a forward would
    # leave a layer's gathered parameters behind.
    may_stop = not whole and not _is_zero3_partitioned(base_model)
    # The last layer's K/V are its deepest need unless a layer input is asked for after them.
    kv_is_deepest = request.last_layer_kv and not any(layer >= num_layers for layer in request.layers)
    cache = _LastLayerKV(base_model.config, num_layers - 1, stop=may_stop and kv_is_deepest) \
        if request.last_layer_kv else None
    stop_at_layer = may_stop and not request.last_layer_kv
    # a dict of masks: transformers builds none; the layers read none
    layer_types = getattr(base_model.config, "layer_types", None) or ()
    no_masks = dict.fromkeys({"full_attention", "sliding_attention", *layer_types})
    with record_layer_inputs(base_model, request.layers, stop_at_deepest=stop_at_layer) as recorded, \
            core_attention_implementation(base_model):
        try:
            out = base_model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=no_masks,
                             past_key_values=cache, use_cache=cache is not None,
                             specdraft_core=attention or causal_attention, specdraft_shard=shard)
        except _DeepEnough:
            out = None
    features.hidden = {layer: recorded[layer] for layer in request.layers}
    if request.last_layer_kv:
        features.last_keys, features.last_values = cache.keys, cache.values
    if request.final_hidden:
        features.final_hidden = out.last_hidden_state
    return features
