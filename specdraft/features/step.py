"""A micro-batch's TargetFeatures from cached tensors: what `capture` would have returned, with
the target's layers replaced by the cache and the rest (embeddings, rotary tables, the MASK
token's embedding) computed by the target's light parts (target/light.py)."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from specdraft.parallel.sequence import SequenceShard
from specdraft.target.capture import CaptureRequest, TargetFeatures, rotary_tables


def cached_target_features(
    base_model: nn.Module,
    target_config,
    request: CaptureRequest,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cached: Dict[str, torch.Tensor],
    shard: Optional[SequenceShard] = None,
) -> TargetFeatures:
    """input_ids / position_ids (B, T) whole on every rank of a sequence-parallel group, cached
    kind -> (B, T, ...) whole too: this rank's T/N tokens of each come back, as capture's do."""
    shard = shard or SequenceShard.whole(input_ids.shape[1])
    input_ids, position_ids = shard.local(input_ids), shard.local(position_ids.expand(input_ids.shape[0], -1))
    embeds = base_model.embed_tokens(input_ids)
    rotary = rotary_tables(base_model, target_config.get_text_config())
    cos, sin = rotary(embeds, position_ids)
    features = TargetFeatures(
        input_embeds=embeds,
        cos=cos,
        sin=sin,
        hidden={layer: shard.local(cached[f"hidden.{layer}"]).to(embeds.dtype) for layer in request.layers},
        position_ids=position_ids,
        rotary=lambda positions: rotary(embeds, positions),
        shard=shard if shard.parallel else None,
    )
    if request.final_hidden:
        features.final_hidden = shard.local(cached["final_hidden"]).to(embeds.dtype)
    if request.last_layer_kv:  # stored (B, T, KV, D): capture's are (B, KV, T, D)
        features.last_keys = shard.local(cached["last_keys"]).transpose(1, 2).to(embeds.dtype)
        features.last_values = shard.local(cached["last_values"]).transpose(1, 2).to(embeds.dtype)
    if request.token_embeddings:
        ids = torch.stack([input_ids.new_full((), token) for token in request.token_embeddings])
        features.token_embeds = base_model.embed_tokens(ids)
    return features


def features_to_store(features: TargetFeatures, kinds) -> Dict[str, torch.Tensor]:
    """kind -> (B, T, ...) of a live capture, in the layout a cache stores (capture and hybrid)."""
    out = {}
    for kind in kinds:
        if kind.startswith("hidden."):
            out[kind] = features.hidden[int(kind.split(".")[1])]
        elif kind == "final_hidden":
            out[kind] = features.final_hidden
        else:
            out[kind] = (features.last_keys if kind == "last_keys" else features.last_values).transpose(1, 2)
    return out
