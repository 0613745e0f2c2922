"""EAGLE-3 in the files serving engines load.

speculators (vLLM):  config.json (Eagle3SpeculatorConfig fields) + model.safetensors with the
    draft's own keys: fc.weight, layers.0.*, norm.weight, lm_head.weight, d2t, t2d (and
    fc_norm.* / input_norm.weight with those flags), plus embed_tokens.weight: the target's,
    read from its files. REFERENCE calls it optional, but speculators 0.9.0 only fills a missing
    embed_tokens from the verifier when it is NaN, and under transformers 5.19 a missing weight
    comes back as uninitialised memory (measured: its draft logits were garbage without it). vLLM
    loads it when present. d2t/t2d are left out when the draft vocab is the whole target vocab
    (speculators then has no such buffers).
SGLang (LlamaForCausalLMEagle3): a Llama config with num_hidden_layers 1, draft_vocab_size,
    target_hidden_size, eagle_config; the decoder layer's keys are midlayer.* instead of
    layers.0.*. SGLang skips names it does not know, silently, so flags it has no weights for are
    refused here instead.

Layer ids. Ours are vLLM's: id i is the input of target layer i (0: the embeddings), captured
before layer i runs (vLLM LlamaModel.forward), so only ids 0..L-1 exist for a server. SGLang's
set_eagle3_layers_to_capture captures val + 1 for every id it is given, i.e. its id i is the
output of layer i: it gets ours minus one, and cannot name the embeddings (0 would be -1).
A layer a format cannot capture is refused in one line (serving_refusal), never written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from safetensors.torch import save_file

from specdraft.drafts.base import FileFormat, config_fields, uncapturable_layer
from specdraft.errors import SpecdraftError
from specdraft.target.config_file import read_target_config
from specdraft.target.weights import load_target_head_weights

SPECULATORS_VERSION = "0.9.0"  # the speculators release this format was checked against
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# speculators' config field -> the draft key it records: what an import (draft.init_from) reads
# back of what speculators_config writes (tests/test_imports.py checks the two agree)
SPECULATORS_SETTINGS = {
    "eagle_aux_hidden_state_layer_ids": "target_layers",
    "norm_before_residual": "norm_before_residual",
    "norm_before_fc": "norm_before_fc",
    "fc_norm": "fc_norm",
    "norm_output": "norm_output",
}


def speculators_config(draft, target_dir: str) -> Dict[str, Any]:
    d = draft.dims
    verifier = read_target_config(target_dir)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": d.transformer_layer_config(),
        "draft_vocab_size": d.draft_vocab_size,
        "target_hidden_size": d.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(d.target_layers),  # vLLM's ids: ours
        "norm_before_residual": d.norm_before_residual,  # vLLM assumes True when missing: always written
        "norm_before_fc": d.norm_before_fc,
        "fc_norm": d.fc_norm,
        "norm_output": d.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": d.ttt_steps}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": str(Path(target_dir).resolve()),
                "architectures": verifier.get("architectures", []),
            },
        },
    }


def legacy_rope_keys(rope_parameters: Dict[str, Any]) -> Dict[str, Any]:
    """rope_theta and rope_scaling as transformers 4 spells them: SGLang's LlamaDecoderLayer reads
    getattr(config, "rope_theta", 10000) and getattr(config, "rope_scaling", None), not
    rope_parameters, so without them a Llama-3.1 draft would be served at theta 10000, unscaled."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    else:
        scaling.setdefault("type", scaling["rope_type"])  # older readers look for "type"
    return {"rope_theta": rope_parameters.get("rope_theta", 10000.0), "rope_scaling": scaling}


def sglang_config(draft) -> Dict[str, Any]:
    d = draft.dims
    config = d.transformer_layer_config()
    config.update(legacy_rope_keys(d.rope_parameters))
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        draft_vocab_size=d.draft_vocab_size,
        target_hidden_size=d.target_hidden_size,
        norm_before_residual=d.norm_before_residual,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(d.target_layers),
            "use_aux_hidden_state": True,
        },
    )
    return config


def sglang_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in state_dict.items()}


def sglang_settings(config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What an EAGLE / SGLang config.json records of the draft: its layer ids, in ours (official
    EAGLE-3 releases have no eagle_config; they read vLLM's default layers)."""
    ids = ((config or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return {} if ids is None else {"target_layers": [int(i) + 1 for i in ids]}


def speculators_implied(draft) -> Dict[str, torch.Tensor]:
    """With the whole target vocab speculators has no d2t / t2d: the identity maps."""
    d = draft.dims
    if d.draft_vocab_size != d.vocab_size:
        return {}
    return {"d2t": torch.zeros(d.draft_vocab_size, dtype=torch.long), "t2d": torch.ones(d.vocab_size, dtype=torch.bool)}


FILE_FORMATS = {
    "speculators": FileFormat(
        lambda draft, state: speculators_state_dict(draft, state),  # defined below
        config_fields(SPECULATORS_SETTINGS),
        speculators_implied,
    ),
    # SGLang's layout is the official EAGLE-3 releases' (midlayer.*, .bin or safetensors)
    "sglang": FileFormat(lambda draft, state: sglang_state_dict(state), sglang_settings),
}


def save_export(out_dir: Path, config: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
        str(out_dir / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2))


def speculators_state_dict(draft, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """speculators' model has d2t/t2d buffers only when the draft vocab is smaller than the
    target's: with the whole vocab they would be unexpected keys."""
    if draft.dims.draft_vocab_size == draft.dims.vocab_size:
        return {k: v for k, v in state_dict.items() if k not in ("d2t", "t2d")}
    return dict(state_dict)


def write_speculators(
    draft,
    state_dict: Dict[str, torch.Tensor],
    out_dir: Path,
    target_dir: str,
    config=speculators_config,
    state=speculators_state_dict,
    embeddings=lambda draft, state_dict, embed_tokens: embed_tokens,
) -> None:
    """The speculators export: `state` of the draft's tensors, the target's embed_tokens as
    `embeddings` gives them, `config`'s config.json. P-EAGLE passes its own three (peagle/export.py)."""
    refuse_unservable(draft, "speculators")
    tensors = state(draft, state_dict)
    heads = load_target_head_weights(
        target_dir,
        dtype=state_dict["fc.weight"].dtype,
        expected_vocab=draft.dims.vocab_size,
        expected_hidden=draft.dims.hidden_size,
    )
    tensors["embed_tokens.weight"] = embeddings(draft, state_dict, heads.embed_tokens)
    save_export(Path(out_dir), config(draft, target_dir), tensors)


def sglang_layer_ids(layers: List[int]) -> List[int]:
    """Ours (vLLM's input of layer i) -> SGLang's: it captures layer val + 1's input."""
    return [layer - 1 for layer in layers]


def sglang_unsupported(dims) -> List[str]:
    """The serving flags set on this draft that SGLang's LlamaForCausalLMEagle3 does not read."""
    # its midlayer takes residual = hidden_states: no norm_before_residual either
    return [
        flag for flag in ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output") if getattr(dims, flag)
    ]


def serving_refusal(dims, fmt: str) -> Optional[str]:
    """Why `fmt` ("speculators" or "sglang") cannot serve this draft as trained, in one line; None
    when it can."""
    uncapturable = uncapturable_layer(dims.target_layers, dims.target_num_layers)
    if uncapturable:
        return uncapturable
    if fmt == "sglang":
        unsupported = sglang_unsupported(dims)
        if unsupported:
            return (
                f"draft.{unsupported[0]}: SGLang's LlamaForCausalLMEagle3 has no such option "
                f"(export --format speculators for vLLM instead)"
            )
        if 0 in dims.target_layers:
            return (
                "draft.target_layers: layer 0 (the embeddings) has no SGLang id (SGLang captures id + 1, "
                "so it would need -1); export --format speculators for vLLM instead"
            )
    return None


def refuse_unservable(draft, fmt: str) -> None:
    refusal = serving_refusal(draft.dims, fmt)
    if refusal:
        raise SpecdraftError(refusal)


def write_sglang(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    refuse_unservable(draft, "sglang")
    save_export(Path(out_dir), sglang_config(draft), sglang_state_dict(state_dict))
