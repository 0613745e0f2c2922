"""Forward passes of a transformers causal LM over a position-indexed KV cache.

The cache (a transformers DynamicCache) holds one entry per token position, in order. A pass
appends its tokens; `keep_positions` then keeps the entries a round accepted (a prefix plus the
accepted tree path, compacted) — rejected entries simply disappear, and the next pass writes the
following positions again.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdraft.errors import SpecdraftError
from specdraft.target.capture import record_layer_inputs


def new_cache(model: nn.Module) -> DynamicCache:
    """The model's cache with every attention layer kept whole: a sliding-window layer's own cache
    (transformers' DynamicSlidingWindowLayer) keeps only its last window of entries, so a rejected
    draft token could not be dropped without losing the entry it pushed out. Windowed layers still
    attend only through their window: transformers' sliding mask over a whole cache, and the masks
    of tree passes (attention_masks) apply it."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def sliding_window_kinds(config) -> Tuple[Optional[int], Optional[Tuple[str, ...]]]:
    """(window, layer kinds): the target's attention window (None: no windowed layer) and, for a
    model whose layers differ (layer_types: gpt-oss, Gemma 3, Qwen2 with use_sliding_window), the
    kinds its forward takes one mask each for; None: one mask for every layer (Mistral, Phi-3)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if window is None or (kinds and "sliding_attention" not in kinds):
        return None, None
    return int(window), tuple(sorted(set(kinds))) if kinds else None


def attention_masks(model: nn.Module, visible: torch.Tensor, positions: torch.Tensor, dtype, device):
    """A tree pass's mask, as the model's forward takes it: visible (T, S) bool over the S = cache +
    T keys -> additive (1, 1, T, S) (0 / dtype min), which transformers passes through unchanged.
    A target with sliding-window layers gets the window applied too, in token positions (query at
    positions[i], key j at j for the cache, then at the queries' positions: the target's cache holds
    one entry per position, in order): the one mask of a model whose every layer is windowed, or a
    mask per layer kind ({"full_attention": ..., "sliding_attention": ...}), as those models build."""

    def additive(allowed):
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill(~allowed.to(device), torch.finfo(dtype).min)[None, None]

    window, kinds = sliding_window_kinds(model.config)
    if window is None:
        return additive(visible)
    queries = positions.to(visible.device)
    keys = torch.cat([torch.arange(visible.shape[1] - len(queries), device=visible.device), queries])
    windowed = visible & (queries[:, None] - keys[None, :] < window)  # transformers: kv > q - window
    if kinds is None:
        return additive(windowed)
    return {kind: additive(windowed if kind == "sliding_attention" else visible) for kind in kinds}


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def append_kv(past: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    """Keys or values (R, KV, S, D) with new entries (R, KV, N, D) after them: new when none yet."""
    return new if past is None else torch.cat([past, new], dim=2)


class DraftCache:
    """A drafter's own cache over the verified positions (EAGLE-3's, MTP's): `states` (P, H), what
    the target handed over for positions 0..P-1, and the draft's keys / values (1, KV, fed, D) of
    indices < fed. Drafted entries live in round-local tensors only, so a rejection cuts both back
    to the accepted length and nothing else."""

    def __init__(self):
        self.states: Optional[torch.Tensor] = None
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.fed = 0

    def observe(self, states: torch.Tensor, start: int) -> None:
        """The target's states (T, H) of positions start..start+T-1, replacing any from start on."""
        kept = self.states[:start] if self.states is not None else states[:0]
        self.states = torch.cat([kept, states])

    def rollback(self, length: int) -> None:
        if self.states is not None:
            self.states = self.states[:length]
        self.crop(length)

    def crop(self, length: int) -> None:
        if self.fed > length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
            self.fed = length

    def catch_up(self, n: int, device) -> Tuple[int, torch.Tensor]:
        """Before feeding indices fed..n-1: (the first, visible (count, n) bool: every earlier index
        and causal among the new). Index n-1 is fed again if it was already (a second proposal
        this round)."""
        self.crop(n - 1)
        start = self.fed
        count = n - start
        visible = torch.cat(
            [
                torch.ones(count, start, dtype=torch.bool, device=device),
                torch.ones(count, count, dtype=torch.bool, device=device).tril(),
            ],
            dim=1,
        )
        return start, visible

    def fed_up_to(self, n: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Indices < n fed: their keys and values (1, KV, n, D)."""
        self.keys, self.values, self.fed = keys, values, n


def last_layer_kv(cache: DynamicCache) -> Tuple[torch.Tensor, torch.Tensor]:
    """The last layer's (keys, values), each (B, KV, T, D); keys have RoPE applied."""
    layer = cache.layers[-1]
    return layer.keys, layer.values


def keep_positions(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the cache entries at `keep` (ascending positions), in that order, in every layer."""
    prefix = bool((keep == torch.arange(len(keep))).all())  # a plain crop: slice, no copy
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise SpecdraftError(
                "the target uses sliding-window attention layers; speculative "
                "decoding here needs full-attention KV caches"
            )
        if hasattr(layer, "recurrent_states"):  # transformers' LinearAttentionLayer (Qwen3-Next's Gated DeltaNet)
            raise SpecdraftError(
                "the target has linear-attention layers (layer_types), whose recurrent state "
                "cannot be rolled back after a rejected draft token; speculative decoding here "
                "needs full-attention KV caches"
            )
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if prefix:
            layer.keys, layer.values = layer.keys[..., : len(keep), :], layer.values[..., : len(keep), :]
        else:
            index = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


def crop(cache: DynamicCache, length: int) -> None:
    """Forget every entry at position >= length."""
    if cache_length(cache) > length:
        keep_positions(cache, torch.arange(length))


@torch.no_grad()
def forward(
    model: nn.Module,
    cache: DynamicCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    visible: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Append ids (T,) at `positions` (T,) to the cache; return their logits (T, V)."""
    return forward_with_hidden(model, cache, ids, positions, visible)[0]


@torch.no_grad()
def forward_with_hidden(
    model: nn.Module,
    cache: DynamicCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    visible: Optional[torch.Tensor] = None,
    layers: Sequence[int] = (),
) -> Tuple[torch.Tensor, Dict[int, torch.Tensor]]:
    """forward(), plus the hidden states {layer: (T, H)} entering each of `layers` (a drafter's
    target_layers, vLLM's convention) for the same tokens.

    visible (T, cache_length + T) bool replaces causal attention (tree passes); None = causal.
    transformers passes a 4D mask through unchanged, so it is given additive (0 / dtype min),
    which both its sdpa and eager attention accept (attention_masks: with the target's window).
    """
    weight = model.get_input_embeddings().weight  # a parameter, or a buffer when held outside ZeRO-3
    mask = None
    if visible is not None:  # (1, 1, T, cache_length + T), or one per layer kind of a windowed target
        mask = attention_masks(model, visible, positions, weight.dtype, weight.device)
    with record_layer_inputs(model.model, layers) as hidden:
        out = model(
            input_ids=ids[None].to(weight.device),
            position_ids=positions[None].to(weight.device),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits[0].float(), {layer: h[0] for layer, h in hidden.items()}
