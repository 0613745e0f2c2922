"""What the configuration knows of DSpark without building it (no torch): DFlash's backbone keys
plus its heads' (DSparkOptions), and their checks. The model is model.py's DSparkDraft, which
inherits DSparkSpec."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.drafts.spec import option_failure
from specdraft.drafts.dflash.options import DFlashBackboneSpec, DFlashOptions

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # speculators' markov_head_type values
DEFAULT_LOSS = "0.9*tv + 0.1*ce"  # DeepSpec's recipe


@dataclass
class DSparkOptions(DFlashOptions):
    """The `draft.` keys DSpark reads: DFlash's plus its heads' (draft.loss defaults to 0.9 tv + 0.1 ce)."""

    markov_rank: int = 256  # rank of the Markov bias markov_w2(markov_w1[previous token])
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (speculators' variants)
    confidence_with_markov: bool = True  # the confidence head also reads the previous token's markov_w1 row
    confidence_loss_weight: float = 1.0  # weight of the confidence BCE (speculators' confidence_head_alpha)
    # the confidence target: 1 - TV(target, draft) at this temperature; 0: argmax agreement (greedy)
    confidence_temperature: float = 1.0
    confidence_threshold: float = 0.0  # decoding's default: stop a block at the first slot below it


class DSparkSpec(DFlashBackboneSpec):
    family = "dspark"
    base_family = "dflash"  # its folder imports dflash/'s
    label = "DSpark"
    options = DSparkOptions
    default_loss = DEFAULT_LOSS
    # every slot predicts, the anchor's too (block_size tokens a block): speculators' DSpark default
    # (speculators/models/dspark/config.py, "DeepSeek/DeepSpec convention"). Measured on the tiny
    # target, 32,768 tokens, greedy chain on 8 prompts: tau 1.130 with false, 2.121 with true
    default_sample_from_anchor = True

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        super().validate_config(draft_cfg, target_config, source, max_seq_length)
        check_dspark_options(draft_cfg, source)


def check_dspark_options(draft_cfg, source: str) -> None:
    fail = option_failure(source)

    if int(draft_cfg.markov_rank) <= 0:
        fail("markov_rank", f"must be > 0, got {draft_cfg.markov_rank}")
    if draft_cfg.markov_head_type not in MARKOV_HEAD_TYPES:
        fail("markov_head_type", f"must be one of {', '.join(MARKOV_HEAD_TYPES)}, got {draft_cfg.markov_head_type!r}")
    if not 0.0 <= float(draft_cfg.confidence_threshold) <= 1.0:
        fail("confidence_threshold", f"must be in [0, 1], got {draft_cfg.confidence_threshold}")
    if not float(draft_cfg.confidence_temperature) >= 0:
        fail("confidence_temperature", f"must be >= 0 (0: greedy), got {draft_cfg.confidence_temperature}")
    if not float(draft_cfg.confidence_loss_weight) >= 0:
        fail("confidence_loss_weight", f"must be >= 0, got {draft_cfg.confidence_loss_weight}")
