"""One draft's part of a checkpoint slot: what a save writes for it, what COMMITTED records of it,
what a resume loads back and checks. A one-draft run's part is the slot itself (name None); a run
of several drafts keeps each in the slot's <name>/ folder, all under the slot's one COMMITTED
(specdraft/rundir/layout.py). The policy (when, which slot, what must match) is checkpoint/manager.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from specdraft.checkpoint.draft_names import record_names
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import FROZEN_FILE, draft_part
from specdraft.checkpoint import slots
from specdraft.parallel.collectives import run_shared
from specdraft.parallel.zero import gather_draft_state_dict
from specdraft.checkpoint.untrained_state import (
    FINGERPRINT_KEY,
    check_fingerprint,
    draft_fingerprint,
    untrained_state,
    read_untrained_state,
    restore_untrained_state,
    write_untrained_state,
)


@dataclass
class DraftPart:
    """One draft of a save or a resume: its name (None: a one-draft run), its engine, and (save)
    its gathered weights on rank 0."""

    name: Optional[str]
    engine: object
    weights: Optional[dict] = None


def save_draft(
    part: DraftPart, slot_dir: Path, state: dict, written: Dict[str, dict], errors: list, pause: Callable[[], None]
) -> None:
    """Every rank: DeepSpeed writes the draft's state into its folder of the slot, each file
    fsynced and recorded in `written` (paths relative to the slot); a failure lands in `errors`."""
    where = draft_part(slot_dir, part.name)
    try:
        with slots.recording_writes(part.engine, slot_dir, written, errors, pause):
            part.engine.save_checkpoint(
                str(where.parent), tag=where.name, client_state=state, save_latest=False, exclude_frozen_parameters=True
            )
    except Exception as err:
        errors.append(err)


def commit_draft(part: DraftPart, slot_dir: Path) -> dict:
    """Rank 0, before the commit: the draft's untrained state file, and what COMMITTED says of it."""
    draft = part.engine.module.draft_model
    write_untrained_state(draft_part(slot_dir, part.name), untrained_state(draft, part.weights))
    return draft_record(draft, part.weights)


def draft_record(draft, weights: dict) -> dict:
    """What rebuilds the draft, and what proves a load brought it back."""
    return {"draft": draft.export_config(), FINGERPRINT_KEY: draft_fingerprint(weights)}


def frozen_files(record: dict) -> List[str]:
    """The frozen-state file of every draft of a slot."""
    return [FROZEN_FILE if name is None else f"{name}/{FROZEN_FILE}" for name in record_names(record)]


def files_rank_loads(record: dict, rank: int) -> List[str]:
    """The slot files a rank reads to load every draft at the saved world size and stage
    (slots.files_rank_loads of each draft's folder) and their frozen-state files."""
    names = []
    for name in record_names(record):
        prefix = "" if name is None else f"{name}/"
        own = {key[len(prefix) :]: entry for key, entry in record.get("files", {}).items() if key.startswith(prefix)}
        names += [prefix + n for n in slots.files_rank_loads({"files": own}, rank, record["zero_stage"])]
    return names + frozen_files(record)


def load_draft(part: DraftPart, slot_dir: Path, load_dir: Path, record: dict, universal: bool) -> dict:
    """Load the draft's engine from load_dir (its folder of the slot, or of the slot's universal
    copy), its untrained state from the slot; prove it came back. Returns DeepSpeed's client state."""
    engine = part.engine
    source = draft_part(slot_dir, part.name)
    # ZeRO-3's universal load gives every param group the hyperparameters of group 0 (weight
    # decay on the norms), and one shared `step` tensor that torch's Adam then increments once
    # per group: put back each group's own hyperparameters (lr is the scheduler's) and step.
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
    load_path, client_state = engine.load_checkpoint(
        str(load_dir.parent),
        tag=load_dir.name,
        load_module_strict=False,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if load_path is None:
        raise SpecdraftError(f"{load_dir}: DeepSpeed found no checkpoint to load there")
    if universal:
        for group, own in zip(engine.optimizer.param_groups, groups):
            group.update(own)
        for param_state in engine.optimizer.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()
    # DeepSpeed restores trained parameters only (frozen ones are not in the slot, a universal
    # copy has no buffers): the rest comes back, exactly, from our side file.
    restore_untrained_state(engine.module.draft_model, read_untrained_state(source), str(source))
    # The load was non-strict: prove the draft came back, buffers and frozen parameters included.
    loaded = gather_draft_state_dict(engine)
    own = record if part.name is None else record["drafts"][part.name]
    run_shared(lambda: check_fingerprint(source, loaded, own))
    return client_state
