"""What the configuration knows of EAGLE-3 without building it (no torch): its `draft.` keys and
their checks, the layer's (validate_layer_options, P-EAGLE's too) and the family's. The model is
model.py's Eagle3Draft, which inherits Eagle3Spec; the layer is layer.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from specdraft.drafts.objective_options import ObjectiveOptions
from specdraft.drafts.spec import DraftSpec, option_failure, target_text_config

AUX_LAYERS = 3  # vLLM's EAGLE-3 fc reads three target layers


@dataclass
class Eagle3Options(ObjectiveOptions):
    """The `draft.` keys EAGLE-3 reads (serving flags with speculators' defaults; draft.loss
    defaults to soft_ce against the target restricted to the draft vocab)."""

    target_layers: List[int] = field(default_factory=list)  # layer inputs (vLLM ids), any order; [] = [2, L//2, L-3]
    draft_vocab_size: Optional[int] = None  # None: 32000, or the whole target vocab when smaller
    ttt_steps: int = 7  # training-time-test unroll
    ttt_decay: float = 0.8  # weight of TTT step k: ttt_decay ** k
    norm_before_residual: bool = False  # residual = hidden_norm(g) instead of g
    fc_norm: bool = False  # RMSNorm per captured layer before fc (EAGLE-3.1)
    norm_before_fc: bool = False  # one RMSNorm over the concatenation before fc
    norm_output: bool = False  # next TTT step reads norm(out) (EAGLE-3.1)
    # the rows the teacher terms learn: in_vocab = where the target's top-1 (over its whole vocab)
    # is a draft token (EAGLE-3's and SpecForge's recipe); all = every counted row, the target
    # renormalised over the draft vocab even where its top-1 lies outside it
    teacher_rows: str = "in_vocab"
    # the draft's lm_head: own = a random start, trained; target = the target's lm_head rows of the
    # draft vocab as the start, trained; target_frozen = those rows, never trained (speculators 0.9.0)
    lm_head: str = "own"
    # recompute each TTT step's layer in the backward instead of keeping its activations
    gradient_checkpointing: bool = False


TEACHER_ROWS = ("in_vocab", "all")
LM_HEADS = ("own", "target", "target_frozen")  # the `draft.lm_head` choices (Eagle3Base.adopt_target_weights)


def validate_layer_options(draft_cfg, target_config, fail) -> None:
    """The checks of the EAGLE-3 layer's `draft.` keys (layers, vocab, norm flags); fail(key, why) raises."""
    if draft_cfg.fc_norm and draft_cfg.norm_before_fc:
        fail("fc_norm", "fc_norm and norm_before_fc exclude each other (speculators refuses both)")
    layers = list(draft_cfg.target_layers or [])
    if layers and (len(layers) != AUX_LAYERS or len(set(layers)) != AUX_LAYERS):
        fail("target_layers", f"needs {AUX_LAYERS} distinct layer ids, got {layers}")
    if draft_cfg.lm_head not in LM_HEADS:
        fail("lm_head", f"must be one of {' | '.join(LM_HEADS)}, got {draft_cfg.lm_head!r}")
    if draft_cfg.draft_vocab_size is not None and draft_cfg.draft_vocab_size < 1:
        fail("draft_vocab_size", f"must be >= 1, got {draft_cfg.draft_vocab_size}")
    if target_config is None:
        return
    text = target_text_config(target_config)
    num_layers = text.num_hidden_layers
    if num_layers + 1 < AUX_LAYERS:
        fail("type", f"EAGLE-3 reads {AUX_LAYERS} distinct target layers; the target has {num_layers}")
    for layer in layers:
        if not 0 <= layer <= num_layers:
            fail(
                "target_layers",
                f"layer {layer} is outside the target (ids 0..{num_layers}: the input "
                f"of each of its {num_layers} layers, {num_layers} = the last output)",
            )
    if draft_cfg.draft_vocab_size is not None and draft_cfg.draft_vocab_size > text.vocab_size:
        fail("draft_vocab_size", f"{draft_cfg.draft_vocab_size} is larger than the target vocab ({text.vocab_size})")


class Eagle3Spec(DraftSpec):
    family = "eagle3"
    label = "EAGLE-3"
    sequence_parallel = True
    default_loss = "soft_ce"  # EAGLE-3 learns the target's distribution over its draft vocab
    lk_loss = True
    options = Eagle3Options
    serving_format_names = ("speculators", "sglang")

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        fail = option_failure(source)

        if draft_cfg.ttt_steps < 1:
            fail("ttt_steps", f"must be >= 1, got {draft_cfg.ttt_steps}")
        if draft_cfg.ttt_steps + 2 > max_seq_length:
            fail("ttt_steps", f"must be <= max_seq_length - 2 ({max_seq_length - 2})")
        if not draft_cfg.ttt_decay > 0:
            fail("ttt_decay", f"must be > 0, got {draft_cfg.ttt_decay}")
        if draft_cfg.teacher_rows not in TEACHER_ROWS:
            fail("teacher_rows", f"must be one of {' | '.join(TEACHER_ROWS)}, got {draft_cfg.teacher_rows!r}")
        validate_layer_options(draft_cfg, target_config, fail)

    @classmethod
    def sequence_parallel_reach(cls, draft_cfg):
        return "ttt_steps", int(draft_cfg.ttt_steps)  # x_{t+1+k} and the teacher at t+1+k
