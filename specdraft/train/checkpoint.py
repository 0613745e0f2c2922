"""Crash-safe checkpoints that resume exactly. Only this module knows the on-disk layout.

run/
  config.yaml
  ckpt/step_<N>/            DeepSpeed state of the draft only (params, optimizer, scheduler)
  ckpt/step_<N>/COMMITTED   written last by rank 0 after every rank finished: step, world size,
                            ZeRO stage, config hash, sha256 of every file in the slot
  ckpt/latest               newest committed slot name (temp file + fsync + rename)
  step_<N>/                 draft export (see export.py)

A slot without COMMITTED does not exist for resume. A new save never overwrites a committed slot:
it goes to a fresh step_<N> and older slots are pruned only after it is committed, so `keep_last`
committed slots survive a crash at any instant (keep_last=2 is LongSpec's last_ds/last_2ds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from specdraft.config import config_hash
from specdraft.errors import SpecdraftError
from specdraft.train.collectives import any_rank, broadcast_error
from specdraft.train.rng import rng_state, set_rng_state

CKPT_DIR = "ckpt"
SLOT_PREFIX = "step_"
COMMITTED = "COMMITTED"
LATEST = "latest"
CLIENT_KEY = "specdraft"
# Test hook: seconds to sleep after each file DeepSpeed writes and between our commit steps, to
# widen the window in which a crash test can kill a save.
PAUSE_ENV = "SPECDRAFT_SAVE_PAUSE_S"


# -- the slot directory -------------------------------------------------------------------------

def slot_name(step: int) -> str:
    return f"{SLOT_PREFIX}{step}"


def slot_step(path: Path) -> int:
    return int(path.name[len(SLOT_PREFIX):])


def committed_slots(ckpt_dir: Path) -> List[Path]:
    """Slots with a COMMITTED marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    slots = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and p.name.startswith(SLOT_PREFIX) and p.name[len(SLOT_PREFIX):].isdigit()
             and (p / COMMITTED).is_file()]
    return sorted(slots, key=slot_step)


def newest_committed(ckpt_dir: Path) -> Optional[Path]:
    latest = ckpt_dir / LATEST
    if latest.is_file():
        named = ckpt_dir / latest.read_text().strip()
        if (named / COMMITTED).is_file():
            return named
    slots = committed_slots(ckpt_dir)  # `latest` missing or stale: the markers are the truth
    return slots[-1] if slots else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _slot_files(slot_dir: Path) -> List[Path]:
    return sorted(p for p in slot_dir.rglob("*") if p.is_file() and p.name != COMMITTED)


def write_atomic(path: Path, text: str) -> None:
    """temp file + fsync + rename + fsync(dir): readers see the old content or the new, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_commit(slot_dir: Path) -> dict:
    marker = slot_dir / COMMITTED
    if not marker.is_file():
        raise SpecdraftError(f"{slot_dir}: no {COMMITTED} marker (an interrupted save); it cannot be resumed")
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise SpecdraftError(f"{marker}: not valid JSON (damaged checkpoint marker)") from None


def verify_slot(slot_dir: Path) -> dict:
    """Check every file against the COMMITTED manifest BEFORE anything unpickles it."""
    record = read_commit(slot_dir)
    expected = record.get("files", {})
    present = {str(p.relative_to(slot_dir)) for p in _slot_files(slot_dir)}
    for name in sorted(set(expected) - present):
        raise SpecdraftError(f"{slot_dir / name}: listed in {COMMITTED} but missing")
    for name in sorted(present - set(expected)):
        raise SpecdraftError(f"{slot_dir / name}: not in the {COMMITTED} manifest (refusing to load it)")
    for name, entry in expected.items():
        path = slot_dir / name
        if path.stat().st_size != entry["bytes"]:
            raise SpecdraftError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                                 f"(truncated or replaced)")
        if _sha256(path) != entry["sha256"]:
            raise SpecdraftError(f"{path}: sha256 does not match the {COMMITTED} manifest (modified)")
    return record


# -- what DeepSpeed does not save -----------------------------------------------------------------

def draft_fingerprint(weights: Dict[str, torch.Tensor]) -> Dict[str, List[float]]:
    """Per-tensor (sum, sum of squares) of the draft's weights. Saved with each slot and compared
    after a load: proof that the draft came back."""
    return {name: [float(t.double().sum()), float(t.double().pow(2).sum())] for name, t in weights.items()}


# -- the manager ------------------------------------------------------------------------------

class CheckpointManager:
    def __init__(self, run_dir: Path, cfg: DictConfig, rank: int, world_size: int):
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / CKPT_DIR
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.pause = float(os.environ.get(PAUSE_ENV, "0") or 0)

    # -- save ---------------------------------------------------------------------------------

    def save(self, engine, step: int, client_state: dict, draft_weights: Optional[dict]) -> Path:
        """Every rank calls (draft_weights: the gathered draft on rank 0, None elsewhere).
        Returns the committed slot; raises on every rank if any rank failed."""
        import torch.distributed as dist

        slot_dir = self.ckpt_dir / slot_name(step)
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            if slot_dir.exists():  # leftovers (another world size, a crash) must not mix in
                shutil.rmtree(slot_dir)
        dist.barrier()
        rng = [None] * self.world_size
        dist.all_gather_object(rng, rng_state())
        state = {CLIENT_KEY: dict(client_state, rng=rng, config_hash=config_hash(self.cfg))}
        error = None
        try:
            with self._paused_writes(engine):
                engine.save_checkpoint(str(self.ckpt_dir), tag=slot_dir.name, client_state=state,
                                       save_latest=False, exclude_frozen_parameters=True)
        except Exception as err:  # surfaced on all ranks below instead of a hang in a barrier
            error = err
        if any_rank(error is not None):
            raise error or RuntimeError(f"checkpoint save of {slot_dir} failed on another rank")
        dist.barrier()  # every rank's files are on disk before the commit
        if self.rank == 0:
            self._commit(slot_dir, engine, step, draft_fingerprint(draft_weights))
            self._prune()
        dist.barrier()
        return slot_dir

    def _commit(self, slot_dir: Path, engine, step: int, fingerprint: dict) -> None:
        files = {}
        for path in _slot_files(slot_dir):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files[str(path.relative_to(slot_dir))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        record = {"step": step, "world_size": self.world_size, "zero_stage": self.cfg.zero_stage,
                  "precision": self.cfg.precision, "config_hash": config_hash(self.cfg),
                  "target": os.path.abspath(self.cfg.target),
                  "draft": engine.module.draft_model.export_config(),
                  "draft_fingerprint": fingerprint, "files": files, "time": time.time()}
        self._sleep()
        write_atomic(slot_dir / COMMITTED, json.dumps(record, indent=1))
        self._sleep()
        write_atomic(self.ckpt_dir / LATEST, slot_dir.name)

    def _prune(self) -> None:
        """Keep the newest keep_last committed slots; delete every other slot older than the newest
        (older committed ones, and uncommitted leftovers of crashed saves)."""
        keep = committed_slots(self.ckpt_dir)[-self.cfg.keep_last:]
        newest = slot_step(keep[-1])
        for path in self.ckpt_dir.iterdir():
            if (path.is_dir() and path.name.startswith(SLOT_PREFIX) and path.name[len(SLOT_PREFIX):].isdigit()
                    and path not in keep and slot_step(path) < newest):
                (path / COMMITTED).unlink(missing_ok=True)  # un-commit first: a half-deleted slot is invalid
                shutil.rmtree(path)

    def _sleep(self) -> None:
        if self.pause:
            time.sleep(self.pause)

    @contextlib.contextmanager
    def _paused_writes(self, engine):
        """With the test pause set, sleep after every file DeepSpeed writes."""
        if not self.pause:
            yield
            return
        original = engine.checkpoint_engine.save

        def save_then_pause(*args, **kwargs):
            result = original(*args, **kwargs)
            self._sleep()
            return result

        engine.checkpoint_engine.save = save_then_pause
        try:
            yield
        finally:
            engine.checkpoint_engine.save = original

    # -- resume -------------------------------------------------------------------------------

    def slot_to_resume(self) -> Optional[Path]:
        """The committed slot `resume:` names; None to start fresh. Raises on a bad request."""
        mode = str(self.cfg.resume)
        if mode == "no":
            return None
        if mode == "auto":
            return newest_committed(self.ckpt_dir)
        return resolve_slot(Path(mode))

    def resume(self, engine, slot_dir: Path) -> dict:
        """Load the slot into the engine; returns our client state (step, sampler, ...)."""
        import torch.distributed as dist

        record = broadcast_error(lambda: verify_slot(slot_dir), self.rank)
        self._check_compatible(slot_dir, record)
        load_path, client_state = engine.load_checkpoint(
            str(slot_dir.parent), tag=slot_dir.name, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise SpecdraftError(f"{slot_dir}: DeepSpeed found no checkpoint to load there")
        # Frozen params were excluded, so the load was non-strict: prove the draft came back.
        from specdraft.train.export import gather_draft_state_dict

        loaded = gather_draft_state_dict(engine)
        broadcast_error(lambda: _check_fingerprint(slot_dir, loaded, record), self.rank)
        ours = client_state[CLIENT_KEY]
        set_rng_state(ours["rng"][self.rank])
        dist.barrier()
        return ours

    def _check_compatible(self, slot_dir: Path, record: dict) -> None:
        if record["config_hash"] != config_hash(self.cfg):
            raise SpecdraftError(
                f"{slot_dir}: saved for target {record['target']} with draft {record['draft']['dims']}; "
                f"this run's target/draft/max_seq_length differ (config hash {record['config_hash']} "
                f"!= {config_hash(self.cfg)})")
        if record["world_size"] != self.world_size or record["zero_stage"] != self.cfg.zero_stage:
            raise SpecdraftError(
                f"{slot_dir}: saved with {record['world_size']} rank(s) at ZeRO-{record['zero_stage']}, "
                f"this run has {self.world_size} rank(s) at ZeRO-{self.cfg.zero_stage}; optimizer state "
                f"only loads at the same data-parallel size and stage (export the draft with "
                f"`specdraft export` and start a new run, or relaunch with the saved size)")


def _check_fingerprint(slot_dir: Path, weights: dict, record: dict) -> None:
    if draft_fingerprint(weights) != record["draft_fingerprint"]:
        raise SpecdraftError(f"{slot_dir}: the draft weights loaded do not match the saved ones")


def resolve_slot(path: Path) -> Path:
    """A slot dir, a run dir or a ckpt dir -> its committed slot; a clear error otherwise."""
    if not path.exists():
        raise SpecdraftError(f"resume: {path} does not exist")
    if path.name.startswith(SLOT_PREFIX) and (path.parent.name == CKPT_DIR or (path / COMMITTED).exists()):
        read_commit(path)  # raises for an uncommitted slot
        return path
    for ckpt_dir in (path / CKPT_DIR, path):
        slot = newest_committed(ckpt_dir)
        if slot is not None:
            return slot
    raise SpecdraftError(f"resume: {path} holds no committed checkpoint")


# -- offline tools: consolidate / export ------------------------------------------------------------

def _run_slot(run_dir, slot: Optional[str] = None, step: Optional[int] = None) -> Tuple[Path, dict]:
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


def consolidated_draft_state_dict(slot_dir: Path, record: dict) -> Dict[str, torch.Tensor]:
    """fp32 draft weights (prefix stripped) from a verified slot, via DeepSpeed's zero_to_fp32."""
    from specdraft.train.export import extract_and_rename

    if record["zero_stage"] == 0:  # zero_to_fp32 does not handle stage 0: the module is saved whole
        states = torch.load(slot_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        full = states["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        full = get_fp32_state_dict_from_zero_checkpoint(str(slot_dir.parent), tag=slot_dir.name,
                                                        exclude_frozen_parameters=True)
    return {k: v.float() for k, v in extract_and_rename(full).items()}


def consolidate_run(run_dir, slot: Optional[str] = None) -> Path:
    from safetensors.torch import save_file

    slot_dir, record = _run_slot(run_dir, slot=slot)
    state_dict = consolidated_draft_state_dict(slot_dir, record)
    out_dir = Path(run_dir) / "consolidated" / slot_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "draft_fp32.safetensors"
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp))
    os.replace(tmp, out)
    return out


EXPORT_FORMATS = ("native", "pth", "safetensors")  # plus each family's serving formats


def export_from_run(run_dir, step: Optional[int] = None, fmt: str = "native",
                    out_dir: Optional[str] = None, with_target_heads: bool = False) -> Path:
    """Write a draft export from a committed slot: `native` (both weight files + config.json), one
    native file (`pth` / `safetensors`), or a serving format of the draft's family (returns the
    directory that engine loads)."""
    from transformers import AutoTokenizer

    from specdraft.drafts import draft_from_export_config
    from specdraft.train.export import NATIVE_FILES, write_draft_export

    slot_dir, record = _run_slot(run_dir, step=step)
    draft = draft_from_export_config(record["draft"])
    if fmt not in EXPORT_FORMATS and fmt not in draft.serving_formats:
        raise SpecdraftError(f"--format {fmt}: a {draft.family} draft exports as "
                             f"{', '.join([*EXPORT_FORMATS, *draft.serving_formats])}")
    # load_state_dict casts into the draft's own dtypes (zero_to_fp32 returns buffers as float too)
    draft.load_state_dict(consolidated_draft_state_dict(slot_dir, record), strict=True)
    state_dict = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    cfg = OmegaConf.load(Path(run_dir) / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(cfg.target) if Path(cfg.target).is_dir() else None
    out = Path(out_dir) if out_dir else Path(run_dir) / f"export_step_{record['step']}"
    heads = None
    if with_target_heads:  # two tensors straight from the target's files: the target is never built
        from specdraft.target.weights import load_target_head_weights

        read = load_target_head_weights(cfg.target, dtype=torch.float32,
                                        expected_hidden=record["draft"]["dims"]["hidden_size"])
        heads = {"embed_tokens.weight": read.embed_tokens, "lm_head.weight": read.lm_head}
    serving = [fmt] if fmt in draft.serving_formats else []
    files = (fmt,) if fmt in NATIVE_FILES else NATIVE_FILES
    written = write_draft_export(out, state_dict, draft, cfg, tokenizer, formats=files, target_heads=heads,
                                 serving=serving)
    return written / fmt if serving else written
