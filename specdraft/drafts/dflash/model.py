"""DFlash: the block backbone (drafts/dflash/backbone.py) as it is, its logits the target's lm_head.
The backbone is a shared block because DSpark (drafts/dspark/) builds on it; this is the family."""

from __future__ import annotations

from specdraft.drafts.dflash.backbone import DFlashBackbone
from specdraft.drafts.dflash.options import DFlashSpec


class DFlashDraft(DFlashSpec, DFlashBackbone):
    architecture = "DFlashDraft"
