"""What the configuration knows of P-EAGLE without building it (no torch): its `draft.` keys (the
EAGLE-3 layer's, checked by eagle3/options.py, plus the COD sampling's) and their checks. The model
is model.py's PEagleDraft, which inherits PEagleSpec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from specdraft.drafts.eagle3.options import validate_layer_options
from specdraft.drafts.objective_options import ObjectiveOptions
from specdraft.drafts.spec import DraftSpec, option_failure, target_text_config


@dataclass
class PEagleOptions(ObjectiveOptions):
    """The `draft.` keys P-EAGLE reads: EAGLE-3's layer keys plus the COD sampling's
    (speculators' defaults: K = 8, r = 0.7, r_min = 0.2); draft.loss defaults to kl."""

    target_layers: List[int] = field(default_factory=list)  # layer inputs (vLLM ids), any order; [] = [2, L//2, L-3]
    draft_vocab_size: Optional[int] = None  # None: 32000, or the whole target vocab when smaller
    norm_before_residual: bool = False  # residual = hidden_norm(g) instead of g
    fc_norm: bool = False  # RMSNorm per captured layer before fc (EAGLE-3.1)
    norm_before_fc: bool = False  # one RMSNorm over the concatenation before fc
    lm_head: str = "own"  # own | target | target_frozen: EAGLE-3's key (eagle3/options.py)
    num_depths: int = 8  # K: tokens proposed per draft forward (depths 0..K-1)
    down_sample_ratio: float = 0.7  # r: depth d keeps a fraction max(r^d, r_min) of the valid positions
    down_sample_ratio_min: float = 0.2  # r_min
    # the token whose embedding row the deeper slots read (vLLM's pard_token); null: the target
    # config's pad_token_id, else its eos_token_id (a pad that is also eos: its unk_token_id, else
    # the last id of the vocabulary)
    mask_token_id: Optional[int] = None


class PEagleSpec(DraftSpec):
    family = "peagle"
    base_family = "eagle3"  # its folder imports eagle3/'s
    label = "P-EAGLE"
    default_loss = "kl"
    lk_loss = True
    options = PEagleOptions
    sequence_parallel = True  # slots anchored in a rank's shard, against the gathered depth-0 keys
    serving_format_names = ("speculators",)

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        fail = option_failure(source)

        if draft_cfg.num_depths < 1:
            fail("num_depths", f"must be >= 1, got {draft_cfg.num_depths}")
        if draft_cfg.num_depths + 2 > max_seq_length:
            fail("num_depths", f"must be <= max_seq_length - 2 ({max_seq_length - 2})")
        if not 0 < draft_cfg.down_sample_ratio <= 1:
            fail("down_sample_ratio", f"must be in (0, 1], got {draft_cfg.down_sample_ratio}")
        if not 0 <= draft_cfg.down_sample_ratio_min <= 1:
            fail("down_sample_ratio_min", f"must be in [0, 1], got {draft_cfg.down_sample_ratio_min}")
        validate_layer_options(draft_cfg, target_config, fail)
        if target_config is None:
            return
        text = target_text_config(target_config)
        mask = draft_cfg.mask_token_id
        if mask is not None and not 0 <= mask < text.vocab_size:
            fail("mask_token_id", f"{mask} is outside the target vocab (0..{text.vocab_size - 1})")

    @classmethod
    def sequence_parallel_reach(cls, draft_cfg):
        return "num_depths", int(draft_cfg.num_depths)  # the teacher of (a, d) is at a + d + 1
