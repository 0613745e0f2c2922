"""DFlash's decoder layer (queries from the block, keys / values from the context and the block)
and what a head makes of the block's hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.dflash.blocks import BlockVisibility, block_attention
from specdraft.drafts.dflash.options import DFlashDims
from specdraft.drafts.layers import GatedMLP, Projections, RMSNorm, apply_rope


@dataclass
class BlockHead:
    """What a head makes of block hidden states: logits = features @ weight.T, one matmul, so that
    the chunked objective computes them a chunk of rows at a time; confidence: each slot's logit of
    P(the slot is accepted), None for a head without one (DFlash's). state: what a sequential head
    carries to the next slot (DSpark's rnn Markov head), None otherwise."""

    features: torch.Tensor  # (..., F)
    weight: torch.Tensor  # (V, F)
    confidence: Optional[torch.Tensor] = None  # (...,)
    state: Optional[torch.Tensor] = None
    # the trained parameter in weight's last columns when the rest is the frozen lm_head (DSpark's
    # markov_w2): the objective makes its gradient alone (chunked_objective's weight_tail)
    trained_tail: Optional[torch.Tensor] = None
    # (..., ) each slot's previous token, for a head that reranks given it (DFlash2's selector)
    previous_tokens: Optional[torch.Tensor] = None

    def logits(self) -> torch.Tensor:
        return self.features @ self.weight.t().to(self.features.dtype)


class DFlashAttention(Projections):
    """Queries from the block; keys/values from the context and the block, one set of projections."""

    def __init__(self, d: DFlashDims):
        super().__init__(d)
        self.q_norm = RMSNorm(d.head_dim, d.rms_norm_eps)
        self.k_norm = RMSNorm(d.head_dim, d.rms_norm_eps)

    def keys_values(self, x, cos, sin) -> Tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, H) at rotary tables cos/sin (B, T, D) -> K (RoPE applied), V: (B, KV, T, D)."""
        k = apply_rope(self.k_norm(self.heads(self.k_proj(x))), cos, sin)
        return k, self.heads(self.v_proj(x))

    def forward(self, x, cos, sin, context_k, context_v, visibility: Optional[BlockVisibility]):
        q = apply_rope(self.q_norm(self.heads(self.q_proj(x))), cos, sin)  # (B, Hq, Q, D)
        k, v = self.keys_values(x, cos, sin)
        return self.output(
            block_attention(q, torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2), visibility)
        )


class DFlashLayer(nn.Module):
    def __init__(self, d: DFlashDims):
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = DFlashAttention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = GatedMLP(d.hidden_size, d.intermediate_size, d.hidden_act)

    def forward(self, x, cos, sin, context_k, context_v, visibility):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, visibility)
        return x + self.mlp(self.post_attention_layernorm(x))
