"""A shape of bench/memory_model.py (a dict: layers, hidden, heads, kv_heads, intermediate, vocab,
batch, seq, window, zero, and optionally family) as the run's config and its Llama target's config:
what both the CPU measurement and the memory model's prediction read."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from specdraft.config import TrainConfig  # noqa: E402


def run_config(spec: dict, precision: str = "fp32"):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.precision = precision
    cfg.zero_stage = spec["zero"]
    cfg.per_device_batch_size = spec["batch"]
    cfg.max_seq_length = spec["seq"]
    cfg.draft.type = spec.get("family", "glide")
    if cfg.draft.type == "glide":
        cfg.draft.sliding_window = spec["window"]
    return cfg


def llama_config(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=4 * spec["seq"],
        tie_word_embeddings=False,
        dtype="float32",
    )
