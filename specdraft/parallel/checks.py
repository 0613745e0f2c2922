"""The one-line refusals of `sequence_parallel_size` (config/validate.py asks them when a run's config loads):
the sizes that cannot split the target's sequence, and the drafts that cannot train on a shard."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple


# layer kinds whose capture runs sharded: after the head exchange each rank's core attends the whole
# sequence (parallel/sequence.py), so a window (and gpt-oss's sinks, split by head) applies as it
# does on one rank. A linear-attention layer (Qwen3-Next's Gated DeltaNet) carries a recurrent
# state from token to token that no head exchange makes whole.
SHARDED_LAYER_KINDS = ("full_attention", "sliding_attention")


def sequence_parallel_refusal(size: int, max_seq_length: int, target_config=None) -> Optional[str]:
    """Why `size` ranks cannot share each sequence, in one line naming the numbers; None if they can."""
    if size < 1:
        return f"must be >= 1, got {size}"
    if max_seq_length % size:
        return (
            f"{size} does not divide max_seq_length {max_seq_length} (each rank holds max_seq_length / {size} tokens)"
        )
    if target_config is None or size == 1:
        return None
    text = target_config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    unsharded = sorted({kind for kind in getattr(text, "layer_types", None) or () if kind not in SHARDED_LAYER_KINDS})
    if unsharded:
        return (
            f"the target has {', '.join(unsharded)} layers (layer_types): their state runs through the whole "
            f"sequence in order, so its capture is not sharded (sequence parallelism shards attention only)"
        )
    if heads % size:
        return f"{size} does not divide the target's {heads} attention heads (each rank attends with heads / {size})"
    if kv_heads % size and size % kv_heads:
        return (
            f"the target's {kv_heads} key/value heads and {size} do not divide one another (each rank reads "
            f"kv_heads / {size} of them, or one repeated)"
        )
    return None


def sequence_parallel_key_refusal(
    size: int, max_seq_length: int, target_config, family, draft_cfg, families: Dict[str, Any]
) -> Optional[Tuple[str, str]]:
    """(key, why) of the first thing that stops `size` ranks sharing each sequence of this run:
    the draft family (Draft.sequence_parallel), the sizes, then a draft key that reads further
    into the next rank than a shard holds (Draft.sequence_parallel_reach); None if nothing does."""
    if size > 1 and not family.sequence_parallel:
        able = ", ".join(name for name, cls in families.items() if cls.sequence_parallel)
        why = family.sequence_parallel_refusal or "does not train on sequence shards yet"
        return "sequence_parallel_size", f"draft.type {family.family} {why} (families that do: {able})"
    why = sequence_parallel_refusal(size, max_seq_length, target_config)
    if why:
        return "sequence_parallel_size", why
    reach = family.sequence_parallel_reach(draft_cfg) if size > 1 else None
    if reach and reach[1] > max_seq_length // size:
        return (
            f"draft.{reach[0]}",
            f"{reach[1]} reads past the next rank's tokens at sequence_parallel_size {size} "
            f"(max_seq_length / {size} = {max_seq_length // size} each)",
        )
    return None
