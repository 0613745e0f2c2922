"""The target's rotary position embedding as the draft families read it.

Three ways a family uses RoPE:

- GLIDE rotates its queries with the target's tables (target/capture.rotary_tables: the last
  layer's, gpt-oss's at head width), since its cross-attention queries meet the keys the target
  rotated; partial rotary (GLM-4.5, Qwen3-Next) it applies as the target does (glide/model.rope).
- DFlash and DSpark rotate their own layers' queries and keys with the target's one table over
  whole heads; their servers rebuild that RoPE from the exported transformer_layer_config (the
  target's config). A target that rotates only part of each head (partial_rotary_factor < 1) or
  whose layers use different tables (Gemma 3: local and global RoPE) has no such table:
  rotary_refusal says so, in one line. DeepSeek-V3's table covers qk_rope_head_dim, the config's
  head_dim and so the draft's.
- EAGLE-3 and P-EAGLE build their own rotary embedding (a Llama one, its parameters written into
  their exports' transformer_layer_config): draft_rope_parameters picks what it is built from.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

# the layer kinds of a per-layer-type rope_parameters (Gemma 3: {"sliding_attention": ..., "full_attention": ...})
LAYER_KINDS = ("full_attention", "sliding_attention")


def _text(target_config):
    return target_config.get_text_config()


def per_layer_rope(target_config) -> Optional[Dict[str, Any]]:
    """{layer kind: its rope parameters} when the target's layers use different rotary tables."""
    rope = getattr(_text(target_config), "rope_parameters", None) or {}
    nested = {kind: params for kind, params in rope.items() if kind in LAYER_KINDS and isinstance(params, dict)}
    return nested or None


def partial_rotary_factor(target_config) -> float:
    """The fraction of each head the target rotates (transformers reads it from rope_parameters)."""
    text = _text(target_config)
    rope = getattr(text, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None) or 1.0))


def rotary_refusal(target_config) -> Optional[str]:
    """Why a family applying the target's rotary tables to its own whole heads cannot use this
    target's as they are (the end of a sentence "the target ..."); None when it can."""
    text = _text(target_config)
    nested = per_layer_rope(target_config)
    if nested:
        thetas = ", ".join(f"{kind} {params.get('rope_theta')}" for kind, params in sorted(nested.items()))
        return f"rotates its layers with {len(nested)} rotary tables ({text.model_type}: rope_theta {thetas}), not one"
    factor = partial_rotary_factor(target_config)
    if factor < 1.0:
        return (
            f"rotates only part of each head ({text.model_type}: partial_rotary_factor {factor:g}), its "
            f"tables cover {factor:g} of the head"
        )
    return None


def draft_rope_parameters(target_config) -> Dict[str, Any]:
    """What a draft's own (Llama) rotary embedding is built from, as its export writes it: the
    target's rope_parameters, rotating the draft's whole head (a partial_rotary_factor is the
    target's layers' business: a server reading it would rotate part of the draft's head, which
    training did not), and for a target with a table per layer kind (Gemma 3) its local layers',
    as speculators flattens such a config for a draft's rotary embedding
    (src/speculators/models/utils.py, flatten_rope_parameters: the "sliding_attention" variant)."""
    text = _text(target_config)
    nested = per_layer_rope(target_config)
    rope = dict(
        nested.get("sliding_attention", next(iter(nested.values())))
        if nested
        else getattr(text, "rope_parameters", None)
        or {"rope_type": "default", "rope_theta": getattr(text, "rope_theta", 10000.0)}
    )
    rope.pop("partial_rotary_factor", None)
    return rope
