"""An MTP draft in the files serving engines load, and the target's MTP layer read back.

speculators (MTPDraftModel, speculators 0.9.0): config.json with speculators_model_type "mtp",
    num_nextn_predict_layers 1, the target's text config as transformer_layer_config, and
    model.safetensors with the draft's own keys (mtp_layers.0.*: speculators' names, ours). No
    embed_tokens / lm_head: speculators reads them from the verifier (its _keys_to_ignore_on_save).
stitched: the target directory itself with its mtp.* tensors replaced by the trained layer (every
    other file and tensor as it was), which vLLM serves with
    --speculative-config '{"method": "mtp", "num_speculative_tokens": K}' (vllm/config/speculative.py:
    "mtp" is one of MTPModelTypes; hf_config_override turns model_type qwen3_next into
    qwen3_next_mtp with n_predict = num_nextn_predict_layers, so the config carries that field).
    It copies the whole target, so a save writes it only when asked for (export --format stitched).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.drafts.base import FileFormat
from specdraft.drafts.mtp.layer import TARGET_PREFIX, ours_from_target, target_from_ours
from specdraft.errors import SpecdraftError
from specdraft.target.weights import load_target_tensors, target_weight_files

SPECULATORS_VERSION = "0.9.0"  # the speculators release this format was checked against
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# vLLM's --speculative-config method for a target's native MTP layer (vllm/config/speculative.py,
# MTPModelTypes; SpeculativeConfig.hf_config_override maps model_type qwen3_next to qwen3_next_mtp)
VLLM_METHOD = "mtp"

# speculators' names are ours: an import (draft.init_from) of its saves maps each tensor to itself
FILE_FORMAT = FileFormat(lambda draft, state: dict(state))


def target_has_mtp(target_dir: str) -> bool:
    return any(key.startswith(TARGET_PREFIX) for key in target_weight_files(target_dir))


def read_target_mtp(target_dir: str, expected: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The target's own MTP layer in our names, checked against the draft's state `expected`
    (names and shapes) and cast to its dtypes."""
    ours = ours_from_target(load_target_tensors(target_dir, TARGET_PREFIX))
    if not ours:
        raise SpecdraftError(f"{target_dir}: no mtp.* tensors in its weight files (draft.type mtp fine-tunes a "
                             f"target's native MTP layer)")
    missing, unexpected = sorted(set(expected) - set(ours)), sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise SpecdraftError(f"{target_dir}: its MTP layer does not match the layer its config describes "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, value in ours.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise SpecdraftError(f"{target_dir}: its MTP tensor {name} has shape {tuple(value.shape)}, the layer "
                                 f"its config describes needs {tuple(expected[name].shape)}")
    return {name: value.to(expected[name].dtype) for name, value in ours.items()}


def _target_config(target_dir: str) -> Dict[str, Any]:
    path = Path(target_dir) / CONFIG_NAME
    if not path.is_file():
        raise SpecdraftError(f"{path}: not found (the verifier the export names)")
    return json.loads(path.read_text())


def speculators_config(draft, target_dir: str) -> Dict[str, Any]:
    verifier = _target_config(target_dir)
    return {
        "speculators_model_type": "mtp",
        "architectures": ["MTPDraftModel"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": dict(draft.dims.target_config),
        "num_nextn_predict_layers": 1,
        "speculators_config": {
            "algorithm": "mtp",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": draft.dims.num_speculative_steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(Path(target_dir).resolve()),
                         "architectures": verifier.get("architectures", [])},
        },
    }


def write_speculators(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()},
              str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / CONFIG_NAME).write_text(json.dumps(speculators_config(draft, target_dir), indent=2))


def write_stitched(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    """A copy of the target directory whose mtp.* tensors are the trained ones (in the target's
    names, layout and dtypes); files without mtp.* tensors are hard-linked where the filesystem
    allows, else copied."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    trained = target_from_ours(state_dict)
    weight_map = target_weight_files(target_dir)
    stored = {key for key in weight_map if key.startswith(TARGET_PREFIX)}
    if set(trained) != stored:
        raise SpecdraftError(f"{target_dir}: its mtp.* tensors are not the trained layer's "
                             f"({len(stored)} stored, {len(trained)} trained); stitch into the target it was trained on")
    rewrite = {Path(weight_map[key]).name for key in stored}
    if any(not name.endswith(".safetensors") for name in rewrite):
        raise SpecdraftError(f"{target_dir}: its MTP layer is in a pickle (.bin) file; a stitched export "
                             f"rewrites safetensors files only")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(target_dir.iterdir()):
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name)
        elif path.name in rewrite:
            _rewrite(path, out_dir / path.name, trained)
        elif path.name == CONFIG_NAME:
            config = json.loads(path.read_text())
            config.setdefault("num_nextn_predict_layers", 1)  # vLLM's n_predict for qwen3_next
            (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        else:
            _link_or_copy(path, out_dir / path.name)


def _rewrite(source: Path, dest: Path, trained: Dict[str, torch.Tensor]) -> None:
    with safe_open(str(source), framework="pt", device="cpu") as file:
        metadata = file.metadata()
        tensors = {}
        for key in file.keys():
            tensor = file.get_tensor(key)
            tensors[key] = trained[key].detach().to("cpu", tensor.dtype).contiguous().clone() if key in trained \
                else tensor
    save_file(tensors, str(dest), metadata=metadata)


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
