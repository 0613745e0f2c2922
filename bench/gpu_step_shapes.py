"""The shapes bench/gpu_step.py measures (T x B on a Qwen3-0.6B-like, a Qwen3-8B-like or, on CPU,
a tiny target) and the case's target built at one: random weights created on the device, a
Qwen3-Next of the same dims for a family that drafts only for qwen3_next (MTP)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str  # as it appears in the last line's keys
    model: str  # a label for the table
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    seq: int
    batch: int
    max_positions: int = 40960  # Qwen3's
    rope_theta: float = 1_000_000.0


def qwen3_06b(seq: int, batch: int) -> Shape:
    return Shape(
        f"{seq}x{batch}",
        "Qwen3-0.6B-like",
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        vocab=151_936,
        tied=True,
        seq=seq,
        batch=batch,
    )


def tiny(seq: int, batch: int) -> Shape:
    return Shape(
        f"{seq}x{batch}",
        "tiny",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=256,
        tied=True,
        seq=seq,
        batch=batch,
        max_positions=1024,
        rope_theta=10_000.0,
    )


SHAPES = {
    shape.name: shape
    for shape in (
        qwen3_06b(2048, 1),
        qwen3_06b(2048, 4),
        qwen3_06b(8192, 1),
        qwen3_06b(32768, 1),
        Shape(
            "8b_4096x1",
            "Qwen3-8B-like",
            hidden=4096,
            layers=36,
            heads=32,
            kv_heads=8,
            head_dim=128,
            intermediate=12288,
            vocab=151_936,
            tied=False,
            seq=4096,
            batch=1,
        ),
        tiny(64, 2),
        tiny(128, 1),
    )
}
DEFAULT_SHAPES = {"cuda": "2048x1,2048x4,8192x1,32768x1,8b_4096x1", "cpu": "64x2,128x1"}


class Skip(Exception):
    """A case that cannot be built as asked (the reason is printed)."""


def target_config(shape: Shape, family: str):
    """The transformers config of the case's target: a Qwen3 of the shape, or, for a family that
    drafts only for qwen3_next (MTP), a Qwen3-Next of the same dims."""
    from specdraft.drafts.registry import FAMILIES

    rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tied,
        rope_parameters=rope,
    )
    types = FAMILIES[family].target_model_types
    if types is None or "qwen3" in types:
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if "qwen3_next" not in types:
        raise Skip(f"{family} drafts for {', '.join(types)}: no target of those is built here")
    try:
        from transformers import Qwen3NextConfig

        # MoE of the dense MLP's active width: 2 of 4 experts of intermediate / 4 plus a shared
        # expert of intermediate / 2 (multiples of 16: torch's grouped_mm needs 16-byte strides)
        config = Qwen3NextConfig(
            **common,
            layer_types=["full_attention"] * shape.layers,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=shape.intermediate // 4 // 16 * 16,
            shared_expert_intermediate_size=shape.intermediate // 2 // 16 * 16,
        )
    except Exception as error:  # noqa: BLE001 - any refusal of the config class is the reason to print
        raise Skip(
            f"transformers' Qwen3NextConfig cannot build an MTP-capable {shape.model} shape: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from None
    built = (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    )
    asked = (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab)
    if built != asked or set(config.layer_types) != {"full_attention"}:
        raise Skip(
            f"transformers' Qwen3NextConfig built {built} (hidden, layers, heads, kv heads, head_dim, vocab) "
            f"for {asked}, or layers other than full attention"
        )
    return config


def build_target(config, device: torch.device, dtype: torch.dtype):
    """Seeded random weights created on the device in the training dtype, frozen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)
