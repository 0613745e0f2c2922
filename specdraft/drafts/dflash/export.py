"""A DFlash draft in speculators' format (what vLLM serves): config.json + model.safetensors.

    config.json         speculators_model_type "dflash", architectures ["DFlashDraftModel"],
                        transformer_layer_config (the target's config, num_hidden_layers = draft
                        layers, every layer full attention), aux_hidden_state_layer_ids,
                        block_size, sample_from_anchor, mask_token_id, draft_vocab_size,
                        speculators_config {algorithm, proposal_methods, verifier}
    model.safetensors   fc, hidden_norm, layers.*, norm: the draft's own names. No embed_tokens /
                        lm_head: speculators (and vLLM) take them from the verifier.

MASK: speculators embeds it as the verifier's embedding row of `mask_token_id`, re-loaded from
the verifier on every from_pretrained (an embed_tokens tensor in the file would be overwritten).
Our draft embeds MASK as that same row plus its own `mask_delta`, zero unless
draft.train_mask_embedding trained it — so only a zero delta exports exactly; anything else is
refused rather than written wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict

import torch

from specdraft.drafts.base import FileFormat, config_fields, uncapturable_layer
from specdraft.errors import SpecdraftError
from specdraft.target.checks import load_target_config

SPECULATORS_VERSION = "0.9.0"  # the speculators release this format is written (and tested) for
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
NOT_EXPORTED = ("mask_delta",)
# speculators' config field -> the draft key it records: what an import (draft.init_from) reads
# back of what speculators_config writes (tests/test_imports.py checks the two agree)
SPECULATORS_SETTINGS = {
    "aux_hidden_state_layer_ids": "target_layers",
    "sample_from_anchor": "sample_from_anchor",
    "mask_token_id": "mask_token_id",
}


def speculators_state_dict(draft, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    uncapturable = uncapturable_layer(draft.dims.target_layers, draft.dims.target_num_layers)
    if uncapturable:
        raise SpecdraftError(uncapturable)
    delta = state_dict["mask_delta"]
    if bool((delta != 0).any()):
        raise SpecdraftError(
            "speculators' DFlash format embeds MASK with the target's row of mask_token_id "
            "only; this draft trained its own MASK row (draft.train_mask_embedding: true), "
            "so it can be exported natively only"
        )
    return {k: v for k, v in state_dict.items() if k not in NOT_EXPORTED}


def speculators_implied(draft) -> Dict[str, torch.Tensor]:
    """speculators embeds MASK as the verifier's row alone: our mask_delta is zero."""
    return {"mask_delta": torch.zeros(draft.dims.hidden_size)}


FILE_FORMAT = FileFormat(speculators_state_dict, config_fields(SPECULATORS_SETTINGS), speculators_implied)


def transformer_layer_config(draft, target_config) -> dict:
    """The target's config shaped as one of the draft's layers (speculators' convention)."""
    config = target_config.to_diff_dict()
    for key in ("_name_or_path", "transformers_version", "auto_map"):
        config.pop(key, None)
    config["num_hidden_layers"] = draft.dims.num_layers
    config["attention_bias"] = False  # the draft's projections have no bias, whatever the target's
    if "layer_types" in config or hasattr(target_config, "layer_types"):
        config["layer_types"] = ["full_attention"] * draft.dims.num_layers  # no sliding draft layers
    config["use_sliding_window"] = False
    config["tie_word_embeddings"] = False
    return config


def speculators_config(draft, target_config, target_dir: str, dtype: torch.dtype) -> dict:
    dims = draft.dims
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": transformer_layer_config(draft, target_config),
        "draft_vocab_size": dims.vocab_size,  # full vocabulary: lm_head is the verifier's
        "target_hidden_size": None if dims.target_hidden_size == dims.hidden_size else dims.target_hidden_size,
        "aux_hidden_state_layer_ids": list(dims.target_layers),
        "block_size": dims.block_size,
        "sample_from_anchor": dims.sample_from_anchor,
        "mask_token_id": dims.mask_token_id,
        "sliding_window_non_causal": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).replace("torch.", ""),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": draft.layout.predictions,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(target_dir),
                "architectures": list(getattr(target_config, "architectures", None) or []),
            },
        },
    }


def write_speculators_export(
    draft,
    state_dict: Dict[str, torch.Tensor],
    out_dir,
    target_dir: str,
    make_config: Callable[..., dict] = speculators_config,
) -> Path:
    """Write config.json + model.safetensors into out_dir (created; the caller makes it atomic).
    make_config: the config.json of the family (a family on DFlash's backbone passes its own)."""
    from safetensors.torch import save_file

    target_config = load_target_config(str(target_dir))
    tensors = {
        k: v.detach().to("cpu").contiguous().clone() for k, v in speculators_state_dict(draft, state_dict).items()
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    dtype = next(iter(tensors.values())).dtype
    config = make_config(draft, target_config, target_dir, dtype)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return out_dir
