"""Several drafts trained from one target pass (`drafts: {name: {type: ..., family keys,
PER_DRAFT_KEYS}}`). Each draft is configured as the same run with its keys under `draft:` would be
(draft_view), so every check, hash and builder of a one-draft run serves each draft."""

from __future__ import annotations

from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from specdraft.config.schema import PER_DRAFT_KEYS, TrainConfig


def draft_names(cfg: DictConfig) -> List[Optional[str]]:
    """The drafts of a run: [None] for a one-draft run (its files where they always were), else
    the names under `drafts:`, in order."""
    return [None] if cfg.get("drafts") is None else [str(name) for name in cfg.drafts]


def draft_view(cfg: DictConfig, name: Optional[str]) -> DictConfig:
    """The run as it would be configured to train draft `name` alone: its keys under `draft:`,
    its PER_DRAFT_KEYS at the top level, no `drafts:`. name None: the one-draft run itself."""
    if name is None:
        return cfg
    entry = OmegaConf.to_container(cfg.drafts[name], resolve=True)
    base = OmegaConf.to_container(cfg, resolve=True)
    base.pop("drafts")
    base["draft"] = {k: v for k, v in entry.items() if k not in PER_DRAFT_KEYS}
    base.update({k: v for k, v in entry.items() if k in PER_DRAFT_KEYS})
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), base)
