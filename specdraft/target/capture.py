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
core handed in per pass (target/attention.py): causal attention inside each document (slices on CPU,
flex block masks on CUDA) or plain causal SDPA, with each layer's own rule as transformers hands it
to the attention function: its sliding window (`sliding_window`: Mistral's every layer, the
`sliding_attention` layers of layer_types in Qwen2/Qwen3 with use_sliding_window, gpt-oss, Gemma 3),
its attention sinks (gpt-oss's `s_aux`), its soft-cap (`softcap`), its scaling (Gemma 3's
query_pre_attn_scalar, DeepSeek's mscale). Nor is anything inferred from position_ids (without
a mask transformers reads jumps in them as borders; Anchor-Offset positions jump on purpose).

The last layer's K/V are those its attention function receives: RoPE applied, (B, KV, T, D) for
grouped-query attention; for MLA (DeepSeek-V3) the decompressed per-head keys (qk_nope + qk_rope
dims) and values (v_head_dim), not the compressed latent its cache stores.
Under sequence parallelism (`shard`) each rank embeds and runs its own T/N tokens and the core sees
the whole sequence with h/N heads (parallel/sequence.py): every feature comes back per shard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn
from transformers import AttentionInterface

from specdraft.errors import SpecdraftError
from specdraft.parallel.sequence import SequenceShard
from specdraft.target.attention import causal_attention


@dataclass(frozen=True)
class CaptureRequest:
    layers: Tuple[int, ...] = ()  # hidden states at the input of these decoder layers
    last_layer_kv: bool = False  # the last decoder layer's K/V, RoPE applied
    final_hidden: bool = False  # final-norm output: what the target's lm_head reads
    token_embeddings: Tuple[int, ...] = ()  # input embeddings of these token ids (DFlash's MASK)

    def merged(self, other: "CaptureRequest") -> "CaptureRequest":
        return CaptureRequest(
            layers=tuple(sorted(set(self.layers) | set(other.layers))),
            last_layer_kv=self.last_layer_kv or other.last_layer_kv,
            final_hidden=self.final_hidden or other.final_hidden,
            token_embeddings=tuple(dict.fromkeys(self.token_embeddings + other.token_embeddings)),
        )

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
def record_layer_inputs(
    base_model: nn.Module, layers: Sequence[int], stop_at_deepest: bool = False
) -> Iterator[Dict[int, torch.Tensor]]:
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


class _LastLayerKV:
    """Keeps only the last decoder layer's K/V as its attention function receives them (RoPE
    applied; MLA's decompressed ones) and hands every other layer's K/V straight back, stored
    nowhere. Not a cache: transformers' caches store what a layer re-reads (MLA: the latent).

    stop: raise _DeepEnough once they are stored, so the last layer's attention, its MLP and the
    final norm never run.
    """

    def __init__(self, last_layer: int, stop: bool):
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

# core(q (B, h, T, D), k, v (B, kv, T, D), scale, window=None, sinks=None, softcap=None) -> (B, h, T, D):
# causal over the whole sequence; window / sinks (h,) / softcap: the layer's own (attention.target_attention)
CoreAttention = Callable[..., torch.Tensor]


def _core_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    specdraft_core: Optional[CoreAttention] = None,
    specdraft_shard: Optional[SequenceShard] = None,
    specdraft_kv: Optional[_LastLayerKV] = None,
    **_,
):
    """transformers' attention-function signature: (B, h, T/N, D) inputs -> (B, T/N, h, D), None.
    sliding_window / softcap / s_aux (the sinks): what the layer hands its attention function."""
    if not getattr(module, "is_causal", True):  # Gemma 3 with use_bidirectional_attention
        raise SpecdraftError(
            f"capture: {type(module).__name__} attends bidirectionally (use_bidirectional_attention); "
            f"a draft's target is causal"
        )
    if specdraft_kv is not None:
        specdraft_kv.update(key, value, getattr(module, "layer_idx", None))
    shard = specdraft_shard or SequenceShard.whole(query.shape[2])
    sinks = s_aux
    if sinks is not None and shard.parallel:  # the core holds this rank's h/N heads (SequenceShard.to_heads)
        sinks = sinks.view(shard.size, -1)[shard.rank]
    extras = {
        name: setting
        for name, setting in (("window", sliding_window), ("sinks", sinks), ("softcap", softcap))
        if setting is not None
    }
    out = shard.attention(specdraft_core, query, key, value, scaling, **extras)
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


def rotary_tables(
    base_model: nn.Module, config=None
) -> Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]:
    """(x, position_ids (B, N)) -> the target's cos, sin (B, N, D) in the rotate-half layout a
    draft's apply_rope reads (x: the dtype and device). Where the target's rotary_emb differs:
    - a table per layer kind (Gemma 3: local and global bases; rotary_emb(x, positions, kind)): the
      last layer's kind, the RoPE its K/V carry;
    - gpt-oss: its tables are half width (its _apply_rotary_emb rotates the two halves with the
      same frequencies): repeated to the head width, which is rotate-half exactly.
    Otherwise rotary_emb's own: DeepSeek-V3 (qk_rope_head_dim, interleaved with rope_interleave)
    and partial rotary (GLM-4.5, Qwen3-Next: head_dim x partial_rotary_factor) come back as narrow
    as the target applies them.
    config: the target's text config where base_model has none of its layers (target/light.py)."""
    import inspect

    rotary_emb = base_model.rotary_emb
    num_layers = len(base_model.layers) if config is None else config.num_hidden_layers
    config = base_model.config if config is None else config
    if "layer_type" in inspect.signature(rotary_emb.forward).parameters:
        kind = config.layer_types[num_layers - 1]
        return lambda x, positions: rotary_emb(x, positions, kind)
    if config.model_type == "gpt_oss":

        def doubled(x, positions):
            cos, sin = rotary_emb(x, positions)
            return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

        return doubled
    return rotary_emb


@torch.no_grad()
def capture(
    base_model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    request: CaptureRequest,
    attention: Optional[CoreAttention] = None,
    shard: Optional[SequenceShard] = None,
) -> TargetFeatures:
    """One target pass over (B, T) tokens, only as deep as `request` needs -> TargetFeatures.

    attention: the core every layer attends with (None: one document per row, causal_attention).
    shard: sequence parallelism; input_ids / position_ids are the whole (B, T) on every rank of
    the group, the features this rank's T/N tokens."""
    shard = shard or SequenceShard.whole(input_ids.shape[1])
    input_ids, position_ids = shard.local(input_ids), shard.local(position_ids.expand(input_ids.shape[0], -1))
    embeds = base_model.embed_tokens(input_ids)
    rotary = rotary_tables(base_model)
    cos, sin = rotary(embeds, position_ids)
    num_layers = len(base_model.layers)
    whole = request.needs_whole_stack(num_layers)
    features = TargetFeatures(
        input_embeds=embeds,
        cos=cos,
        sin=sin,
        hidden={},
        position_ids=position_ids,
        rotary=lambda positions: rotary(embeds, positions),
        shard=shard if shard.parallel else None,
    )
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
    kv = _LastLayerKV(num_layers - 1, stop=may_stop and kv_is_deepest) if request.last_layer_kv else None
    stop_at_layer = may_stop and not request.last_layer_kv
    # a dict of masks: transformers builds none; the layers read none
    layer_types = getattr(base_model.config, "layer_types", None) or ()
    no_masks = dict.fromkeys({"full_attention", "sliding_attention", *layer_types})
    with (
        record_layer_inputs(base_model, request.layers, stop_at_deepest=stop_at_layer) as recorded,
        core_attention_implementation(base_model),
    ):
        try:
            out = base_model(
                inputs_embeds=embeds,
                position_ids=position_ids,
                attention_mask=no_masks,
                use_cache=False,
                specdraft_core=attention or causal_attention,
                specdraft_shard=shard,
                specdraft_kv=kv,
            )
        except _DeepEnough:
            out = None
    features.hidden = {layer: recorded[layer] for layer in request.layers}
    if request.last_layer_kv:
        features.last_keys, features.last_values = kv.keys, kv.values
    if request.final_hidden:
        features.final_hidden = out.last_hidden_state
    return features
