"""What the configuration knows of GLIDE without building it (no torch): its `draft.` keys, its
checks of them and of the target, and how its keys identify a checkpoint. The model is model.py's
GlideDraft, which inherits GlideSpec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specdraft.drafts.objective_options import ObjectiveOptions
from specdraft.drafts.spec import DraftSpec, option_failure, target_text_config


@dataclass
class GlideOptions(ObjectiveOptions):
    """The `draft.` keys GLIDE reads (and draft.loss / draft.distill_temperature)."""

    sliding_window: int = 512  # draft self-attention sees at most this many past positions
    max_lag: int = 4  # per batch a lag p in [1, max_lag]: query t sees target K/V at <= t - p
    final_norm: bool = False  # LongSpec feeds the draft output straight into lm_head
    anchor_offset: bool = False  # Anchor-Offset position ids (long-context from short samples)
    max_sink_tokens: int = 4  # anchor positions kept at 0..s-1, s in [0, max_sink_tokens]
    max_position_offset: int = 30000  # the rest shifted by a random offset up to this
    # q/k/v biases in both attentions (Qwen2's layers have them, and so do LongSpec's Qwen2 drafts);
    # None: the target's own (its config's attention_bias, or model_type qwen2)
    attention_bias: Optional[bool] = None


class GlideSpec(DraftSpec):
    family = "glide"
    label = "GLIDE"
    sequence_parallel = True
    options = GlideOptions
    serving_format_names = ("longspec",)

    @classmethod
    def moves_target_positions(cls, draft_cfg) -> bool:
        return bool(draft_cfg.get("anchor_offset"))  # Anchor-Offset: the target reads shifted positions

    @classmethod
    def identity_options(cls, options, target_config):
        # attention_bias came after GLIDE checkpoints existed, all of them without biases: resolved
        # against the target, a draft without biases hashes as before the key (and resumes them);
        # one with biases (a Qwen2 target's default) does not pass for one of those
        options = dict(options)
        bias = options.pop("attention_bias", None)
        if bias is None and target_config is None:  # not readable yet: the key at its default
            return options
        if resolved_attention_bias(bias, target_config):
            options["attention_bias"] = True
        return options

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        fail = option_failure(source)
        for key in ("sliding_window", "max_lag"):
            if draft_cfg[key] < 1:
                fail(key, f"must be >= 1, got {draft_cfg[key]}")
        if draft_cfg.max_lag >= max_seq_length:
            fail("max_lag", f"must be < max_seq_length ({max_seq_length})")
        why = target_refusal(target_config) if target_config is not None else None
        if why:
            fail("type", why)


def target_refusal(target_config) -> Optional[str]:
    """Why GLIDE cannot draft for this target, in one line; None when it can. Its cross-attention
    reads the keys/values the target's last layer attends with, with queries of the same head width
    rotated as the target rotated those keys (rope)."""
    text = target_text_config(target_config)
    if getattr(text, "kv_lora_rank", None):  # MLA (DeepSeek-V2/V3, Kimi-K2)
        qk = text.qk_nope_head_dim + text.qk_rope_head_dim
        return (
            f"GLIDE's cross-attention takes keys and values of one head width (head_dim "
            f"{text.head_dim}), RoPE over the whole head; {text.model_type} attends with MLA: per head keys "
            f"of {qk} ({text.qk_nope_head_dim} without RoPE + {text.qk_rope_head_dim} with interleaved RoPE) "
            f"and values of {text.v_head_dim}, decompressed from a cached latent of {text.kv_lora_rank}, "
            f"which it cannot take"
        )
    return None


def resolved_attention_bias(value: Optional[bool], target_config) -> bool:
    """draft.attention_bias as the draft is built: None follows the target."""
    return target_attention_bias(target_config) if value is None else bool(value)


def target_attention_bias(target_config) -> bool:
    """Whether the target's attention has q/k/v biases: its config's attention_bias (Llama, Qwen3),
    or a Qwen2-family target (biases without a config key)."""
    text = target_text_config(target_config)
    return bool(getattr(text, "attention_bias", False)) or str(getattr(text, "model_type", "")).startswith("qwen2")
