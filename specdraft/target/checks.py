"""What a run's config checks of its target directory, without loading the model: its
transformers config (a supported model type), its tokenizer files, the positions its rope covers,
and the packed documents its layers can keep apart. Light: torch comes with the config classes
only, when a config.json is read."""

from __future__ import annotations

import json
import os

from specdraft.errors import SpecdraftError
from specdraft.target.config_file import read_target_config, target_config_path

# Decoder-only families whose base model exposes embed_tokens, rotary_emb and a K/V cache the
# drafts read, each tested with every draft family (tests/test_target_matrix.py; docs/targets.md
# says which family trains on which, and why the others refuse). Others may work but are not tested.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gpt_oss",
    "gemma3_text",
    "mistral",
    "deepseek_v3",
    "glm4_moe",
    "phi3",
    "qwen3_next",
)


def load_target_config(target_dir: str):
    """The target's transformers config: config.json read first (config_file: a missing or broken
    file is one line), then a model type we support."""
    read_target_config(target_dir)
    from transformers import AutoConfig  # here: its config classes import torch

    config = AutoConfig.from_pretrained(target_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecdraftError(
            f"{target_config_path(target_dir)}: model_type '{config.model_type}' is not "
            f"supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return config


# What AutoTokenizer reads from a model directory: one of them must be there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# RoPE types that stretch the positions a model was pretrained on by `factor` (transformers'
# modeling_rope_utils); "default" and unknown types stretch nothing.
SCALING_ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


def has_tokenizer(model_dir) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES)


def check_tokenizer(model_dir, source: str) -> None:
    if not has_tokenizer(model_dir):
        raise SpecdraftError(
            f"{source}: {model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            f"copy the target model's tokenizer files into it"
        )


def has_chat_template(model_dir) -> bool:
    """As transformers finds one: chat_template.jinja / chat_template.json, or tokenizer_config.json's key."""
    if any(os.path.isfile(os.path.join(model_dir, name)) for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    with open(config, encoding="utf-8") as f:
        return bool(json.load(f).get("chat_template"))


def check_chat_template(model_dir, source: str) -> None:
    """regenerate renders every prompt with the template: refused before anything is written."""
    if not has_chat_template(model_dir):
        raise SpecdraftError(
            f"{source}: {model_dir} has no chat template (a base model?): save one as chat_template.jinja "
            f"in it to regenerate chat answers"
        )


def supported_positions(config) -> int:
    """The longest sequence the target's positions cover: max_position_embeddings, or, with a
    RoPE scaling of `factor` over original_max_position_embeddings (default: the former), their
    product when larger (as transformers reads config.json's rope_scaling / rope_parameters)."""
    limit = config.max_position_embeddings
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if kind in SCALING_ROPE_TYPES and factor:
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        limit = max(limit, int(factor * original))
    return limit


def check_sequence_length(config, max_seq_length: int, source: str) -> None:
    limit = supported_positions(config)
    if max_seq_length > limit:
        scaled = "" if limit == config.max_position_embeddings else f" ({limit} with its rope scaling)"
        raise SpecdraftError(
            f"{source}: key 'max_seq_length': {max_seq_length} is above the target's "
            f"max_position_embeddings {config.max_position_embeddings}{scaled}; positions past "
            f"it were never trained (lower max_seq_length, or use a target whose rope scaling "
            f"covers it)"
        )


def check_packed_documents(config, document_mask: bool, source: str) -> None:
    """Packed conversations attend each to itself through the capture's attention core; a layer
    that carries a recurrent state along the row (Qwen3-Next's linear attention, Gated DeltaNet)
    would hand one conversation's state to the next: refused, naming what trains as one stream."""
    kinds = set(getattr(getattr(config, "text_config", config), "layer_types", None) or ())
    if document_mask and "linear_attention" in kinds:
        raise SpecdraftError(
            f"{source}: key 'document_mask': the target's linear-attention layers carry their "
            f"state across the packed conversations of a row, which the capture cannot reset at "
            f"their borders; set document_mask: false (each row one stream, LongSpec's packing)"
        )
