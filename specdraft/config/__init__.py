"""The run configuration: its schema (schema.py), read from YAML and `key=value` overrides
(load.py), validated once (validate.py); the data files it names, several drafts in one run, what a
checkpoint records of it, and the packaged demo configs. The names other packages use:"""

from specdraft.config.data_files import data_world, resolve_data_files
from specdraft.config.identity import (
    config_hash,
    config_identity,
    identity_change,
    own_draft_keys,
    resolved_config_yaml,
    save_config,
)
from specdraft.config.load import given_draft_keys, load_config, read_yaml
from specdraft.config.packaged import DEMO_CONFIG, PACKAGED_CONFIGS, demo_config_path, family_demo_configs
from specdraft.config.schema import PER_DRAFT_KEYS, PRECISIONS, TARGET_PLACEMENTS, DraftConfig, TrainConfig, WandbConfig
from specdraft.config.several import draft_names, draft_view

__all__ = [
    "DEMO_CONFIG",
    "PACKAGED_CONFIGS",
    "PER_DRAFT_KEYS",
    "PRECISIONS",
    "TARGET_PLACEMENTS",
    "DraftConfig",
    "TrainConfig",
    "WandbConfig",
    "config_hash",
    "config_identity",
    "data_world",
    "demo_config_path",
    "draft_names",
    "draft_view",
    "family_demo_configs",
    "given_draft_keys",
    "identity_change",
    "load_config",
    "own_draft_keys",
    "read_yaml",
    "resolve_data_files",
    "resolved_config_yaml",
    "save_config",
]
