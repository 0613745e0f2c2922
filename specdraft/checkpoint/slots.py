"""Checkpoint slots on disk: the sha256 manifest that commits a slot, its verification before
anything is unpickled, and removal that never leaves a committed half-slot (layout: specdraft/rundir/layout.py).

A save never overwrites a committed slot: it goes to a fresh step_<N>, and older slots are pruned
only after it is committed, so `keep_last` committed slots survive a crash at any instant
(keep_last=2 is LongSpec's last_ds/last_2ds). Nothing is deleted while its COMMITTED exists: the
marker is unlinked (and the directory fsynced) first. The newest slot is the committed one with
the highest step, whatever `latest` says.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from specdraft.rundir.atomic import fsync_dir, fsync_file, write_atomic
from specdraft.rundir.shared_fs import not_shared_error
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import (
    ABANDONED_SUFFIX,
    CKPT_DIR,
    COMMITTED,
    LATEST,
    REJECTED_SUFFIX,
    UNIVERSAL_SUFFIX,
    committed_slots,
    slot_name,
    slot_step,
    step_of,
)
from specdraft.checkpoint import safe_load

PICKLE_SUFFIX = ".pt"  # DeepSpeed's files; the rest of a slot is JSON, safetensors and zero_to_fp32.py


# -- which slots exist ----------------------------------------------------------------------------


def newest_committed(ckpt_dir: Path) -> Optional[Path]:
    """The committed slot with the highest step. (`latest` can lag behind: a crash between the
    marker and the pointer's rename leaves it naming the previous slot.)"""
    slots = committed_slots(ckpt_dir)
    return slots[-1] if slots else None


def resolve_slot(path: Path) -> Path:
    """A slot dir, a run dir or a ckpt dir -> its committed slot; a clear error otherwise."""
    if not path.exists():
        raise SpecdraftError(f"resume: {path} does not exist")
    if step_of(path.name) is not None and (path.parent.name == CKPT_DIR or (path / COMMITTED).exists()):
        read_commit(path)  # raises for an uncommitted slot
        return path
    for ckpt_dir in (path / CKPT_DIR, path):
        slot = newest_committed(ckpt_dir)
        if slot is not None:
            return slot
    raise SpecdraftError(f"resume: {path} holds no committed checkpoint")


def run_slot(run_dir, slot: Optional[str] = None, step: Optional[int] = None):
    """(slot_dir, verified record) of a run: the named slot / step, else the newest committed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SpecdraftError(f"{run_dir}: run directory not found")
    ckpt_dir = run_dir / CKPT_DIR
    if slot is None and step is not None:
        slot = slot_name(step)
    slot_dir = ckpt_dir / slot if slot else newest_committed(ckpt_dir)
    if slot_dir is None:
        raise SpecdraftError(f"{run_dir}: no committed checkpoint under {ckpt_dir}")
    if not slot_dir.is_dir():
        raise SpecdraftError(f"{slot_dir}: no such checkpoint slot")
    return slot_dir, verify_slot(slot_dir)


# -- the manifest -------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def slot_files(slot_dir: Path) -> List[Path]:
    return sorted(p for p in slot_dir.rglob("*") if p.is_file() and p.name != COMMITTED)


def read_commit(slot_dir: Path) -> dict:
    marker = slot_dir / COMMITTED
    if not marker.is_file():
        raise SpecdraftError(f"{slot_dir}: no {COMMITTED} marker (an interrupted save); it cannot be resumed")
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise SpecdraftError(f"{marker}: not valid JSON (damaged checkpoint marker)") from None


def verify_files(slot_dir: Path, record: dict, names: Optional[List[str]] = None) -> None:
    """Check files against the COMMITTED manifest, and each pickle for what it would call
    (safe_load.check), BEFORE anything else unpickles them: `names`, or every file of the slot
    (and no file outside the manifest) when None."""
    expected = record.get("files", {})
    if names is None:
        present = {str(p.relative_to(slot_dir)) for p in slot_files(slot_dir)}
        for name in sorted(present - set(expected)):
            raise SpecdraftError(f"{slot_dir / name}: not in the {COMMITTED} manifest (refusing to load it)")
        names = sorted(expected)
    for name in names:
        path, entry = slot_dir / name, expected[name]  # callers pass listed names (refuse_unlisted)
        if not path.is_file():
            raise SpecdraftError(f"{path}: listed in {COMMITTED} but missing")
        if path.stat().st_size != entry["bytes"]:
            raise SpecdraftError(
                f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
            )
        if file_sha256(path) != entry["sha256"]:
            raise SpecdraftError(f"{path}: sha256 does not match the {COMMITTED} manifest (modified)")
        if path.suffix == PICKLE_SUFFIX:  # a valid manifest proves who wrote the manifest, not what the pickle runs
            safe_load.check(path)


def refuse_unlisted(slot_dir: Path, record: dict, names: List[str]) -> None:
    """A slot whose manifest lacks a file this version reads is intact but of another version:
    refused in one line (never moved aside as damaged). Decided from the record alone, so every
    rank raises it together."""
    for name in names:
        if name not in record.get("files", {}):
            raise SpecdraftError(
                f"{slot_dir / name}: not listed in {COMMITTED} (a slot saved by a specdraft that did not "
                f"write it); it cannot be resumed by this version: resume it with the version that saved "
                f"it, or start anew in another output_dir (draft.init_from a step_<N>/ export to keep its weights)"
            )


def verify_slot(slot_dir: Path) -> dict:
    """Every file of a committed slot against its manifest; returns the record."""
    record = read_commit(slot_dir)
    verify_files(slot_dir, record)
    return record


def files_rank_loads(record: dict, rank: int, zero_stage: int) -> List[str]:
    """The slot files DeepSpeed opens on `rank` when it loads the slot at its saved world size and
    stage: the shared module states (ZeRO 0-2) or this rank's own (ZeRO-3), and this rank's
    optimizer partition."""
    own = re.compile(rf"(bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_(optim|model)_states\.pt")
    shared = re.compile(r"mp_rank_\d+_model_states\.pt")
    return sorted(
        name for name in record.get("files", {}) if own.fullmatch(name) or (zero_stage < 3 and shared.fullmatch(name))
    )


# -- writing and committing ---------------------------------------------------------------------


@contextlib.contextmanager
def recording_writes(engine, slot_dir: Path, written: Dict[str, dict], errors: list, pause: Callable[[], None]):
    """Around every file DeepSpeed writes on this rank: fsync it and hash it (this rank's part
    of the manifest). A failed write is recorded, not raised, so DeepSpeed's own barriers
    still match on every rank; the rest of this rank's writes are skipped."""
    original = engine.checkpoint_engine.save

    def save(state_dict, path):
        if errors:
            return
        try:
            original(state_dict, path)
            fsync_file(path)
            written[str(Path(path).relative_to(slot_dir))] = file_entry(Path(path))
        except Exception as err:
            errors.append(err)
        pause()

    engine.checkpoint_engine.save = save
    try:
        yield
    finally:
        engine.checkpoint_engine.save = original


def commit_slot(slot_dir: Path, manifests: List[Dict[str, dict]], record: dict, pause: Callable[[], None]) -> None:
    """Rank 0, after every rank fsynced its files: check that it sees them, add what DeepSpeed
    copies besides its states, write COMMITTED (the manifest + `record`), then the `latest` hint."""
    ckpt_dir = slot_dir.parent
    files = {name: entry for written in manifests for name, entry in written.items()}
    for rank, written in enumerate(manifests):
        for name in written:
            if not (slot_dir / name).is_file():
                raise not_shared_error(ckpt_dir, 0, f"{name}, which rank {rank} wrote")
    for path in slot_files(slot_dir):  # zero_to_fp32.py, the untrained state
        name = str(path.relative_to(slot_dir))
        if name not in files:
            fsync_file(path)
            files[name] = file_entry(path)
    fsync_dir(slot_dir)
    pause()
    write_atomic(slot_dir / COMMITTED, json.dumps(dict(record, files=files, time=time.time()), indent=1))
    pause()
    write_atomic(ckpt_dir / LATEST, slot_dir.name)


# -- removing -----------------------------------------------------------------------------------


def remove_slot(path: Path) -> None:
    """Un-commit (unlink COMMITTED, fsync the directory), then delete: a crash midway leaves an
    uncommitted directory that resume ignores, never a committed half-slot."""
    marker = path / COMMITTED
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path)


def prune(ckpt_dir: Path, keep_last: int) -> None:
    """Keep the newest keep_last committed slots; delete every other slot older than the newest
    (older committed ones, uncommitted leftovers of crashed saves) and the universal copies of
    slots not kept."""
    keep = committed_slots(ckpt_dir)[-keep_last:]
    newest = slot_step(keep[-1])
    for path in ckpt_dir.iterdir():
        if not path.is_dir():
            continue
        step = step_of(path.name)
        if step is not None and path not in keep and step < newest:
            remove_slot(path)
        elif path.name.endswith(UNIVERSAL_SUFFIX) and path.with_name(path.name[: -len(UNIVERSAL_SUFFIX)]) not in keep:
            remove_slot(path)
        elif path.name.endswith(UNIVERSAL_SUFFIX + ".tmp"):  # a conversion that crashed
            shutil.rmtree(path)


def move_aside(slot: Path, suffix: str = REJECTED_SUFFIX) -> Path:
    """Rename a slot (or an export) out of the slot namespace, to <name><suffix>[-k]: a slot that
    failed verification (.rejected), a later slot a rollback abandons (.abandoned). Nothing is
    deleted, and the new name is never taken from anything already there."""
    target = slot.with_name(slot.name + suffix)
    n = 1
    while os.path.lexists(target):
        target = slot.with_name(f"{slot.name}{suffix}-{n}")
        n += 1
    os.rename(slot, target)
    fsync_dir(slot.parent)
    return target


def set_aside_later(slot: Path, run_dir: Path, log: Callable[[str], None]) -> List[Path]:
    """A rollback: resuming `slot` of this very run while later committed slots exist. Those
    slots (and their exports step_<N>/) belong to the trajectory the user abandons: moved aside
    (.abandoned), so the new saves neither collide with nor get pruned against them, and
    resume=auto never silently continues the old trajectory. `latest` names `slot` again."""
    ckpt = Path(run_dir) / CKPT_DIR
    if slot.resolve().parent != ckpt.resolve():
        return []  # another run's slot: never touched
    step = slot_step(slot)
    moved = []
    for later in (p for p in committed_slots(ckpt) if slot_step(p) > step):
        moved.append(move_aside(later, ABANDONED_SUFFIX))
        export = Path(run_dir) / later.name
        if export.is_dir():
            moved.append(move_aside(export, ABANDONED_SUFFIX))
    if moved:
        write_atomic(ckpt / LATEST, slot.name)
        log(
            f"resume: rolled back to {slot.name}; the later slots and exports are kept aside, never resumed by "
            f"resume=auto: {', '.join(p.name for p in moved)}"
        )
    return moved
