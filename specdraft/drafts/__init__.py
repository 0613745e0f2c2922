"""Draft families, as the configuration knows them: looked up by the `draft.type` config key.

A family is one folder here (drafts/<family>/: its declarations in options.py, a DraftSpec with
its `options` dataclass of `draft.` keys and their checks; its Draft subclass in model.py, which
inherits them, beside its drafter and export formats) plus one line in SPECS and one in
registry.FAMILIES (the models, looked up by `draft.type` or an export's `architecture`). The
modules directly in drafts/ are the shared blocks a family folder imports (never another family's
folder). The `draft:` config section is the union of every family's keys. Importing this package
imports no torch: the configuration loads without it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Iterable, List, Optional, Type

from specdraft.drafts.dflash.options import DFlashSpec
from specdraft.drafts.dflash2.options import DFlash2Spec
from specdraft.drafts.dspark.options import DSparkSpec
from specdraft.drafts.eagle3.options import Eagle3Spec
from specdraft.drafts.glide.options import GlideSpec
from specdraft.drafts.mtp.options import MTPSpec
from specdraft.drafts.peagle.options import PEagleSpec
from specdraft.drafts.spec import DraftSpec
from specdraft.errors import SpecdraftError

SPECS: Dict[str, Type[DraftSpec]] = {
    cls.family: cls for cls in (GlideSpec, Eagle3Spec, DFlashSpec, DSparkSpec, MTPSpec, PEagleSpec, DFlash2Spec)
}
DEFAULT_FAMILY = "glide"
# `draft.` keys of every family, with their meaning (the configuration reference prints it)
SHARED_KEYS = {
    "type": f"the draft family: {', '.join(SPECS)}",
    # export/init_from.py
    "init_from": "an existing draft the run starts from: an export, a run, or another tool's files (a path)",
}


def _draft_config_schema() -> type:
    """The `draft:` section: `type` plus every family's keys (flat; a key two families share must
    have one default)."""
    fields: Dict[str, dataclasses.Field] = {}
    types: Dict[str, Any] = {}
    for cls in SPECS.values():
        hints = typing.get_type_hints(cls.options)  # real types: the modules use postponed annotations
        for f in dataclasses.fields(cls.options):
            types[f.name] = hints[f.name]
            if f.name in fields and _default(fields[f.name]) != _default(f):
                raise TypeError(f"draft key {f.name!r} has two defaults")
            fields[f.name], types[f.name] = f, hints[f.name]
    spec = [
        ("type", str, dataclasses.field(default=DEFAULT_FAMILY)),
        ("init_from", Optional[str], dataclasses.field(default=None)),
    ]
    spec += [
        (name, types[name], dataclasses.field(default=f.default, default_factory=f.default_factory))
        for name, f in fields.items()
    ]
    return dataclasses.make_dataclass("DraftConfig", spec)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


DraftConfig = _draft_config_schema()


def draft_family(name: str, source: str = "config") -> Type[DraftSpec]:
    """The family `draft.type` names, as the configuration knows it (registry.FAMILIES: its model)."""
    if name not in SPECS:
        raise SpecdraftError(f"{source}: key 'draft.type': {name!r} is not one of {', '.join(SPECS)}")
    return SPECS[name]


def family_keys(family: Type[DraftSpec]) -> List[str]:
    """The `draft.` keys a family reads (besides `type`)."""
    return [f.name for f in dataclasses.fields(family.options)]


def check_family_keys(family: Type[DraftSpec], given: Iterable[str], source: str = "config") -> None:
    """A key of another family (draft.block_size on a GLIDE run) is a mistake, not a no-op."""
    own = set(family_keys(family))
    for key in given:
        if key not in SHARED_KEYS and key not in own:
            owners = [name for name, cls in SPECS.items() if key in family_keys(cls)]
            raise SpecdraftError(
                f"{source}: key 'draft.{key}': not a key of draft.type {family.family!r} "
                f"(it belongs to {', '.join(owners) or 'no family'})"
            )


__all__ = [
    "DEFAULT_FAMILY",
    "SHARED_KEYS",
    "SPECS",
    "DraftConfig",
    "DraftSpec",
    "check_family_keys",
    "draft_family",
    "family_keys",
]
