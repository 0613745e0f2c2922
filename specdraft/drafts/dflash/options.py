"""The keys and shapes of DFlash's block backbone (drafts/dflash/backbone.py), shared by DFlash and
DSpark: the `draft.` options a config sets, the dimensions a draft is built and exported with, and
the default choice of target layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from specdraft.drafts.dflash.blocks import BlockLayout
from specdraft.drafts.layers import LayerDims
from specdraft.drafts.objectives import ObjectiveOptions

DEFAULT_NUM_TARGET_LAYERS = 5
LOSS_WEIGHTINGS = ("decay", "dpace")


@dataclass
class DFlashOptions(ObjectiveOptions):
    """The `draft.` keys DFlash reads (draft.loss defaults to ce, DFlash's own objective)."""

    target_layers: List[int] = field(default_factory=list)  # layer inputs read (vLLM ids); []: 5 evenly spaced
    num_layers: int = 5  # draft decoder layers, each shaped like a target layer
    block_size: int = 8  # slots per block: [anchor, MASK x (block_size - 1)]
    sample_from_anchor: bool = False  # False: slots 1.. predict, block_size - 1 tokens (vLLM's layout)
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
