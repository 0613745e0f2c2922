"""The MTP demo target (preset architecture "qwen3_next"): a Qwen3-Next-shaped model and the native
MTP layer pre-trained beside it, saved as Qwen's checkpoints hold one (mtp.* tensors beside the
model's, `num_nextn_predict_layers: 1` in config.json), which `draft.type: mtp` fine-tunes.

The layer is the one draft.type mtp builds (drafts/mtp/layer.py, speculators' definition): at
position t it reads the target's final hidden state and the embedding of x_{t+1} and predicts
x_{t+2} through the target's lm_head. It learns from the target's detached outputs, so the target
pre-trains exactly as it would alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from specdraft.drafts.mtp.layer import build_mtp_layer, init_layer_weights, rotary_embedding, target_from_ours
from specdraft.demo.presets import DemoPreset
from specdraft.target.checkpoint_files import SAFETENSORS_INDEX

MTP_FILE = "model-mtp.safetensors"  # the layer's own shard, listed in the index like the others


def qwen3_next_config(p: DemoPreset, vocab_size: int, special_ids: dict) -> Qwen3NextConfig:
    """Every layer full attention (decoding rolls its KV cache back; Gated DeltaNet states do not
    roll back), 4 experts of which 2 per token, and a shared expert, as Qwen3-Next routes."""
    head_dim = p.hidden_size // p.num_attention_heads
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        moe_intermediate_size=p.intermediate_size // 2,
        shared_expert_intermediate_size=p.intermediate_size // 2,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=p.num_hidden_layers,
        layer_types=["full_attention"] * p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        dtype="float32",
        **special_ids,
    )


class MTPHead(nn.Module):
    """The native MTP layer and the rotary table it attends with."""

    def __init__(self, config: Qwen3NextConfig, seed: int):
        super().__init__()
        self.layer = build_mtp_layer(config)
        self.rotary = rotary_embedding(config)
        init_layer_weights(self.layer, config.initializer_range, seed)

    def loss(self, model: Qwen3NextForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's next-token loss, the layer's x_{t+2} loss) on (B, T) tokens."""
        hidden = model.model(input_ids=batch).last_hidden_state  # after the final norm, as captured
        head = model.lm_head.weight
        target_loss = F.cross_entropy(F.linear(hidden[:, :-1], head).flatten(0, 1), batch[:, 1:].flatten())
        T = batch.shape[1]
        positions = torch.arange(T - 2).expand(batch.shape[0], -1)
        cos, sin = self.rotary(hidden, positions)
        out = self.layer(hidden[:, :-2].detach(), model.model.embed_tokens(batch[:, 1:-1]).detach(), (cos, sin))
        mtp_loss = F.cross_entropy(F.linear(out, head.detach()).flatten(0, 1), batch[:, 2:].flatten())
        return target_loss, mtp_loss


def save_mtp_layer(head: MTPHead, directory: Path) -> None:
    """Add the layer to a saved target: its tensors in their own shard under the checkpoint's
    mtp.* names, the index listing them, config.json's num_nextn_predict_layers (vLLM's n_predict)."""
    tensors = target_from_ours({f"mtp_layers.0.{k}": v for k, v in head.layer.state_dict().items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / MTP_FILE), metadata={"format": "pt"})
    index_path = directory / SAFETENSORS_INDEX  # the build saves sharded (target.SHARDS): an index
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
    metadata = index.setdefault("metadata", {})
    if "total_size" in metadata:
        metadata["total_size"] += sum(v.numel() * v.element_size() for v in tensors.values())
    index_path.write_text(json.dumps(index, indent=2))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
