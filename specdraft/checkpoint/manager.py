"""Crash-safe checkpoints that resume exactly, at any world size: the policy. What a save writes and
commits, which slot a resume takes and what it checks first, and how the run adapts to it. The files
are elsewhere: the layout in specdraft/rundir/layout.py, the manifest, removal and rollback in slots.py, each
draft's part of a slot in draft_parts.py (several drafts: one folder each, one commit for all), the
draft state DeepSpeed does not save in untrained_state.py, other world sizes in universal.py.
The checkpoint directory must be on a filesystem every node sees at the same path: rank 0 commits
what every rank wrote, and every rank reads back what it needs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from omegaconf import DictConfig

from specdraft.rundir.atomic import write_atomic
from specdraft.config import config_hash, config_identity, data_world, draft_view
from specdraft.errors import SpecdraftError, write_failure
from specdraft.rundir.layout import COMMITTED, LATEST, ckpt_dir, draft_part, slot_name, universal_dir
from specdraft.rundir.shared_fs import not_shared_error, wait_visible
from specdraft.target.weights import target_identity
from specdraft.checkpoint import slots
from specdraft.parallel.collectives import raise_everywhere, run_shared
from specdraft.checkpoint.compatibility import adopt_global_batch, check_compatible
from specdraft.checkpoint.draft_parts import (
    DraftPart,
    commit_draft,
    files_rank_loads,
    frozen_files,
    load_draft,
    save_draft,
)
from specdraft.checkpoint.rng import rng_state, set_rng_state
from specdraft.checkpoint.universal import universal_copy

CLIENT_KEY = "specdraft"
UNIVERSAL_INFO = "universal_checkpoint_info"  # what ds_to_universal requires in every slot
SHARED_PROBE = ".shared-filesystem-check"
# Test hook: seconds to sleep after each file DeepSpeed writes and between our commit steps, to
# widen the window in which a crash test can kill a save.
PAUSE_ENV = "SPECDRAFT_SAVE_PAUSE_S"


@dataclass
class ResumePlan:
    slot: Path
    record: dict  # the slot's COMMITTED record
    universal: bool  # saved at another world size / ZeRO stage: load through the universal format


class CheckpointManager:
    def __init__(self, run_dir: Path, cfg: DictConfig, rank: int, world_size: int):
        self.run_dir = Path(run_dir)
        self.ckpt_dir = ckpt_dir(run_dir)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.target_identity = target_identity(cfg.target)
        self.pause = float(os.environ.get(PAUSE_ENV, "0") or 0)

    def check_shared(self) -> None:
        """Collective: every rank must see a file rank 0 writes into the checkpoint directory."""
        import torch.distributed as dist

        if self.world_size == 1:
            return
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=0)
        probe = self.ckpt_dir / SHARED_PROBE

        def write():
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(probe, token[0])

        def look():
            if not wait_visible(probe) or probe.read_text() != token[0]:
                raise not_shared_error(self.ckpt_dir, self.rank, f"the file {SHARED_PROBE} rank 0 wrote there")

        run_shared(write)
        run_shared(look, on_rank=None)
        run_shared(lambda: probe.unlink())

    # -- save ---------------------------------------------------------------------------------

    def save(self, parts: List[DraftPart], step: int, client_state: dict) -> Path:
        """Every draft of the run into one slot under one manifest (a one-draft run: one part named
        None, its record as it always was): a crash leaves all at one step. Every rank calls (each
        part's weights: the gathered draft on rank 0, None elsewhere). Returns the committed slot;
        raises the same error on every rank if any rank failed."""
        import torch.distributed as dist

        slot_dir = self.ckpt_dir / slot_name(step)

        def clear():  # leftovers (another world size, a crash) must not mix in
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            for path in (slot_dir, universal_dir(slot_dir)):
                if path.exists():
                    slots.remove_slot(path)

        run_shared(clear)  # its collective doubles as the barrier before anyone writes
        rng = [None] * self.world_size
        dist.all_gather_object(rng, rng_state())
        state = {UNIVERSAL_INFO: {}, CLIENT_KEY: dict(client_state, rng=rng)}
        written, errors = {}, []
        for part in parts:
            save_draft(part, slot_dir, state, written, errors, self._sleep)
        error = self._write_error(errors[0], slot_dir, step) if errors else None
        if error is not None and self.rank == 0 and not (slot_dir / COMMITTED).exists():
            shutil.rmtree(slot_dir, ignore_errors=True)  # give a full disk its space back
        raise_everywhere(error)
        # every rank fsynced its own files (in recording_writes); rank 0 commits what all wrote
        manifests = [None] * self.world_size
        dist.all_gather_object(manifests, written)

        def commit():
            try:
                described = {part.name: commit_draft(part, slot_dir) for part in parts}
                record = self._record(step)
                if None in described:  # a one-draft run: its record as it always was
                    record.update(described[None])
                else:
                    record["drafts"] = {}
                    for name, entry in described.items():  # each draft's identity, as its run alone records it
                        view = draft_view(self.cfg, name)
                        record["drafts"][name] = dict(
                            entry, config_hash=config_hash(view), config_identity=config_identity(view)
                        )
                slots.commit_slot(slot_dir, manifests, record, self._sleep)
            except OSError as err:
                raise self._write_error(err, slot_dir, step) from err
            try:
                slots.prune(self.ckpt_dir, self.cfg.keep_last)
            except OSError as err:
                raise SpecdraftError(
                    f"{err.filename or self.ckpt_dir}: deleting an old checkpoint slot failed "
                    f"({err.strerror or err}); {slot_dir} is committed"
                ) from err

        run_shared(commit)
        run_shared(lambda: self._expect_visible(slot_dir / COMMITTED), on_rank=None)
        return slot_dir

    def _record(self, step: int) -> dict:
        """What COMMITTED says of the run besides the files: what a resume must match or adopt."""
        cfg = self.cfg
        return {
            "step": step,
            "world_size": self.world_size,
            "zero_stage": cfg.zero_stage,
            "precision": cfg.precision,
            "seed": cfg.seed,
            "global_batch": cfg.per_device_batch_size
            * data_world(cfg, self.world_size)
            * cfg.gradient_accumulation_steps,
            "per_device_batch_size": cfg.per_device_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "config_hash": config_hash(cfg),
            "config_identity": config_identity(cfg),
            "target": os.path.abspath(cfg.target),
            "target_identity": self.target_identity,
        }

    def _write_error(self, err: BaseException, slot_dir: Path, step: int) -> BaseException:
        """A failed write becomes one line saying what survived; anything else stays as it is."""
        reason = write_failure(err, slot_dir)
        if reason is None:
            return err
        if (slot_dir / COMMITTED).is_file():  # only the `latest` hint failed
            return SpecdraftError(f"{self.ckpt_dir / LATEST}: writing it failed: {reason}; {slot_dir} is committed")
        kept = ", ".join(p.name for p in slots.committed_slots(self.ckpt_dir)) or "none"
        return SpecdraftError(
            f"{slot_dir}: saving step {step} failed: {reason}; this save is discarded, the "
            f"committed slots ({kept}) and the exports are untouched"
        )

    def _expect_visible(self, marker: Path) -> None:
        if not wait_visible(marker):
            raise not_shared_error(self.ckpt_dir, self.rank, f"{marker.relative_to(self.ckpt_dir)} rank 0 committed")

    def _sleep(self) -> None:
        if self.pause:
            time.sleep(self.pause)

    # -- resume -------------------------------------------------------------------------------

    def plan_resume(self, log: Callable[[str], None]) -> Optional[ResumePlan]:
        """Collective: the committed slot to resume (None: start fresh), checked on every rank.

        resume=auto takes the newest slot that verifies: a slot that does not is moved aside
        (never deleted) and the next older one is tried. Adopts the slot's global batch (adjusting
        gradient_accumulation_steps to this world size). Raises the same error on every rank.
        """
        import torch.distributed as dist

        mode = str(self.cfg.resume)
        if mode == "no":
            return None
        auto = mode == "auto"
        candidates = [None]
        if self.rank == 0:
            candidates = [[str(p) for p in reversed(slots.committed_slots(self.ckpt_dir))]] if auto else [None]
        dist.broadcast_object_list(candidates, src=0)
        chosen = (
            [Path(p) for p in candidates[0]] if auto else [run_shared(lambda: slots.resolve_slot(Path(mode)), None)]
        )
        for slot in chosen:

            def visible():
                if not wait_visible(slot / COMMITTED):
                    raise not_shared_error(self.ckpt_dir, self.rank, f"{slot.name}/{COMMITTED}, which rank 0 sees")

            def verify():  # every rank checks the files it will read, before anything unpickles them
                record = slots.read_commit(slot)
                names = self._files_to_verify(record)
                # a file the manifest does not list: another version's slot, refused below (not damage)
                listed = None if names is None else [name for name in names if name in record.get("files", {})]
                slots.verify_files(slot, record, listed)
                return record

            run_shared(visible, on_rank=None)
            try:
                record = run_shared(verify, on_rank=None)
            except SpecdraftError as err:
                if not auto:
                    raise
                moved = run_shared(lambda: slots.move_aside(slot))
                log(f"resume: skipped {slot} ({err}); moved it to {moved}")
                continue
            slots.refuse_unlisted(slot, record, frozen_files(record))
            check_compatible(slot, record, self.cfg, self.target_identity)
            adopt_global_batch(slot, record, self.cfg, self.world_size, log)
            return ResumePlan(slot, record, self._needs_universal(slot, record))
        if chosen:
            log(f"resume: no committed slot in {self.ckpt_dir} verifies; starting from step 0")
        return None

    def _files_to_verify(self, record: dict) -> Optional[list]:
        """What this rank will read: rank 0 reads the whole slot to convert it; otherwise each
        rank its own files (the converted copy is verified on every rank before it is loaded)."""
        if self._universal_needed(record):
            return None if self.rank == 0 else frozen_files(record)
        return files_rank_loads(record, self.rank)

    def _universal_needed(self, record: dict) -> bool:
        stages = (record["zero_stage"], self.cfg.zero_stage)
        if 0 in stages:  # ZeRO-0 keeps the whole optimizer state in one file, loadable at any size
            return False
        return record["world_size"] != self.world_size or stages[0] != stages[1]

    def _needs_universal(self, slot: Path, record: dict) -> bool:
        saved, now = record["zero_stage"], self.cfg.zero_stage
        if saved != now and 0 in (saved, now):
            raise SpecdraftError(
                f"{slot}: saved at ZeRO-{saved}, this run has ZeRO-{now}; DeepSpeed converts "
                f"between ZeRO stages 1-3 only (set zero_stage: {saved})"
            )
        return self._universal_needed(record)

    def resume(self, parts: List[DraftPart], plan: ResumePlan, log: Callable[[str], None]) -> dict:
        """Load the planned slot into every draft's engine (each built with load_universal=
        plan.universal; one draft: one part named None); returns our client state (step, sampler, ...)."""
        import torch.distributed as dist

        slot_dir, record = plan.slot, plan.record
        run_shared(lambda: slots.set_aside_later(slot_dir, self.run_dir, log))  # a rollback in this run
        for part in parts:
            load_dir = draft_part(slot_dir, part.name)
            if plan.universal:
                where = f"{self.world_size} rank(s) at ZeRO-{self.cfg.zero_stage}"
                load_dir = universal_copy(slot_dir, self.ckpt_dir, log, where, part.name)
            ours = load_draft(part, slot_dir, load_dir, record, plan.universal)[CLIENT_KEY]
        if self.rank < len(ours["rng"]):  # a rank the saving run did not have keeps its seeded RNG
            set_rng_state(ours["rng"][self.rank])
        dist.barrier()
        return ours
