"""A draft export on disk: self-describing weights that rebuild the draft without the trainer.

export_dir/
  model.safetensors          the draft's weights (no target tensors, no prefix)
  config.json                {"architecture", "dims", "target": {...}, "specdraft_version", ...}
  draft_model_weights.pth    the same weights as a torch state dict (LongSpec's file)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from specdraft.drafts import Draft, draft_from_export_config
from specdraft.errors import SpecdraftError

SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
PTH_NAME = "draft_model_weights.pth"
TARGET_HEADS_NAME = "target_heads.safetensors"


def read_export_config(export_dir) -> Dict[str, Any]:
    path = Path(export_dir) / CONFIG_NAME
    if not path.is_file():
        raise SpecdraftError(f"{path}: not found (not a specdraft draft export)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpecdraftError(f"{path}: not valid JSON ({err.msg})") from None
    if "architecture" not in config or "dims" not in config:
        raise SpecdraftError(f"{path}: missing 'architecture' or 'dims' (not a specdraft draft export)")
    return config


def load_exported_draft(export_dir, dtype: torch.dtype = torch.float32) -> Tuple[Draft, Dict[str, Any]]:
    """Rebuild the draft from config.json and load its weights strictly (no key patching)."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    draft = draft_from_export_config(config)
    weights = export_dir / SAFETENSORS_NAME
    if weights.is_file():
        state_dict = load_file(str(weights))
    elif (export_dir / PTH_NAME).is_file():
        state_dict = torch.load(export_dir / PTH_NAME, map_location="cpu", weights_only=True)
    else:
        raise SpecdraftError(f"{export_dir}: neither {SAFETENSORS_NAME} nor {PTH_NAME} found")
    try:
        draft.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        raise SpecdraftError(f"{weights}: weights do not match config.json: {str(err).splitlines()[0]}") from None
    return draft.cast(dtype).eval(), config  # buffers (rotary inv_freq) stay as in training
