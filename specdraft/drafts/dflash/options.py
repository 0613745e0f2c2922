"""The keys and shapes of DFlash's block backbone (drafts/dflash/model.py), shared by DFlash and
DSpark: the `draft.` options a config sets and their checks (DFlashBackboneSpec, which the backbone
inherits; DFlashSpec, the family), the block layout, the dimensions a draft is built and exported
with, and the default choice of target layers. No torch: the configuration reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from specdraft.drafts.objective_options import CE, ObjectiveOptions, objective_from_options
from specdraft.drafts.spec import DraftSpec, LayerDims, option_failure, target_text_config
from specdraft.target.rotary import rotary_refusal

DEFAULT_NUM_TARGET_LAYERS = 5
LOSS_WEIGHTINGS = ("decay", "dpace")


@dataclass(frozen=True)
class BlockLayout:
    """Which slot of a block predicts which token (speculators' `sample_from_anchor`)."""

    block_size: int  # slots per block, the anchor's included
    sample_from_anchor: bool  # does the anchor slot predict (the token after the anchor)?

    @property
    def first_slot(self) -> int:  # the slot predicting the token at anchor + 1
        return 0 if self.sample_from_anchor else 1

    @property
    def predictions(self) -> int:  # tokens one block drafts
        return self.block_size - self.first_slot

    @property
    def span(self) -> int:  # offset of the last predicted token from the anchor
        return self.predictions


@dataclass
class DFlashOptions(ObjectiveOptions):
    """The `draft.` keys DFlash reads (draft.loss defaults to ce, DFlash's own objective)."""

    target_layers: List[int] = field(default_factory=list)  # layer inputs read (vLLM ids); []: 5 evenly spaced
    num_layers: int = 5  # draft decoder layers, each shaped like a target layer
    block_size: int = 8  # slots per block: [anchor, MASK x (block_size - 1)]
    # false: the anchor is the bonus token, slots 1.. predict, block_size - 1 tokens (DFlash, vLLM's
    # layout); true: every slot predicts, block_size tokens. None: the family's (DFlash false, DSpark true)
    sample_from_anchor: Optional[bool] = None
    loss_decay_gamma: float = 4.0  # the j-th predicted token of a block weighs exp(-j / gamma)
    loss_weighting: str = "decay"  # decay: exp(-j / gamma); dpace: D-PACE (draft.loss: ce; gamma: DSpark's BCE)
    dpace_alpha: float = 0.5  # D-PACE's smoothing constant, in (0, 1]
    max_anchors: int = 512  # blocks trained per sequence
    mask_token_id: Optional[int] = None  # target token whose embedding is MASK; None: the last id
    train_mask_embedding: bool = False  # train the draft's own MASK row (then native export only)
    # recompute each layer in the backward instead of keeping its activations
    gradient_checkpointing: bool = False


def default_target_layers(num_target_layers: int, count: int = DEFAULT_NUM_TARGET_LAYERS) -> List[int]:
    """Evenly spaced layer ids (input-of-layer convention, as speculators/vLLM write them).

    DFlash's reference picks outputs of layers 1 .. L-3, i.e. inputs of 2 .. L-2; a target too
    shallow for that spreads over 1 .. L-1 (never L, the last layer's output: no server captures it).
    """
    start, end = 2, num_target_layers - 2
    if end - start + 1 < count:
        start, end = min(1, num_target_layers - 1), num_target_layers - 1
    count = min(count, end - start + 1)
    if count == 1:
        return [(start + end) // 2]
    return [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]


@dataclass
class DFlashDims(LayerDims):
    hidden_act: str
    vocab_size: int
    target_hidden_size: int
    target_layers: List[int]
    num_layers: int = 5
    block_size: int = 8
    sample_from_anchor: bool = False
    mask_token_id: int = 0
    train_mask_embedding: bool = False
    loss_decay_gamma: float = 4.0
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5
    max_anchors: int = 512
    initializer_range: float = 0.02
    target_num_layers: Optional[int] = None  # the target's decoder layers (None: an export older than the field)

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.block_size, self.sample_from_anchor)


class DFlashBackboneSpec(DraftSpec):
    """The backbone's declarations and checks; a family on it (DFlashSpec, DSpark's) names itself."""

    options = DFlashOptions
    sequence_parallel = True
    serving_format_names = ("speculators",)
    default_sample_from_anchor: ClassVar[bool] = False  # speculators' default for the family

    @classmethod
    def sample_from_anchor(cls, draft_cfg) -> bool:
        chosen = draft_cfg.sample_from_anchor
        return cls.default_sample_from_anchor if chosen is None else bool(chosen)

    @classmethod
    def resolved_target_layers(cls, draft_cfg, target_config) -> List[int]:
        layers = draft_cfg.target_layers
        if not layers:
            return default_target_layers(target_text_config(target_config).num_hidden_layers)
        # concatenated in increasing id order, the order vLLM collects its aux hidden states in
        return sorted(int(x) for x in layers)

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        fail = option_failure(source)

        layers = draft_cfg.target_layers
        if layers:
            if len(set(layers)) != len(layers):
                fail("target_layers", f"{list(layers)} repeats a layer")
        if draft_cfg.num_layers < 1:
            fail("num_layers", f"must be >= 1, got {draft_cfg.num_layers}")
        from_anchor = cls.sample_from_anchor(draft_cfg)
        smallest = 1 if from_anchor else 2
        if draft_cfg.block_size < smallest:
            fail(
                "block_size",
                f"must be >= {smallest} with sample_from_anchor={from_anchor} "
                f"(a block must predict a token), got {draft_cfg.block_size}",
            )
        layout = BlockLayout(draft_cfg.block_size, from_anchor)
        if max_seq_length < layout.span + 2:
            fail(
                "block_size",
                f"a block spans {layout.span + 1} positions after its context; "
                f"max_seq_length {max_seq_length} leaves no room for one",
            )
        if not draft_cfg.loss_decay_gamma > 0:
            fail("loss_decay_gamma", f"must be > 0, got {draft_cfg.loss_decay_gamma}")
        weighting = draft_cfg.get("loss_weighting", "decay")
        if weighting not in LOSS_WEIGHTINGS:
            fail("loss_weighting", f"must be one of {' | '.join(LOSS_WEIGHTINGS)}, got {weighting!r}")
        if weighting == "dpace":
            objective = objective_from_options(draft_cfg, default=cls.default_loss)
            if objective != CE:  # D-PACE's confidence is exp(-CE) of the very term it weighs
                fail(
                    "loss_weighting",
                    f"'dpace' needs draft.loss: ce (its weights come from each slot's CE), got {objective}",
                )
            alpha = draft_cfg.get("dpace_alpha", 0.5)
            if not 0.0 < alpha <= 1.0:
                fail("dpace_alpha", f"must be in (0, 1], got {alpha}")
        if draft_cfg.max_anchors < 1:
            fail("max_anchors", f"must be >= 1, got {draft_cfg.max_anchors}")
        if target_config is None:
            return
        text = target_text_config(target_config)
        rotary = rotary_refusal(target_config)
        if rotary:
            fail(
                "type",
                f"{cls.label} rotates its own queries and keys over whole heads with one rotary table, "
                f"the target's (servers rebuild it from the exported transformer_layer_config); the "
                f"target {rotary}",
            )
        num_target_layers = text.num_hidden_layers
        bad = [x for x in cls.resolved_target_layers(draft_cfg, target_config) if not 0 <= x <= num_target_layers]
        if bad:
            fail(
                "target_layers",
                f"{bad} outside the target's layer ids 0..{num_target_layers} "
                f"(input of layer i; {num_target_layers} = the last layer's output)",
            )
        mask_id = draft_cfg.mask_token_id
        if mask_id is not None and not 0 <= mask_id < text.vocab_size:
            fail("mask_token_id", f"{mask_id} is not a token id of the target (vocab size {text.vocab_size})")


class DFlashSpec(DFlashBackboneSpec):
    family = "dflash"
    label = "DFlash"
