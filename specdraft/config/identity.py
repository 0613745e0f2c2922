"""What a checkpoint records of the configuration that wrote it: the draft's identity (what a resume
must match) and the resolved config.yaml of the run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from specdraft.config.schema import PER_DRAFT_KEYS
from specdraft.config.several import draft_view
from specdraft.config.validate import _target_config_if_readable
from specdraft.drafts import SHARED_KEYS, draft_family, family_keys
from specdraft.rundir.atomic import write_atomic


def config_identity(cfg: DictConfig) -> dict:
    """Identity of the draft a checkpoint holds: draft architecture and data layout. (The target is
    identified by its content, see target.weights.target_identity, not by its path.) A run of
    several drafts: the identity of each, by name."""
    if cfg.get("drafts") is not None:
        return {name: config_identity(draft_view(cfg, name)) for name in cfg.drafts}
    draft = own_draft_keys(cfg)
    draft.pop("init_from", None)  # where a run started, not what it trains: resume ignores it
    draft.pop("gradient_checkpointing", None)  # memory, not the draft: a resume may switch it
    draft = draft_family(cfg.draft.type).identity_options(draft, _target_config_if_readable(cfg.target))
    return {"draft": draft, "max_seq_length": cfg.max_seq_length}


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(config_identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def identity_change(saved: Optional[dict], cfg: DictConfig) -> str:
    """Why a checkpoint's identity (its COMMITTED `config_identity`) differs from this run's: each
    differing key with both values. A checkpoint from before that record: its hash only."""
    if not saved:
        return (
            "saved with another draft or max_seq_length (config hash differs; this checkpoint does not record its keys)"
        )
    old, new = _dotted(saved), _dotted(config_identity(cfg))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, "unset") != new.get(k, "unset"))
    changes = ", ".join(f"{k}: saved {old.get(k, 'unset')!r}, this run {new.get(k, 'unset')!r}" for k in keys)
    return f"saved with other settings ({changes}); set them back to resume, or choose a new output_dir"


def _dotted(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def own_draft_keys(cfg: DictConfig) -> dict:
    """`draft.type`, `draft.init_from` (when set) and the keys its family reads: another family's
    defaults are not part of this draft (adding a key to one family leaves the others' checkpoints
    resumable)."""
    own = family_keys(draft_family(cfg.draft.type))
    draft = OmegaConf.to_container(cfg.draft, resolve=True)
    return {
        key: value
        for key, value in draft.items()
        if key in own or key == "type" or (key in SHARED_KEYS and value is not None)
    }


def resolved_config_yaml(cfg: DictConfig) -> str:
    """The resolved config with every default, its `draft:` section limited to the family's own
    keys: what a run records in config.yaml and `specdraft config` prints."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if cfg.get("drafts") is None:
        resolved.pop("drafts", None)  # a one-draft run's file as it always was
        resolved["draft"] = own_draft_keys(cfg)
    else:
        del resolved["draft"]
        resolved["drafts"] = {
            name: dict(own_draft_keys(draft_view(cfg, name)), **{k: v for k, v in entry.items() if k in PER_DRAFT_KEYS})
            for name, entry in resolved["drafts"].items()
        }
    return OmegaConf.to_yaml(OmegaConf.create(resolved))


def save_config(cfg: DictConfig, path: Path) -> None:
    write_atomic(path, resolved_config_yaml(cfg))
