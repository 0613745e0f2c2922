"""Crash-safe checkpoints that resume exactly, at any world size. Only this module knows the
on-disk layout of a run:

run/
  config.yaml
  ckpt/step_<N>/             DeepSpeed state of the draft only (params, optimizer, scheduler)
  ckpt/step_<N>/draft_frozen.safetensors   the draft's untrained state (buffers such as EAGLE-3's
                             d2t/t2d, frozen parameters such as DFlash's mask_delta), exact dtypes:
                             DeepSpeed leaves frozen parameters out of the slot and its universal
                             conversion drops buffers, so our writer carries them itself
  ckpt/step_<N>/COMMITTED    written last by rank 0 after every rank fsynced its own files: step,
                             world size, ZeRO stage, batch geometry, target identity, sha256 of
                             every file in the slot
  ckpt/step_<N>.universal/   step_<N> in DeepSpeed's universal format (made by a resume at another
                             world size or ZeRO stage; reused by the next one), its own COMMITTED
  ckpt/step_<N>.rejected/    a slot that failed verification under resume=auto, moved aside
  ckpt/latest                newest committed slot name: a hint for people and tools
  step_<N>/                  draft export (see export.py)
  export_step_<N>/           `specdraft export`;  consolidated/step_<N>/: `specdraft consolidate`

A slot without COMMITTED does not exist for resume, and the newest slot is the committed one with
the highest step (whatever `latest` says). A new save never overwrites a committed slot: it goes to
a fresh step_<N>, and older slots are pruned only after it is committed, so `keep_last` committed
slots survive a crash at any instant (keep_last=2 is LongSpec's last_ds/last_2ds). Nothing is
deleted while its COMMITTED exists: the marker is unlinked (and the directory fsynced) first.

The checkpoint directory must be on a filesystem every node sees at the same path: rank 0 commits
what every rank wrote, and every rank reads back what it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig

from specdraft.atomic import fsync_dir, fsync_file, publish_dir, write_atomic
from specdraft.config import config_hash
from specdraft.errors import SpecdraftError
from specdraft.target.weights import target_identity
from specdraft.train.collectives import raise_everywhere, run_shared
from specdraft.train.engine import gather_draft_state_dict
from specdraft.train.rng import rng_state, set_rng_state

CKPT_DIR = "ckpt"
SLOT_PREFIX = "step_"
COMMITTED = "COMMITTED"
LATEST = "latest"
UNIVERSAL_SUFFIX = ".universal"
REJECTED_SUFFIX = ".rejected"
CONFIG_FILE = "config.yaml"
CLIENT_KEY = "specdraft"
FROZEN_FILE = "draft_frozen.safetensors"
UNIVERSAL_INFO = "universal_checkpoint_info"  # what ds_to_universal requires in every slot
SHARED_PROBE = ".shared-filesystem-check"
VISIBLE_WAIT_S = 10.0  # how long a rank waits for another rank's file (NFS attribute caches)
# Test hook: seconds to sleep after each file DeepSpeed writes and between our commit steps, to
# widen the window in which a crash test can kill a save.
PAUSE_ENV = "SPECDRAFT_SAVE_PAUSE_S"


# -- the run layout -----------------------------------------------------------------------------

def slot_name(step: int) -> str:
    return f"{SLOT_PREFIX}{step}"


def _step_of(name: str) -> Optional[int]:
    digits = name[len(SLOT_PREFIX):]
    return int(digits) if name.startswith(SLOT_PREFIX) and digits.isdigit() else None


def slot_step(path: Path) -> int:
    return int(path.name[len(SLOT_PREFIX):])


def config_file(run_dir) -> Path:
    return Path(run_dir) / CONFIG_FILE


def export_dir(run_dir, step: int) -> Path:
    """Where training writes the draft export of `step`."""
    return Path(run_dir) / slot_name(step)


def exports(run_dir) -> List[Path]:
    """The run's draft export directories (step_<N>/), oldest first."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.iterdir() if p.is_dir() and _step_of(p.name) is not None]
    return sorted(found, key=slot_step)


def offline_export_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / f"export_{slot_name(step)}"


def consolidated_file(run_dir, slot_dir: Path) -> Path:
    return Path(run_dir) / "consolidated" / slot_dir.name / "draft_fp32.safetensors"


def universal_dir(slot_dir: Path) -> Path:
    return slot_dir.with_name(slot_dir.name + UNIVERSAL_SUFFIX)


def committed_slots(ckpt_dir: Path) -> List[Path]:
    """Slots with a COMMITTED marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    slots = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and _step_of(p.name) is not None and (p / COMMITTED).is_file()]
    return sorted(slots, key=slot_step)


def newest_committed(ckpt_dir: Path) -> Optional[Path]:
    """The committed slot with the highest step. (`latest` can lag behind: a crash between the
    marker and the pointer's rename leaves it naming the previous slot.)"""
    slots = committed_slots(ckpt_dir)
    return slots[-1] if slots else None


# -- the manifest -------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _slot_files(slot_dir: Path) -> List[Path]:
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
    """Check files against the COMMITTED manifest BEFORE anything unpickles them: `names`, or
    every file of the slot (and no file outside the manifest) when None."""
    expected = record.get("files", {})
    if names is None:
        present = {str(p.relative_to(slot_dir)) for p in _slot_files(slot_dir)}
        for name in sorted(present - set(expected)):
            raise SpecdraftError(f"{slot_dir / name}: not in the {COMMITTED} manifest (refusing to load it)")
        names = sorted(expected)
    for name in names:
        path, entry = slot_dir / name, expected[name]
        if not path.is_file():
            raise SpecdraftError(f"{path}: listed in {COMMITTED} but missing")
        if path.stat().st_size != entry["bytes"]:
            raise SpecdraftError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                                 f"(truncated or replaced)")
        if _sha256(path) != entry["sha256"]:
            raise SpecdraftError(f"{path}: sha256 does not match the {COMMITTED} manifest (modified)")


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
    return sorted(name for name in record.get("files", {})
                  if own.fullmatch(name) or (zero_stage < 3 and shared.fullmatch(name)))


def remove_slot(path: Path) -> None:
    """Un-commit (unlink COMMITTED, fsync the directory), then delete: a crash midway leaves an
    uncommitted directory that resume ignores, never a committed half-slot."""
    marker = path / COMMITTED
    if marker.exists():
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path)


def _wait_visible(path: Path) -> bool:
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while not path.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def not_shared_error(ckpt_dir: Path, rank: int, what: str) -> SpecdraftError:
    return SpecdraftError(f"{ckpt_dir}: rank {rank} cannot see {what}: the checkpoint directory (output_dir) "
                          f"must be on a filesystem every node shares, at the same path")


def _write_failure(err: BaseException) -> Optional[str]:
    """Why a save failed, when a write did (a full disk, a quota, an I/O error); None otherwise."""
    while err is not None:
        if isinstance(err, OSError):
            return "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        if isinstance(err, RuntimeError) and "file write failed" in str(err):  # torch.save's wording
            return "a file write failed (disk full?)"
        err = err.__cause__ or err.__context__
    return None


# -- what DeepSpeed does not save -----------------------------------------------------------------

def draft_fingerprint(weights: Dict[str, torch.Tensor]) -> Dict[str, List[float]]:
    """Per-tensor (sum, sum of squares) of the draft's weights. Saved with each slot and compared
    after a load: proof that the draft came back."""
    return {name: [float(t.double().sum()), float(t.double().pow(2).sum())] for name, t in weights.items()}


def frozen_state(draft, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The entries of a draft's full state dict (`weights`) that are not trained parameters."""
    trained = {name for name, param in draft.named_parameters() if param.requires_grad}
    return {name: t for name, t in weights.items() if name not in trained}


def write_frozen_state(slot_dir: Path, state: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(slot_dir / FROZEN_FILE))


def read_frozen_state(slot_dir: Path) -> Dict[str, torch.Tensor]:
    """The slot's frozen state (checked against the manifest by the caller)."""
    from safetensors.torch import load_file

    path = slot_dir / FROZEN_FILE
    if not path.is_file():
        raise SpecdraftError(f"{path}: missing (a slot saved before frozen state was carried); it cannot "
                             f"be resumed or exported")
    return load_file(str(path))


def _check_fingerprint(slot_dir: Path, weights: dict, record: dict) -> None:
    if draft_fingerprint(weights) != record["draft_fingerprint"]:
        raise SpecdraftError(f"{slot_dir}: the draft weights loaded do not match the saved ones")


# -- DeepSpeed's universal format -----------------------------------------------------------------

MODEL_STATES_BY_STAGE = {False: "mp_rank_00_model_states.pt", True: "zero_pp_rank_0_mp_rank_00_model_states.pt"}


def convert_to_universal(slot_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's ds_to_universal, in-process (one worker: no process pool), of a verified slot.

    ds_to_universal writes `latest_universal` into the PARENT of its output folder, so it writes
    into a private temp parent; the result is committed like a slot and renamed into place.
    """
    from deepspeed.checkpoint import ds_to_universal

    tmp_parent = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_parent, ignore_errors=True)
    tmp_parent.mkdir()
    tmp = tmp_parent / out_dir.name
    args = argparse.Namespace(input_folder=str(slot_dir), output_folder=str(tmp), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise SpecdraftError(f"{slot_dir}: DeepSpeed's universal conversion failed "
                             f"({type(err).__name__}: {first})") from err
    _serve_every_stage(tmp)
    files = {str(p.relative_to(tmp)): _file_entry(p) for p in _slot_files(tmp)}
    record = {"source": slot_dir.name, "source_commit": _sha256(slot_dir / COMMITTED), "files": files}
    write_atomic(tmp / COMMITTED, json.dumps(record, indent=1))
    publish_dir(tmp, out_dir)
    shutil.rmtree(tmp_parent)


def load_universal_optimizer_state(path: Path) -> dict:
    """zero/optimizer_state.pt of a universal copy this process just wrote from a verified slot.
    Python 3.11.0-3.11.4 pickle an int Enum member as getattr(ZeroStageEnum, "gradients") (later
    ones as ZeroStageEnum(2)), so getattr is allowed for this load; weights_only still refuses to
    call anything outside the list."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, getattr]):
        return torch.load(path, weights_only=True)


def _serve_every_stage(out: Path) -> None:
    """ds_to_universal writes a ZeRO-1/2 slot and a ZeRO-3 slot differently, and each stage's loader
    reads only its own form: fill in what the other stage reads, so the copy loads at any stage 1-3.

    - module states: the loader looks for the file name its own stage writes (ZeRO-3: per rank);
    - zero/optimizer_state.pt: ZeRO-3 reads the step and hyperparameters from a torch optimizer
      state dict in it, ZeRO-1/2 reads `param_groups` and `ds_version`;
    - zero/<param>/*.pt: ZeRO-1/2 reads {"param": tensor} and a step.pt, ZeRO-3 writes bare tensors.
    """
    import deepspeed

    present = [name for name in MODEL_STATES_BY_STAGE.values() if (out / name).is_file()]
    for name in MODEL_STATES_BY_STAGE.values():
        if not (out / name).is_file():
            shutil.copyfile(out / present[0], out / name)
    zero = out / "zero"
    optim = load_universal_optimizer_state(zero / "optimizer_state.pt")
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    # ds_to_universal writes a folder per buffer too (fp32.pt only); they are never loaded
    # (buffers come back from FROZEN_FILE), and at ZeRO-1/2 the step is read from a parameter's
    trained = [p for p in params if (p / "exp_avg.pt").is_file()]
    if "optimizer_state_dict" in optim:  # from ZeRO-3
        step = optim["optimizer_state_dict"]["state"][0]["step"]
        for param in params:
            for path in param.glob("*.pt"):
                state = torch.load(path, weights_only=True)
                if torch.is_tensor(state):
                    torch.save({"param": state}, path)
            torch.save(torch.as_tensor(step), param / "step.pt")
        optim.setdefault("ds_version", deepspeed.__version__)
    else:  # from ZeRO-1/2
        step = torch.load(trained[0] / "step.pt", weights_only=True)
        optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    torch.save(optim, zero / "optimizer_state.pt")


# -- the manager ------------------------------------------------------------------------------

@dataclass
class ResumePlan:
    slot: Path
    record: dict  # the slot's COMMITTED record
    universal: bool  # saved at another world size / ZeRO stage: load through the universal format


class CheckpointManager:
    def __init__(self, run_dir: Path, cfg: DictConfig, rank: int, world_size: int):
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / CKPT_DIR
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.target_identity = target_identity(cfg.target)
        self.pause = float(os.environ.get(PAUSE_ENV, "0") or 0)

    # -- start-up -----------------------------------------------------------------------------

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
            if not _wait_visible(probe) or probe.read_text() != token[0]:
                raise not_shared_error(self.ckpt_dir, self.rank, f"the file {SHARED_PROBE} rank 0 wrote there")

        run_shared(write)
        run_shared(look, on_rank=None)
        run_shared(lambda: probe.unlink())

    # -- save ---------------------------------------------------------------------------------

    def save(self, engine, step: int, client_state: dict, draft_weights: Optional[dict]) -> Path:
        """Every rank calls (draft_weights: the gathered draft on rank 0, None elsewhere).
        Returns the committed slot; raises the same error on every rank if any rank failed."""
        import torch.distributed as dist

        slot_dir = self.ckpt_dir / slot_name(step)

        def clear():  # leftovers (another world size, a crash) must not mix in
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            for path in (slot_dir, universal_dir(slot_dir)):
                if path.exists():
                    remove_slot(path)

        run_shared(clear)  # its collective doubles as the barrier before anyone writes
        rng = [None] * self.world_size
        dist.all_gather_object(rng, rng_state())
        state = {UNIVERSAL_INFO: {}, CLIENT_KEY: dict(client_state, rng=rng)}
        written, errors = {}, []
        try:
            with self._recording_writes(engine, slot_dir, written, errors):
                engine.save_checkpoint(str(self.ckpt_dir), tag=slot_dir.name, client_state=state,
                                       save_latest=False, exclude_frozen_parameters=True)
        except Exception as err:
            errors.append(err)
        error = self._write_error(errors[0], slot_dir, step) if errors else None
        if error is not None and self.rank == 0 and not (slot_dir / COMMITTED).exists():
            shutil.rmtree(slot_dir, ignore_errors=True)  # give a full disk its space back
        raise_everywhere(error)
        # every rank fsynced its own files (in _recording_writes); rank 0 commits what all wrote
        manifests = [None] * self.world_size
        dist.all_gather_object(manifests, written)

        def commit():
            try:
                write_frozen_state(slot_dir, frozen_state(engine.module.draft_model, draft_weights))
                self._commit(slot_dir, step, manifests, draft_fingerprint(draft_weights),
                             engine.module.draft_model.export_config())
            except OSError as err:
                raise self._write_error(err, slot_dir, step) from err
            try:
                self._prune()
            except OSError as err:
                raise SpecdraftError(f"{err.filename or self.ckpt_dir}: deleting an old checkpoint slot failed "
                                     f"({err.strerror or err}); {slot_dir} is committed") from err

        run_shared(commit)
        run_shared(lambda: self._expect_visible(slot_dir / COMMITTED), on_rank=None)
        return slot_dir

    def _write_error(self, err: BaseException, slot_dir: Path, step: int) -> BaseException:
        """A failed write becomes one line saying what survived; anything else stays as it is."""
        reason = _write_failure(err)
        if reason is None:
            return err
        if (slot_dir / COMMITTED).is_file():  # only the `latest` hint failed
            return SpecdraftError(f"{self.ckpt_dir / LATEST}: writing it failed: {reason}; {slot_dir} is committed")
        kept = ", ".join(p.name for p in committed_slots(self.ckpt_dir)) or "none"
        return SpecdraftError(f"{slot_dir}: saving step {step} failed: {reason}; this save is discarded, the "
                              f"committed slots ({kept}) and the exports are untouched")

    def _expect_visible(self, marker: Path) -> None:
        if not _wait_visible(marker):
            raise not_shared_error(self.ckpt_dir, self.rank, f"{marker.relative_to(self.ckpt_dir)} rank 0 committed")

    def _commit(self, slot_dir: Path, step: int, manifests: List[dict], fingerprint: dict,
                draft_config: dict) -> None:
        files = {name: entry for written in manifests for name, entry in written.items()}
        for rank, written in enumerate(manifests):
            for name in written:
                if not (slot_dir / name).is_file():
                    raise not_shared_error(self.ckpt_dir, 0, f"{name}, which rank {rank} wrote")
        for path in _slot_files(slot_dir):  # what DeepSpeed copies besides its states (zero_to_fp32.py)
            name = str(path.relative_to(slot_dir))
            if name not in files:
                fsync_file(path)
                files[name] = _file_entry(path)
        fsync_dir(slot_dir)
        cfg = self.cfg
        record = {"step": step, "world_size": self.world_size, "zero_stage": cfg.zero_stage,
                  "precision": cfg.precision, "seed": cfg.seed,
                  "global_batch": cfg.per_device_batch_size * self.world_size * cfg.gradient_accumulation_steps,
                  "per_device_batch_size": cfg.per_device_batch_size,
                  "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
                  "config_hash": config_hash(cfg), "target": os.path.abspath(cfg.target),
                  "target_identity": self.target_identity,
                  "draft": draft_config, "draft_fingerprint": fingerprint, "files": files,
                  "time": time.time()}
        self._sleep()
        write_atomic(slot_dir / COMMITTED, json.dumps(record, indent=1))
        self._sleep()
        write_atomic(self.ckpt_dir / LATEST, slot_dir.name)

    def _prune(self) -> None:
        """Keep the newest keep_last committed slots; delete every other slot older than the newest
        (older committed ones, uncommitted leftovers of crashed saves) and the universal copies of
        slots not kept."""
        keep = committed_slots(self.ckpt_dir)[-self.cfg.keep_last:]
        newest = slot_step(keep[-1])
        for path in self.ckpt_dir.iterdir():
            if not path.is_dir():
                continue
            step = _step_of(path.name)
            if step is not None and path not in keep and step < newest:
                remove_slot(path)
            elif path.name.endswith(UNIVERSAL_SUFFIX) and path.with_name(path.name[:-len(UNIVERSAL_SUFFIX)]) not in keep:
                remove_slot(path)
            elif path.name.endswith(UNIVERSAL_SUFFIX + ".tmp"):  # a conversion that crashed
                shutil.rmtree(path)

    def _sleep(self) -> None:
        if self.pause:
            time.sleep(self.pause)

    @contextlib.contextmanager
    def _recording_writes(self, engine, slot_dir: Path, written: dict, errors: list):
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
                written[str(Path(path).relative_to(slot_dir))] = _file_entry(Path(path))
            except Exception as err:
                errors.append(err)
            self._sleep()

        engine.checkpoint_engine.save = save
        try:
            yield
        finally:
            engine.checkpoint_engine.save = original

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
            candidates = [[str(p) for p in reversed(committed_slots(self.ckpt_dir))]] if auto else [None]
        dist.broadcast_object_list(candidates, src=0)
        slots = [Path(p) for p in candidates[0]] if auto else [run_shared(lambda: resolve_slot(Path(mode)), None)]
        for slot in slots:
            def visible():
                if not _wait_visible(slot / COMMITTED):
                    raise not_shared_error(self.ckpt_dir, self.rank, f"{slot.name}/{COMMITTED}, which rank 0 sees")

            def verify():  # every rank checks the files it will read, before anything unpickles them
                record = read_commit(slot)
                verify_files(slot, record, self._files_to_verify(record))
                return record

            run_shared(visible, on_rank=None)
            try:
                record = run_shared(verify, on_rank=None)
            except SpecdraftError as err:
                if not auto:
                    raise
                moved = run_shared(lambda: _move_aside(slot))
                log(f"resume: skipped {slot} ({err}); moved it to {moved}")
                continue
            self._check_compatible(slot, record)
            self._adopt_global_batch(slot, record, log)
            return ResumePlan(slot, record, self._needs_universal(slot, record))
        if slots:
            log(f"resume: no committed slot in {self.ckpt_dir} verifies; starting from step 0")
        return None

    def _files_to_verify(self, record: dict) -> Optional[List[str]]:
        """What this rank will read: rank 0 reads the whole slot to convert it; otherwise each
        rank its own files (the converted copy is verified on every rank before it is loaded)."""
        if self._universal_needed(record):
            return None if self.rank == 0 else [FROZEN_FILE]
        return [*files_rank_loads(record, self.rank, record["zero_stage"]), FROZEN_FILE]

    def _universal_needed(self, record: dict) -> bool:
        stages = (record["zero_stage"], self.cfg.zero_stage)
        if 0 in stages:  # ZeRO-0 keeps the whole optimizer state in one file, loadable at any size
            return False
        return record["world_size"] != self.world_size or stages[0] != stages[1]

    def _needs_universal(self, slot: Path, record: dict) -> bool:
        saved, now = record["zero_stage"], self.cfg.zero_stage
        if saved != now and 0 in (saved, now):
            raise SpecdraftError(f"{slot}: saved at ZeRO-{saved}, this run has ZeRO-{now}; DeepSpeed converts "
                                 f"between ZeRO stages 1-3 only (set zero_stage: {saved})")
        return self._universal_needed(record)

    def _check_compatible(self, slot_dir: Path, record: dict) -> None:
        cfg = self.cfg
        if record.get("config_hash") != config_hash(cfg):
            raise SpecdraftError(f"{slot_dir}: saved with draft {record['draft']['dims']}; this run's draft or "
                                 f"max_seq_length differ (config hash {record.get('config_hash')} != "
                                 f"{config_hash(cfg)})")
        if record.get("target_identity") != self.target_identity:
            raise SpecdraftError(f"{slot_dir}: trained against another target than {cfg.target} (its "
                                 f"config.json or weights differ from those of {record['target']})")
        for key in ("precision", "seed"):
            if record.get(key) != cfg[key]:
                raise SpecdraftError(f"{slot_dir}: saved with {key}={record.get(key)}, this run has "
                                     f"{key}={cfg[key]} (set it back to resume)")

    def _adopt_global_batch(self, slot_dir: Path, record: dict, log) -> None:
        """Keep the checkpoint's global batch: gradient_accumulation_steps follows the world size."""
        cfg = self.cfg
        saved = record["global_batch"]
        per_step = cfg.per_device_batch_size * self.world_size
        if saved % per_step:
            raise SpecdraftError(
                f"{slot_dir}: its global batch is {saved} sequences; {self.world_size} rank(s) x "
                f"per_device_batch_size={cfg.per_device_batch_size} = {per_step} does not divide it (choose a "
                f"per_device_batch_size or world size whose product divides {saved})")
        accumulation = saved // per_step
        if accumulation != cfg.gradient_accumulation_steps:
            log(f"resume: gradient_accumulation_steps {cfg.gradient_accumulation_steps} -> {accumulation}, keeping "
                f"the checkpoint's global batch of {saved} sequences on {self.world_size} rank(s) x "
                f"{cfg.per_device_batch_size}")
            cfg.gradient_accumulation_steps = accumulation

    def resume(self, engine, plan: ResumePlan, log: Callable[[str], None]) -> dict:
        """Load the planned slot into the engine (built with load_universal=plan.universal);
        returns our client state (step, sampler, ...)."""
        import torch.distributed as dist

        slot_dir, record = plan.slot, plan.record
        load_dir = slot_dir
        if plan.universal:
            load_dir = self._universal_copy(slot_dir, log)
        # ZeRO-3's universal load gives every param group the hyperparameters of group 0 (weight
        # decay on the norms), and one shared `step` tensor that torch's Adam then increments once
        # per group: put back each group's own hyperparameters (lr is the scheduler's) and step.
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in engine.optimizer.param_groups]
        load_path, client_state = engine.load_checkpoint(
            str(load_dir.parent), tag=load_dir.name, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise SpecdraftError(f"{load_dir}: DeepSpeed found no checkpoint to load there")
        if plan.universal:
            for group, own in zip(engine.optimizer.param_groups, groups):
                group.update(own)
            for param_state in engine.optimizer.optimizer.state.values():
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].clone()
        ours = client_state[CLIENT_KEY]
        # DeepSpeed restores trained parameters only (frozen ones are not in the slot, a universal
        # copy has no buffers): the rest comes back, exactly, from our side file.
        restore_frozen_state(engine.module.draft_model, read_frozen_state(slot_dir), str(slot_dir))
        # The load was non-strict: prove the draft came back, buffers and frozen parameters included.
        loaded = gather_draft_state_dict(engine)
        run_shared(lambda: _check_fingerprint(slot_dir, loaded, record))
        if self.rank < len(ours["rng"]):  # a rank the saving run did not have keeps its seeded RNG
            set_rng_state(ours["rng"][self.rank])
        dist.barrier()
        return ours

    def _universal_copy(self, slot_dir: Path, log) -> Path:
        """The slot's universal copy: made once by rank 0, verified by every rank before loading."""
        out = universal_dir(slot_dir)
        record = read_commit(slot_dir)

        def ensure():
            if (out / COMMITTED).is_file():
                try:
                    if read_commit(out).get("source_commit") != _sha256(slot_dir / COMMITTED):
                        raise SpecdraftError(f"{out}: converted from another {slot_dir.name}")
                    verify_slot(out)
                    log(f"resume: reusing {out} (saved with {record['world_size']} rank(s) at "
                        f"ZeRO-{record['zero_stage']})")
                    return
                except SpecdraftError as err:
                    log(f"resume: {err}; converting again")
                    remove_slot(out)
            started = time.perf_counter()
            convert_to_universal(slot_dir, out)
            log(f"resume: converted {slot_dir.name} (saved with {record['world_size']} rank(s) at ZeRO-"
                f"{record['zero_stage']}) to DeepSpeed's universal format in {time.perf_counter() - started:.1f} s "
                f"for {self.world_size} rank(s) at ZeRO-{self.cfg.zero_stage}: {out}")

        run_shared(ensure)
        run_shared(lambda: verify_slot(out), on_rank=None)  # every rank reads every fragment
        return out


def restore_frozen_state(draft, state: Dict[str, torch.Tensor], source: str) -> None:
    """Collective under ZeRO-3: put a slot's frozen state back into the draft. The family checks
    its own extra state first (e.g. EAGLE-3's maps against those this run built)."""
    import deepspeed

    expected = frozen_state(draft, dict(draft.state_dict(keep_vars=True)))
    if set(state) != set(expected):
        raise SpecdraftError(f"{source}: its frozen draft state holds {sorted(state)}, this run's draft has "
                             f"{sorted(expected)}")
    extra = draft.extra_state()
    draft.load_extra_state({k: state[k] for k in extra}, source=source)
    params = [t for t in expected.values() if isinstance(t, torch.nn.Parameter)]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3), torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.device))


def _move_aside(slot: Path) -> Path:
    """Rename a slot that failed verification out of the slot namespace; nothing is deleted."""
    target = slot.with_name(slot.name + REJECTED_SUFFIX)
    n = 1
    while target.exists():
        target = slot.with_name(f"{slot.name}{REJECTED_SUFFIX}-{n}")
        n += 1
    os.rename(slot, target)
    fsync_dir(slot.parent)
    return target


def resolve_slot(path: Path) -> Path:
    """A slot dir, a run dir or a ckpt dir -> its committed slot; a clear error otherwise."""
    if not path.exists():
        raise SpecdraftError(f"resume: {path} does not exist")
    if _step_of(path.name) is not None and (path.parent.name == CKPT_DIR or (path / COMMITTED).exists()):
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
