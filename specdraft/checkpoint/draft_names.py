"""The drafts a checkpoint holds, by name: a one-draft run's slot holds one draft (None), a
several-draft run's one folder per name; and which of them an offline command means (`--draft`)."""

from __future__ import annotations

from typing import List, Optional

from specdraft.errors import SpecdraftError


def record_names(record: dict) -> List[Optional[str]]:
    """The drafts a slot's COMMITTED record holds: [None] for a one-draft run's slot, else the
    names of a several-draft run's (each its own folder in the slot)."""
    return list(record["drafts"]) if "drafts" in record else [None]


def choose_draft(names: List[Optional[str]], name: Optional[str], what: str) -> Optional[str]:
    """`--draft NAME` of an offline command: the draft it means among a run's `names` (None: a
    one-draft run). A several-draft run needs one; a one-draft run takes none."""
    if names == [None]:
        if name is not None:
            raise SpecdraftError(
                f"--draft {name}: this run trains one draft (no drafts: in its config); {what} without --draft"
            )
        return None
    if name is None:
        raise SpecdraftError(f"this run trains several drafts; {what} needs --draft NAME, one of: {', '.join(names)}")
    if name not in names:
        raise SpecdraftError(f"--draft {name}: not a draft of this run (its drafts: {', '.join(names)})")
    return name
