"""Draft families, looked up by the `draft.type` config key or an export's `architecture`.

A family is one module here (its Draft subclass, with its `options` dataclass of `draft.` keys)
plus one line in FAMILIES. The `draft:` config section is the union of every family's keys.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Optional, Type

from specdraft.drafts.base import CaptureRequest, Draft, DraftLoss, HostBatch, TargetFeatures
from specdraft.drafts.dflash import DFlashDraft
from specdraft.drafts.eagle3 import Eagle3Draft
from specdraft.drafts.glide import GlideDraft
from specdraft.errors import SpecdraftError

FAMILIES: Dict[str, Type[Draft]] = {cls.family: cls for cls in (GlideDraft, Eagle3Draft, DFlashDraft)}
ARCHITECTURES: Dict[str, Type[Draft]] = {cls.architecture: cls for cls in FAMILIES.values()}
DEFAULT_FAMILY = "glide"


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
    spec = [("type", str, dataclasses.field(default=DEFAULT_FAMILY))]
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


def build_draft(draft_cfg, target_config, data=None) -> Draft:
    return draft_family(draft_cfg.type).from_target_config(target_config, draft_cfg, data)


def draft_from_export_config(config: Dict[str, Any], source: Optional[str] = None) -> Draft:
    architecture = config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise SpecdraftError(f"{source or 'config.json'}: unknown draft architecture {architecture!r} "
                             f"(known: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[architecture].from_export_config(config)


__all__ = ["CaptureRequest", "Draft", "DraftConfig", "DraftLoss", "HostBatch", "TargetFeatures", "FAMILIES",
           "DEFAULT_FAMILY", "build_draft", "draft_family", "draft_from_export_config"]
