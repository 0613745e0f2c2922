"""A target's config.json, read one way: as a dict, without transformers or torch. Every place
that reads a target's config goes through here (checks.load_target_config first, before
transformers builds its config object), so a missing or broken file is always the same one line
naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.errors import SpecdraftError

CONFIG_NAME = "config.json"


def target_config_path(target_dir) -> Path:
    return Path(target_dir) / CONFIG_NAME


def has_target_config(target_dir) -> bool:
    return target_config_path(target_dir).is_file()


def read_target_config(target_dir) -> dict:
    """target_dir/config.json as a dict."""
    path = target_config_path(target_dir)
    if not path.is_file():
        raise SpecdraftError(f"{path}: missing (not a Hugging Face model directory)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise SpecdraftError(f"{path}: expected a JSON object")
    return config


def read_json(path: Path):
    """A JSON file of the target's (its config, a weight index); unreadable is one line."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        text = str(error).strip()
        raise SpecdraftError(
            f"{path}: not readable JSON ({text.splitlines()[0] if text else type(error).__name__})"
        ) from error
