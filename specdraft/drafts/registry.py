"""The draft families' models, looked up by the `draft.type` config key or an export's
`architecture`: each family's Draft subclass (drafts/<family>/model.py), which inherits its
declarations from the light class the configuration reads (drafts.SPECS). Importing this module
imports every family's model, torch included."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from specdraft.drafts import draft_family
from specdraft.drafts.base import Draft
from specdraft.drafts.dflash.model import DFlashDraft
from specdraft.drafts.dflash2.model import DFlash2Draft
from specdraft.drafts.dspark.model import DSparkDraft
from specdraft.drafts.eagle3.model import Eagle3Draft
from specdraft.drafts.glide.model import GlideDraft
from specdraft.drafts.mtp.model import MTPDraft
from specdraft.drafts.peagle.model import PEagleDraft
from specdraft.errors import SpecdraftError

FAMILIES: Dict[str, Type[Draft]] = {
    cls.family: cls for cls in (GlideDraft, Eagle3Draft, DFlashDraft, DSparkDraft, MTPDraft, PEagleDraft, DFlash2Draft)
}
ARCHITECTURES: Dict[str, Type[Draft]] = {cls.architecture: cls for cls in FAMILIES.values()}


def build_draft(draft_cfg, target_config, data=None) -> Draft:
    draft = FAMILIES[draft_family(draft_cfg.type).family].from_target_config(target_config, draft_cfg, data)
    draft.gradient_checkpointing = bool(draft_cfg.get("gradient_checkpointing") or False)  # training only, not exported
    return draft


def draft_from_export_config(config: Dict[str, Any], source: Optional[str] = None) -> Draft:
    architecture = config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise SpecdraftError(
            f"{source or 'config.json'}: unknown draft architecture {architecture!r} "
            f"(known: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[architecture].from_export_config(config)


__all__ = ["ARCHITECTURES", "FAMILIES", "build_draft", "draft_from_export_config"]
