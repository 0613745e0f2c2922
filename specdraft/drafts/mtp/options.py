"""What the configuration knows of MTP without building it: its `draft.` keys and their checks (a
target with a config is checked for an MTP layer by export.py, which the target's config already
brought torch for). The model is model.py's MTPDraft, which inherits MTPSpec."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.drafts.spec import DraftSpec, option_failure


@dataclass
class MTPOptions:
    """The `draft.` keys MTP reads (speculators' names and defaults)."""

    num_speculative_steps: int = 3  # recursive steps trained (and the chain drafted by default)
    step_weight_beta: float = 0.6  # step k's loss weight beta^k / sum_j beta^j (FastMTP, eq. 2)
    # recompute each step's layer in the backward instead of keeping its activations
    gradient_checkpointing: bool = False


class MTPSpec(DraftSpec):
    family = "mtp"
    label = "MTP"
    options = MTPOptions
    default_loss = "ce"
    serving_format_names = ("speculators", "stitched")

    # Qwen3-Next's capture cannot be sharded: Gated DeltaNet's recurrence runs through the whole
    # sequence (no head exchange makes it whole), so the layer's input h_t never exists per shard;
    # and the layer is transformers' decoder layer class, whose attention exchanges no heads
    sequence_parallel_refusal = (
        "does not train on sequence shards: its layer is the target's own decoder layer "
        "class (no head exchange), and Qwen3-Next's linear-attention layers do not run "
        "in the sharded capture"
    )

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        fail = option_failure(source)

        steps = int(draft_cfg.num_speculative_steps)
        if steps < 1:
            fail("num_speculative_steps", f"must be >= 1, got {steps}")
        if steps + 2 > max_seq_length:
            fail("num_speculative_steps", f"must be <= max_seq_length - 2 ({max_seq_length - 2})")
        if not float(draft_cfg.step_weight_beta) > 0:
            fail("step_weight_beta", f"must be > 0, got {draft_cfg.step_weight_beta}")
        if target_config is not None:  # the target's weight files: read by export.py's helpers
            from specdraft.drafts.mtp.export import refuse_target_without_mtp

            refuse_target_without_mtp(target_config, source)
