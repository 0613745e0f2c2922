"""An MTP draft in the files serving engines load, and the target's MTP layer read back.

speculators (MTPDraftModel, speculators 0.9.0): config.json with speculators_model_type "mtp",
    num_nextn_predict_layers 1, the target's text config as transformer_layer_config, and
    model.safetensors with the draft's own keys (mtp_layers.0.*: speculators' names, ours). No
    embed_tokens / lm_head: speculators reads them from the verifier (its _keys_to_ignore_on_save).
    Qwen3-Next only among our targets: speculators builds MTP layers for the model types of its
    mtp_model_classes (src/speculators/models/mtp/model_definitions.py: qwen3, qwen3_next,
    qwen3_5_text, qwen3_5_moe_text), not deepseek_v3 or glm4_moe (SPECULATORS_MODEL_TYPES).
stitched: the target directory itself with its MTP tensors (mtp.*, or DeepSeek-V3's / GLM-4.5's
    model.layers.<num_hidden_layers>.*) replaced by the trained layer (every other file and tensor
    as it was), which vLLM serves with
    --speculative-config '{"method": "mtp", "num_speculative_tokens": K}' (vllm/config/speculative.py:
    "mtp" is one of MTPModelTypes; hf_config_override turns model_type qwen3_next into
    qwen3_next_mtp, deepseek_v3 into deepseek_mtp and glm4_moe into glm4_moe_mtp, each with
    n_predict = num_nextn_predict_layers, so the config carries that field).
    It copies the whole target, so a save writes it only when asked for (export --format stitched).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.drafts.base import FileFormat
from specdraft.drafts.mtp.layer import (
    LAYER_CLASSES,
    CheckpointLayout,
    checkpoint_layout,
    ours_from_target,
    target_from_ours,
)
from specdraft.drafts.spec import target_text_config
from specdraft.errors import SpecdraftError
from specdraft.target.config_file import read_target_config
from specdraft.target.weights import load_target_tensors, target_weight_files

SPECULATORS_VERSION = "0.9.0"  # the speculators release this format was checked against
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# vLLM's --speculative-config method for a target's native MTP layer (vllm/config/speculative.py,
# MTPModelTypes; SpeculativeConfig.hf_config_override maps model_type qwen3_next to qwen3_next_mtp)
VLLM_METHOD = "mtp"

# speculators' names are ours: an import (draft.init_from) of its saves maps each tensor to itself
FILE_FORMAT = FileFormat(lambda draft, state: dict(state))


# the model types speculators' MTPDraftModel builds layers for (model_definitions.py, mtp_model_classes)
SPECULATORS_MODEL_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def target_layout(target_dir: str) -> CheckpointLayout:
    """Where the target's checkpoint keeps its MTP layer (its config.json's model type and depth)."""
    config = read_target_config(target_dir)
    text = config.get("text_config") or config
    return checkpoint_layout(text.get("model_type", config.get("model_type")), int(text["num_hidden_layers"]))


def target_has_mtp(target_dir: str) -> bool:
    layout = target_layout(target_dir)
    return any(layout.holds(key) for key in target_weight_files(target_dir))


def target_path(target_config) -> str:
    """The directory the target's config was read from (transformers records it)."""
    return str(getattr(target_config, "_name_or_path", "") or "")


def refuse_target_without_mtp(target_config, source: str) -> None:
    """draft.type mtp fine-tunes a layer the target ships: a target without one is refused, by path."""
    text = target_text_config(target_config)
    path = target_path(target_config) or "the target"
    if text.model_type not in LAYER_CLASSES:
        raise SpecdraftError(
            f"{source}: key 'draft.type': mtp fine-tunes a target's native MTP layer; {path} "
            f"(model_type {text.model_type}) has none in transformers (targets with one: "
            f"qwen3_next checkpoints holding mtp.* tensors, deepseek_v3 and glm4_moe ones holding "
            f"model.layers.<num_hidden_layers>.*)"
        )
    if path != "the target" and not target_has_mtp(path):
        layout = target_layout(path)
        raise SpecdraftError(
            f"{source}: key 'draft.type': mtp fine-tunes a target's native MTP layer; {path} "
            f"has none (no {layout.prefix}* tensors in its weight files)"
        )


def read_target_mtp(target_dir: str, expected: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The target's own MTP layer in our names, checked against the draft's state `expected`
    (names and shapes) and cast to its dtypes."""
    layout = target_layout(target_dir)
    stored = load_target_tensors(target_dir, layout.prefix)
    ours = ours_from_target({key: value for key, value in stored.items() if layout.holds(key)}, layout)
    if not ours:
        raise SpecdraftError(
            f"{target_dir}: no {layout.prefix}* tensors in its weight files (draft.type mtp "
            f"fine-tunes a target's native MTP layer)"
        )
    missing, unexpected = sorted(set(expected) - set(ours)), sorted(set(ours) - set(expected))
    if missing or unexpected:
        raise SpecdraftError(
            f"{target_dir}: its MTP layer does not match the layer its config describes "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, value in ours.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise SpecdraftError(
                f"{target_dir}: its MTP tensor {name} has shape {tuple(value.shape)}, the layer "
                f"its config describes needs {tuple(expected[name].shape)}"
            )
    return {name: value.to(expected[name].dtype) for name, value in ours.items()}


def speculators_config(draft, target_dir: str) -> Dict[str, Any]:
    verifier = read_target_config(target_dir)
    return {
        "speculators_model_type": "mtp",
        "architectures": ["MTPDraftModel"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": dict(draft.dims.target_config),
        "num_nextn_predict_layers": 1,
        "speculators_config": {
            "algorithm": "mtp",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft.dims.num_speculative_steps}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(Path(target_dir).resolve()),
                "architectures": verifier.get("architectures", []),
            },
        },
    }


def speculators_refusal(draft) -> Optional[str]:
    """Why speculators cannot load this draft, in one line; None when it can."""
    model_type = draft.dims.target_config.get("model_type")
    if model_type in SPECULATORS_MODEL_TYPES:
        return None
    return (
        f"speculators' MTPDraftModel builds MTP layers for {', '.join(SPECULATORS_MODEL_TYPES)} targets only "
        f"(its mtp_model_classes), not {model_type}; export --format stitched: the target with the trained "
        f"layer, which vLLM serves with method mtp"
    )


def write_speculators(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    refusal = speculators_refusal(draft)
    if refusal:
        raise SpecdraftError(refusal)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()},
        str(out_dir / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    (out_dir / CONFIG_NAME).write_text(json.dumps(speculators_config(draft, target_dir), indent=2))


def write_stitched(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    """A copy of the target directory whose mtp.* tensors are the trained ones (in the target's
    names, layout and dtypes); files without mtp.* tensors are hard-linked where the filesystem
    allows, else copied."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    layout = target_layout(str(target_dir))
    trained = target_from_ours(state_dict, layout)
    weight_map = target_weight_files(target_dir)
    stored = {key for key in weight_map if layout.holds(key)}
    if set(trained) != stored:
        raise SpecdraftError(
            f"{target_dir}: its {layout.prefix}* tensors are not the trained layer's "
            f"({len(stored)} stored, {len(trained)} trained); stitch into the target it was trained on"
        )
    rewrite = {Path(weight_map[key]).name for key in stored}
    if any(not name.endswith(".safetensors") for name in rewrite):
        raise SpecdraftError(
            f"{target_dir}: its MTP layer is in a pickle (.bin) file; a stitched export rewrites safetensors files only"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(target_dir.iterdir()):
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name)
        elif path.name in rewrite:
            _rewrite(path, out_dir / path.name, trained)
        elif path.name == CONFIG_NAME:
            config = json.loads(path.read_text())
            config.setdefault("num_nextn_predict_layers", 1)  # vLLM's n_predict (qwen3_next, deepseek_v3, glm4_moe)
            (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        else:
            _link_or_copy(path, out_dir / path.name)


def _rewrite(source: Path, dest: Path, trained: Dict[str, torch.Tensor]) -> None:
    with safe_open(str(source), framework="pt", device="cpu") as file:
        metadata = file.metadata()
        tensors = {}
        for key in file.keys():
            tensor = file.get_tensor(key)
            tensors[key] = (
                trained[key].detach().to("cpu", tensor.dtype).contiguous().clone() if key in trained else tensor
            )
    save_file(tensors, str(dest), metadata=metadata)


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
