"""What every draft provides, and what it receives from the frozen target.

A draft is an nn.Module holding only its own (trainable) weights. Everything it shares with the
target (embeddings, rotary tables, lm_head) is handed in per call as tensors, so the draft's state
dict never duplicates target weights and ZeRO-3 never has to gather them twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict

import torch
from torch import nn


@dataclass
class TargetFeatures:
    """What one target forward pass gives a draft (all computed under no_grad)."""

    input_embeds: torch.Tensor  # (B, T, H) target embeddings of the input tokens
    cos: torch.Tensor  # (B, T, D) target rotary tables at the input positions
    sin: torch.Tensor  # (B, T, D)
    last_keys: torch.Tensor  # (B, KV, T, D) target's last layer keys, RoPE applied
    last_values: torch.Tensor  # (B, KV, T, D)


class Draft(nn.Module, ABC):
    """Base class: build from the target's config, compute a training loss, describe itself."""

    architecture: str = ""

    @classmethod
    @abstractmethod
    def from_target_config(cls, target_config, draft_cfg) -> "Draft":
        """A draft sized from the target's transformers config and our `draft.` settings."""

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        """Per-batch random choices (e.g. GLIDE's lag), drawn from the loop's seeded generator."""
        return {}

    @abstractmethod
    def training_loss(self, features: TargetFeatures, lm_head_weight: torch.Tensor,
                      input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk_size: int,
                      **options) -> "DraftLoss":
        """Loss of the draft's next-token predictions on the loss-masked tokens."""

    @abstractmethod
    def export_config(self) -> Dict[str, Any]:
        """The JSON-able description written next to exported weights (rebuilds the draft)."""

    def extra_state(self) -> Dict[str, torch.Tensor]:
        """State besides the trainable weights (e.g. EAGLE-3's vocab maps), saved in every
        checkpoint's client state: a universal (elastic) load restores parameters only."""
        return {}

    def load_extra_state(self, state: Dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} holds no extra state, got {sorted(state)}")


@dataclass
class DraftLoss:
    loss: torch.Tensor  # mean CE over counted tokens (what backward sees)
    tokens: int  # how many tokens the loss counted
    correct: int  # top-1 hits among them (the draft's greedy acceptance proxy)
