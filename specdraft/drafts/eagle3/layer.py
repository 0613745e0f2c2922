"""The EAGLE-3 layer, shared by the families built on it (EAGLE-3, P-EAGLE): the captured-state
fusion fc, one decoder layer over cat(embeds, hidden), the draft-vocab head and its d2t / t2d maps.
Module and parameter names are speculators' saved keys (fc, layers.0.*, norm, lm_head, d2t, t2d).
drafts/eagle3/model.py documents the layer's math and EAGLE-3's training on it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdraft.drafts.base import Draft, TargetFeatures, target_layer_shape, target_text_config
from specdraft.target.attention import PackedDocuments
from specdraft.drafts.eagle3.export import serving_refusal
from specdraft.drafts.eagle3.options import AUX_LAYERS
from specdraft.drafts.layers import GatedMLP, LayerDims, Projections, RMSNorm, apply_rope, attend
from specdraft.target.rotary import draft_rope_parameters
from specdraft.drafts.eagle3.ttt_attention import ttt_attention
from specdraft.drafts.eagle3.vocab import count_target_tokens, draft_to_target_ids, vocab_disagreement, vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.parallel.sequence import SequenceShard

log = logging.getLogger(__name__)

DEFAULT_DRAFT_VOCAB = 32000


def default_target_layers(num_layers: int) -> Tuple[List[int], str]:
    """vLLM's [2, L//2, L-3], or on targets too shallow for three distinct ones, three spread ids;
    in increasing order, the order the servers concatenate them in. Ids 1..L-1 when the target
    has them (every server captures those), else 0..L-1 (vLLM's), else 0..L (native only)."""
    layers = [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) == AUX_LAYERS and min(layers) >= 0:
        return sorted(layers), "vLLM's default [2, L//2, L-3]"
    if num_layers >= AUX_LAYERS + 1:
        candidates = list(range(1, num_layers))
    else:
        candidates = list(range(0, num_layers + 1))
    layers = [candidates[0], candidates[len(candidates) // 2], candidates[-1]]
    return layers, f"[2, L//2, L-3] is not three distinct layers of a {num_layers}-layer target"


def layer_dims(target_config, draft_cfg, family: str) -> Dict[str, Any]:
    """The EAGLE-3 layer's Eagle3Dims fields read from the target and the `draft.` keys (a family
    adds its own: TTT steps, depths ...)."""
    text = target_text_config(target_config)
    # fc's input columns follow the servers' concatenation: increasing layer order
    layers = sorted(int(layer) for layer in draft_cfg.target_layers or [])
    if not layers:
        layers, why = default_target_layers(text.num_hidden_layers)
        log.info("%s: capturing target layer inputs %s (%s)", family, layers, why)
    rope = draft_rope_parameters(target_config)  # its own Llama RoPE over its whole head (target/rotary.py)
    return dict(
        **target_layer_shape(target_config),
        vocab_size=text.vocab_size,
        draft_vocab_size=draft_cfg.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, text.vocab_size),
        target_hidden_size=text.hidden_size,
        target_num_layers=text.num_hidden_layers,
        target_layers=layers,
        rope_parameters=dict(rope),
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        norm_before_residual=bool(draft_cfg.norm_before_residual),
        fc_norm=bool(draft_cfg.fc_norm),
        norm_before_fc=bool(draft_cfg.norm_before_fc),
    )


@dataclass
class Eagle3Dims(LayerDims):
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    target_layers: List[int]  # increasing: the servers concatenate captured states in layer order
    rope_parameters: Dict[str, Any]
    max_position_embeddings: int
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    norm_before_residual: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    initializer_range: float = 0.02

    def transformer_layer_config(self) -> Dict[str, Any]:
        """The draft layer as a Llama config dict (speculators' transformer_layer_config; SGLang's)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": dict(self.rope_parameters),
            "tie_word_embeddings": False,
            "initializer_range": self.initializer_range,
        }


class Eagle3Attention(Projections):
    def __init__(self, d: Eagle3Dims):
        super().__init__(d, in_size=2 * d.hidden_size)  # over cat(embeds, hidden)

    def forward(self, x, cos, sin, past_keys, past_values, visible):
        # x (B, T, 2H) -> out (B, T, H), new k, v. Decoding: past (B, KV, S, D) or None, visible
        # (T, S + T) bool. TTT training: past = the earlier steps' (B, KV, T, D) each, visible a
        # TTTVisibility (no (T, (k+1) T) mask is built).
        q = apply_rope(self.heads(self.q_proj(x)), cos, sin)
        k = apply_rope(self.heads(self.k_proj(x)), cos, sin)
        v = self.heads(self.v_proj(x))
        if hasattr(visible, "attention"):  # a rule without its mask: TTT's below, or a family's own
            out, k, v = visible.attention(q, k, v, past_keys, past_values)
        else:
            keys = k if past_keys is None else torch.cat([past_keys, k], dim=2)
            values = v if past_values is None else torch.cat([past_values, v], dim=2)
            out = attend(q, keys, values, visible)
        return self.output(out), k, v


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, d: Eagle3Dims):
        super().__init__()
        self.norm_before_residual = d.norm_before_residual
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = Eagle3Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = GatedMLP(d.hidden_size, d.intermediate_size)

    def forward(self, embeds, hidden, cos, sin, past_keys=None, past_values=None, visible=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2H)
        attn, k, v = self.self_attn(x, cos, sin, past_keys, past_values, visible)
        out = residual + attn
        out = out + self.mlp(self.post_attention_layernorm(out))
        return out, k, v


@dataclass(frozen=True)
class TTTVisibility:
    """The training-time test's rule (ttt_visibility) without its mask: step k's query t sees the
    step-0 keys <= t of its own conversation (documents (B, T), None: one per row) and the key at
    t of each step 1..k; drafts/eagle3/ttt_attention.py computes it exactly."""

    documents: Optional[PackedDocuments] = None
    shard: Optional[SequenceShard] = None  # sequence parallelism: attention exchanges heads (documents: whole T)

    def attention(self, q, k, v, past_keys, past_values):
        """-> (out, k, v): k and v kept as the exchange left them (SP: T, heads / N), as the later
        steps read them."""
        shard = self.shard or SequenceShard.whole(q.shape[2])
        q, k, v = shard.to_heads(q), shard.to_heads(k), shard.to_heads(v)
        return shard.to_tokens(ttt_attention(q, [*past_keys, k], [*past_values, v], self.documents)), k, v


class Eagle3Base(Draft):
    """The EAGLE-3 layer's modules and the draft-vocab maps; a family adds its training and decoding."""

    # the tensors whose shape or presence a draft key decides (EAGLE-3's and P-EAGLE's alike)
    tensor_keys = (
        ("lm_head.weight", "draft.draft_vocab_size"),
        ("d2t", "draft.draft_vocab_size"),
        ("fc_norm.*", "draft.fc_norm"),
        ("input_norm.*", "draft.norm_before_fc"),
    )

    def __init__(self, dims: Eagle3Dims):
        super().__init__()
        self.dims = dims
        aux = len(dims.target_layers) * dims.target_hidden_size
        self.input_norm = RMSNorm(aux, dims.rms_norm_eps) if dims.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(dims.target_hidden_size, dims.rms_norm_eps) for _ in dims.target_layers)
            if dims.fc_norm
            else None
        )
        self.fc = nn.Linear(aux, dims.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(dims)])
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.lm_head = nn.Linear(dims.hidden_size, dims.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(LlamaConfig(**dims.transformer_layer_config()))
        # the vocabulary maps: set once (counted, or loaded from a checkpoint / export), never rebuilt
        self.register_buffer("d2t", torch.zeros(dims.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(dims.vocab_size, dtype=torch.bool))
        self.init_linear_weights(self.dims.initializer_range)

    # draft.lm_head (a training setting, not exported; from_target_config sets it)
    lm_head_source: str = "own"

    def serving_refusal(self, fmt: str) -> Optional[str]:
        return serving_refusal(self.dims, fmt)

    def adopt_target_weights(self, target_lm_head: torch.Tensor, fresh: bool) -> None:
        """draft.lm_head: target / target_frozen start the head from the target's lm_head rows of
        the draft vocab (row d = target id d + d2t[d], speculators' lm_head_weight[t2d]);
        target_frozen never trains it (speculators 0.9.0, model.py load_verifier_weights). A
        resumed or imported head keeps its own weights; a frozen one stays frozen."""
        if self.lm_head_source == "own":
            return
        if fresh:
            rows = target_lm_head.detach().index_select(0, self.draft_to_target().to(target_lm_head.device))
            with torch.no_grad():
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        self.lm_head.weight.requires_grad_(self.lm_head_source != "target_frozen")

    # -- the vocabulary maps ---------------------------------------------------------------

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def count_vocab_maps(self, data) -> None:
        """The maps of a new draft: the draft vocab's most frequent loss-masked target tokens of `data`."""
        if data is not None:
            self.set_vocab_maps(
                *vocab_maps(count_target_tokens(data, self.dims.vocab_size), self.dims.draft_vocab_size)
            )

    def has_vocab_maps(self) -> bool:
        return bool(self.t2d.any())

    def extra_state(self) -> Dict[str, torch.Tensor]:
        return {"d2t": self.d2t.detach().cpu().clone(), "t2d": self.t2d.detach().cpu().clone()}

    def load_extra_state(self, state: Dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        d2t, t2d = state["d2t"], state["t2d"]
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise SpecdraftError(
                f"{source}: d2t/t2d have shapes {tuple(d2t.shape)}/{tuple(t2d.shape)}, this "
                f"run's draft needs {tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}"
            )
        if self.has_vocab_maps() and not (
            torch.equal(d2t.to(self.d2t.device), self.d2t) and torch.equal(t2d.to(self.t2d.device), self.t2d)
        ):
            raise SpecdraftError(
                f"{source}: its d2t/t2d vocabulary maps disagree with this run's draft "
                f"(the maps are built once; resume or fine-tune with the same ones)"
            )
        self.set_vocab_maps(d2t, t2d)

    def data_disagreement(self, data) -> Optional[str]:
        """The imported maps are kept, never recounted; how many of the data's own top tokens they miss."""
        return vocab_disagreement(count_target_tokens(data, self.dims.vocab_size), self.t2d.cpu())

    def draft_to_target(self) -> torch.Tensor:
        return draft_to_target_ids(self.d2t)

    # -- the model ---------------------------------------------------------------------------

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., 3 Ht) captured target states -> (..., H) the layer's first hidden input."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, embeds, hidden, positions, past_keys=None, past_values=None, visible=None):
        """One draft step over (B, T) inputs at `positions` (T,) -> (next hidden input, logits input,
        new keys, new values). visible (T, S + T) over past + new keys. positions (B, T): each row's own."""
        cos, sin = self.rotary_emb(embeds, positions if positions.dim() == 2 else positions[None])
        out, k, v = self.run_layer(
            self.layers[0], embeds, hidden, cos.to(embeds.dtype), sin.to(embeds.dtype), past_keys, past_values, visible
        )
        normed = self.norm(out)
        return (normed if self.dims.norm_output else out), normed, k, v

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        return self.lm_head(head_in)

    def external_parameters(self) -> List[nn.Parameter]:
        return [self.lm_head.weight]  # the chunked loss reads the head's weight directly

    def aux_hidden(self, features: TargetFeatures) -> torch.Tensor:
        return torch.cat([features.hidden[layer] for layer in self.dims.target_layers], dim=-1)

    def target_to_draft(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """(vocab,) long: the draft id of each target token, -1 outside the draft vocab (a CE
        label the objective skips)."""
        index = torch.full((self.dims.vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
        return index.index_copy_(0, draft_ids, torch.arange(len(draft_ids), device=draft_ids.device))
