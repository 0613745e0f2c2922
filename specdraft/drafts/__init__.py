"""Draft architectures, looked up by the `draft.type` config key or an export's `architecture`."""

from specdraft.drafts.base import Draft, DraftLoss, TargetFeatures
from specdraft.drafts.glide import GlideDraft

DRAFTS = {"glide": GlideDraft}
ARCHITECTURES = {cls.architecture: cls for cls in DRAFTS.values()}


def build_draft(draft_cfg, target_config) -> Draft:
    return DRAFTS[draft_cfg.type].from_target_config(target_config, draft_cfg)


def draft_from_export_config(config: dict) -> Draft:
    return ARCHITECTURES[config["architecture"]].from_export_config(config)


__all__ = ["Draft", "DraftLoss", "TargetFeatures", "GlideDraft", "build_draft", "draft_from_export_config"]
