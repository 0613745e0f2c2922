"""What a resumed slot must share with the run resuming it, and the one thing a resume adapts: the
global batch, kept by recomputing gradient accumulation for this world size."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specdraft.checkpoint.draft_names import record_names
from specdraft.config import config_hash, data_world, draft_names, draft_view, identity_change
from specdraft.errors import SpecdraftError


def check_compatible(slot_dir: Path, record: dict, cfg: DictConfig, target_identity: str) -> None:
    """A slot this run may resume: the same drafts (names, family, identity), target, precision and
    seed; else one line saying what differs and how to resume or start anew."""
    names = draft_names(cfg)
    if record_names(record) != names:
        saved, ours = (
            ("one draft (draft:)" if found == [None] else f"the drafts {', '.join(found)}")
            for found in (record_names(record), names)
        )
        raise SpecdraftError(
            f"{slot_dir}: saved a run of {saved}; this run trains {ours} (to start anew: a new output_dir)"
        )
    if names != [None]:
        for name in names:
            view, saved = draft_view(cfg, name), record["drafts"][name]
            if saved.get("config_hash") != config_hash(view):
                raise SpecdraftError(f"{slot_dir}: draft {name}: {identity_change(saved.get('config_identity'), view)}")
    elif record["draft"].get("family", cfg.draft.type) != cfg.draft.type:  # a DFlash slot resumed as DSpark
        raise SpecdraftError(
            f"{slot_dir}: a {record['draft']['family']} draft's checkpoint; this run trains draft.type {cfg.draft.type!r}"
        )
    elif record.get("config_hash") != config_hash(cfg):
        raise SpecdraftError(f"{slot_dir}: {identity_change(record.get('config_identity'), cfg)}")
    if record.get("target_identity") != target_identity:
        raise SpecdraftError(
            f"{slot_dir}: trained against another target than {cfg.target} (its "
            f"config.json or weights differ from those of {record['target']})"
        )
    for key in ("precision", "seed"):
        if record.get(key) != cfg[key]:
            raise SpecdraftError(
                f"{slot_dir}: saved with {key}={record.get(key)}, this run has {key}={cfg[key]} (set it back to resume)"
            )


def adopt_global_batch(slot_dir: Path, record: dict, cfg: DictConfig, world_size: int, log) -> None:
    """Keep the checkpoint's global batch: gradient_accumulation_steps follows the world size."""
    saved = record["global_batch"]
    per_step = cfg.per_device_batch_size * data_world(cfg, world_size)
    if saved % per_step:
        raise SpecdraftError(
            f"{slot_dir}: its global batch is {saved} sequences; {per_step // cfg.per_device_batch_size} data-parallel rank(s) x "
            f"per_device_batch_size={cfg.per_device_batch_size} = {per_step} does not divide it (choose a "
            f"per_device_batch_size or world size whose product divides {saved})"
        )
    accumulation = saved // per_step
    if accumulation != cfg.gradient_accumulation_steps:
        log(
            f"resume: gradient_accumulation_steps {cfg.gradient_accumulation_steps} -> {accumulation}, keeping "
            f"the checkpoint's global batch of {saved} sequences on {world_size} rank(s) x "
            f"{cfg.per_device_batch_size}"
        )
        cfg.gradient_accumulation_steps = accumulation
