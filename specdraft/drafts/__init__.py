"""Draft families, looked up by the `draft.type` config key or an export's `architecture`.

A family is one folder here (drafts/<family>/: its Draft subclass in model.py, with its `options`
dataclass of `draft.` keys, beside its drafter and export formats) plus one line in FAMILIES; the
modules directly in drafts/ are the shared blocks a family folder imports (never another family's
folder). The `draft:` config section is the union of every family's keys.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Iterable, List, Optional, Type

from specdraft.drafts.base import CaptureRequest, Draft, DraftLoss, HostBatch, TargetFeatures
from specdraft.drafts.dflash.model import DFlashDraft
from specdraft.drafts.dspark.model import DSparkDraft
from specdraft.drafts.eagle3.model import Eagle3Draft
from specdraft.drafts.glide.model import GlideDraft
from specdraft.drafts.mtp.model import MTPDraft
from specdraft.drafts.peagle.model import PEagleDraft
from specdraft.errors import SpecdraftError

FAMILIES: Dict[str, Type[Draft]] = {cls.family: cls for cls in (GlideDraft, Eagle3Draft, DFlashDraft, DSparkDraft,
                                                                  MTPDraft, PEagleDraft)}
ARCHITECTURES: Dict[str, Type[Draft]] = {cls.architecture: cls for cls in FAMILIES.values()}
DEFAULT_FAMILY = "glide"
# `draft.` keys of every family, with their meaning (the configuration reference prints it)
SHARED_KEYS = {
    "type": f"the draft family: {', '.join(FAMILIES)}",
    # export/init_from.py
    "init_from": "an existing draft the run starts from: an export, a run, or another tool's files (a path)",
}


def _draft_config_schema() -> type:
    """The `draft:` section: `type` plus every family's keys (flat; a key two families share must
    have one default)."""
    fields: Dict[str, dataclasses.Field] = {}
    types: Dict[str, Any] = {}
    for cls in FAMILIES.values():
        hints = typing.get_type_hints(cls.options)  # real types: the modules use postponed annotations
        for f in dataclasses.fields(cls.options):
            types[f.name] = hints[f.name]
            if f.name in fields and _default(fields[f.name]) != _default(f):
                raise TypeError(f"draft key {f.name!r} has two defaults")
            fields[f.name], types[f.name] = f, hints[f.name]
    spec = [("type", str, dataclasses.field(default=DEFAULT_FAMILY)),
            ("init_from", Optional[str], dataclasses.field(default=None))]
    spec += [(name, types[name], dataclasses.field(default=f.default, default_factory=f.default_factory))
             for name, f in fields.items()]
    return dataclasses.make_dataclass("DraftConfig", spec)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


DraftConfig = _draft_config_schema()


def draft_family(name: str, source: str = "config") -> Type[Draft]:
    if name not in FAMILIES:
        raise SpecdraftError(f"{source}: key 'draft.type': {name!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_keys(family: Type[Draft]) -> List[str]:
    """The `draft.` keys a family reads (besides `type`)."""
    return [f.name for f in dataclasses.fields(family.options)]


def check_family_keys(family: Type[Draft], given: Iterable[str], source: str = "config") -> None:
    """A key of another family (draft.block_size on a GLIDE run) is a mistake, not a no-op."""
    own = set(family_keys(family))
    for key in given:
        if key not in SHARED_KEYS and key not in own:
            owners = [name for name, cls in FAMILIES.items() if key in family_keys(cls)]
            raise SpecdraftError(f"{source}: key 'draft.{key}': not a key of draft.type {family.family!r} "
                                 f"(it belongs to {', '.join(owners) or 'no family'})")


def build_draft(draft_cfg, target_config, data=None) -> Draft:
    draft = draft_family(draft_cfg.type).from_target_config(target_config, draft_cfg, data)
    draft.gradient_checkpointing = bool(draft_cfg.get("gradient_checkpointing") or False)  # training only, not exported
    return draft


def draft_from_export_config(config: Dict[str, Any], source: Optional[str] = None) -> Draft:
    architecture = config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise SpecdraftError(f"{source or 'config.json'}: unknown draft architecture {architecture!r} "
                             f"(known: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[architecture].from_export_config(config)


__all__ = ["CaptureRequest", "Draft", "DraftConfig", "DraftLoss", "HostBatch", "TargetFeatures", "FAMILIES",
           "DEFAULT_FAMILY", "SHARED_KEYS", "build_draft", "check_family_keys", "draft_family", "family_keys", "draft_from_export_config"]
