"""Per-device peak memory of a training run, predicted from the model configs and the run config.

    peak = weights (target: replicated, or partitioned under ZeRO-3; draft)
         + gradients and optimizer state (by ZeRO stage)
         + the family's terms (Draft.memory_terms: the capture's features it keeps through its
           backward, its activations, its loss chunk, its masks), with its activations and loss
           replaced by the capture's transient working set when that is larger

Parameter counts are exact: both models are built on the meta device (no memory). Activation
counts follow the code: what autograd saves per token in the draft (each family counts its own),
what one target decoder layer holds at once under no_grad. bench/memory_model.py checks the total
against measured peaks, per family.

Mixture-of-experts targets (Qwen3-MoE, gpt-oss, DeepSeek-V3, GLM-4.5, Qwen3-Next): every expert's
weights are resident (the exact count of the meta model: a token may be routed to any of them),
and a sparse layer's MLP holds its routed activations at once, as transformers' grouped_mm experts
(integrations/moe.py, its default on CUDA) computes them: per token and each of its top_k experts
the gathered input and the expert's gate/up and gated product (H + 3 x expert intermediate), plus
the router's logits and fp32 probabilities over every expert (mlp_working_bytes). Windowed layers
(gpt-oss, Gemma 3, Mistral, Phi-3) cost the capture no more than full ones where its core runs
flex_attention (packed documents on CUDA); one sequence per row runs them in query tiles whose
scores are bounded by the window, (window, 2 window) per tile and head, and a full layer with
sinks or soft-capping in tiles of 128 queries over the keys before them (attention_tile_bytes).

Sequence parallelism (sequence_parallel_size S, Ulysses): each rank holds T / S tokens of every
row, so the per-token terms divide by S: the captured features, the draft's activations and loss,
the capture's working set. Weights, gradients and optimizer state do not. What is all-gathered
does not either: a context a family all-gathers (with its keys/values per layer) is the whole
sequence's on every rank (MemoryShape.whole_T). The head exchange (all_to_all) of the target's
attention adds its send/receive buffers to the capture's working set, and the capture builds no
(T, T) mask (its document-aware core attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from transformers import AutoModelForCausalLM

from specdraft.config import draft_names, draft_view
from specdraft.drafts.registry import build_draft
from specdraft.drafts.base import MemoryShape, target_text_config
from specdraft.target.capture import CaptureRequest
from specdraft.target.moe import moe_shape

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
USABLE_FRACTION = 0.9  # of a GPU's memory: CUDA context, NCCL buffers, fragmentation take the rest
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)


@dataclass
class MemoryEstimate:
    parts: Dict[str, float] = field(default_factory=dict)  # name -> bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def meta_models(target_config, draft_cfg):
    """(target, draft) built on the meta device: exact shapes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(target_config), build_draft(draft_cfg, target_config)


def parameter_counts(target_config, draft_cfg, models=None) -> Dict[str, int]:
    """Exact counts, from models built on the meta device."""
    target, draft = models or meta_models(target_config, draft_cfg)
    text = target_text_config(target_config)
    # the largest layer: a MoE target's sparse layers (DeepSeek-V3's first three are dense)
    per_layer = max(sum(p.numel() for p in layer.parameters()) for layer in target.model.layers)
    embed = target.get_input_embeddings().weight.numel()
    return {
        "target": sum(p.numel() for p in target.parameters()),
        "draft": sum(p.numel() for p in draft.parameters()),
        "target_layer": per_layer,
        "embed": embed,
        "layers": text.num_hidden_layers,
    }


def reduce_bucket_elements(draft_params: int) -> int:
    """ZeRO-1/2's gradient bucket, allocated whole every micro-step: sized to the draft, not
    DeepSpeed's 5e8-element default (2 GB at fp32 for a draft that may hold 3 M parameters).
    Rounded up to a multiple of 8: ZeRO-1/2 assert an even allgather bucket (its 4-byte alignment
    at fp16), and a draft's count may be odd (a confidence head with one bias)."""
    return min(REDUCE_BUCKET, draft_params + (-draft_params) % 8)


def capture_working_set(text, tokens: int, p: int, sequence_parallel: int = 1) -> float:
    """The target's capture, one decoder layer under no_grad, for a rank's tokens: residual +
    normed input (2H), q/k/v/attn out (2 heads hd + 2 kv hd), the MLP's (mlp_working_bytes: a
    dense one's gate/up/product 3I); RMSNorm works in fp32 (2H x 4 B). Under SP the head exchange
    (all_to_all) of q/k/v and the attention output keeps a received copy of each (2 heads hd + 2 kv hd)."""
    H = text.hidden_size
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    hd = getattr(text, "head_dim", None) or H // heads
    exchange = (2 * heads * hd + 2 * kv * hd) * p if sequence_parallel > 1 else 0
    return tokens * ((2 * H + 2 * heads * hd + 2 * kv * hd) * p + 2 * H * 4 + exchange + mlp_working_bytes(text, p))


def mlp_working_bytes(text, p: int) -> float:
    """Bytes per token of one target layer's MLP under no_grad, its largest kind of layer. Dense:
    gate, up and their product (3I). Sparse (target/moe.py): the routed activations, top_k per
    token, each its gathered input, gate/up and gated product (H + 3 I_e), as grouped_mm holds
    them at once, and the router's logits (E) with their fp32 softmax (4 B each); its shared
    expert's gate/up/product (3 I_s) run after them (DeepSeek-V3, GLM-4.5, Qwen3-Next), beside the
    routed output (H)."""
    moe = moe_shape(text)
    dense = 3 * text.intermediate_size * p
    if moe is None:
        return dense
    routed = moe.top_k * (text.hidden_size + 3 * moe.expert_intermediate) * p + moe.experts * (p + 4)
    shared = (3 * moe.shared_intermediate + text.hidden_size) * p if moe.shared_intermediate else 0
    sparse = max(routed, shared)
    return sparse if len(moe.sparse_layers) == text.num_hidden_layers else max(sparse, dense)


ATTENTION_TILE = 128  # queries per tile of the capture's tiled attention without a window (target/capture.py)


def attention_tile_bytes(text, B: int, T: int, p: int, documents: bool, sequence_parallel: int = 1) -> float:
    """The capture's attention scores of one query tile, its largest kind of layer, where its core
    computes them itself (target/attention.tiled_attention: one sequence per row with a window, sinks
    or soft-capping); with packed documents the core is flex_attention on CUDA, which keeps none.
    A windowed layer (window W < T): W queries over up to 2W - 1 keys; a full layer with sinks
    (gpt-oss) or soft-capping: 128 queries over up to T keys; per element the scores, their masked
    copy and the fp32 softmax (2p + 4 B), the sink column's concatenation one more (p). The core
    sees the whole sequence with heads / sequence_parallel heads. Plain causal layers: SDPA's fused
    kernels, nothing."""
    if documents:
        return 0.0
    heads = max(1, text.num_attention_heads // max(1, sequence_parallel))
    window = getattr(text, "sliding_window", None)
    kinds = list(getattr(text, "layer_types", None) or [])
    windowed = window is not None and window < T and ("sliding_attention" in kinds if kinds else True)
    full = not windowed or (kinds and "full_attention" in kinds)
    sinks = text.model_type == "gpt_oss"
    per_element = 2 * p + 4 + (p if sinks else 0)
    tiles = []
    if windowed:
        tiles.append(window * min(T, 2 * window - 1))
    if full and (sinks or getattr(text, "attn_logit_softcapping", None)):
        tiles.append(min(ATTENTION_TILE, T) * T)
    return B * heads * max(tiles, default=0) * per_element


def estimate_peak(
    target_config,
    cfg,
    world_size: int,
    target_placement: str = "replicated",
    documents: Optional[bool] = None,
    sequence_parallel: Optional[int] = None,
) -> MemoryEstimate:
    """cfg: the run config (precision, zero_stage, per_device_batch_size, max_seq_length,
    loss_chunk_size, document_mask, draft.*). documents: batches have document borders
    (default: cfg.document_mask): a family's own term where it has one (the capture builds no
    (B, 1, T, T) mask). The family of cfg.draft supplies its own terms.
    sequence_parallel: ranks that share a sequence (default: cfg.sequence_parallel_size, or 1)."""
    text = target_text_config(target_config)
    target, draft = meta_models(target_config, cfg.draft)
    counts = parameter_counts(target_config, cfg.draft, (target, draft))
    p = BYTES[cfg.precision]
    n = world_size
    stage = cfg.zero_stage
    S = sequence_parallel or cfg.get("sequence_parallel_size", 1) or 1
    B, whole = cfg.per_device_batch_size, cfg.max_seq_length
    T = -(-whole // S)  # this rank's shard
    tokens = B * T
    P_t, P_d = counts["target"], counts["draft"]
    est = MemoryEstimate()

    # -- weights --------------------------------------------------------------------------
    if stage == 3 and target_placement == "partitioned":
        # own shard + what is gathered at once: the lm_head (read by the loss) and ~2 layers
        # (the one running and the one prefetched)
        est.parts["target weights"] = (P_t / n + counts["embed"] + 2 * counts["target_layer"]) * p
    else:
        est.parts["target weights"] = P_t * p
    est.parts["draft weights"] = P_d * p if stage < 3 else (P_d / n + P_d) * p  # ZeRO-3: gathered for fwd/bwd

    # -- gradients and optimizer state ------------------------------------------------------
    mixed = p != 4
    if stage == 0:
        est.parts["draft grads"] = P_d * p + (P_d * 4 if mixed else 0)  # bf16: fp32 accumulator too
        est.parts["optimizer (fp32 master + Adam m, v)"] = P_d * ((4 if mixed else 0) + 8)
    else:
        bucket = reduce_bucket_elements(P_d) * p
        full = P_d * p if stage == 1 else 0  # stage 1 keeps whole grads until the step
        est.parts["draft grads"] = full + bucket + P_d * 4 / n  # + the fp32 partition of the reduced grads
        # ZeRO-1/2/3 keep an fp32 copy of their partition even when training in fp32
        est.parts["optimizer (fp32 master + Adam m, v)"] = P_d * 12 / n

    # -- the family's own terms, and the target's pass ---------------------------------------
    chunk = max(cfg.loss_chunk_size, 0)  # 0: each loss sizes its chunk from its logits' vocab, as at run time
    with_documents = cfg.document_mask if documents is None else documents
    terms = draft.memory_terms(
        MemoryShape(
            B=B,
            T=T,
            dtype_bytes=p,
            chunk=chunk,
            documents=bool(with_documents),
            target=text,
            whole_T=whole if S > 1 else 0,
        )
    )
    transient = {k: terms.pop(k) for k in ("draft activations", "loss chunk + hidden grads") if k in terms}
    est.parts.update(terms)
    # the capture builds no (B, 1, T, T) mask: its core attention is document-aware (target/capture.py)
    capture_transient = capture_working_set(text, tokens, p, S) + attention_tile_bytes(
        text, B, whole, p, bool(with_documents), S
    )
    if capture_transient > sum(transient.values()):
        est.parts["capture working set (transient)"] = capture_transient
    else:
        est.parts.update(transient)
    return est


SHARED_PARTS = ("target weights", "document masks")  # held once however many drafts a run trains
CAPTURE = "capture features"
TRANSIENT = ("draft activations", "loss chunk + hidden grads", "capture working set (transient)")


def estimate_run_peak(
    target_config, cfg, world_size: int, target_placement: str = "replicated", documents: Optional[bool] = None
) -> MemoryEstimate:
    """estimate_peak of a whole run: one draft's, or for a run of several drafts (`drafts:`) one
    target and every draft. The drafts' weights, gradients, optimizer states and own terms add up;
    the target, its masks and the captured features (the union of the drafts' requests, read by
    all of them) count once; the transient working sets (the capture, then each draft's forward
    and backward in turn) count as the largest of them."""
    names = draft_names(cfg)
    if names == [None]:
        return estimate_peak(target_config, cfg, world_size, target_placement, documents)
    est, transient, request = MemoryEstimate(), 0.0, CaptureRequest()
    for name in names:
        view = draft_view(cfg, name)
        own = estimate_peak(target_config, view, world_size, target_placement, documents)
        request = request.merged(meta_models(target_config, view.draft)[1].capture_request())
        transient = max(transient, sum(own.parts.get(k, 0.0) for k in TRANSIENT))
        for part, value in own.parts.items():
            if part in SHARED_PARTS:
                est.parts[part] = value
            elif part != CAPTURE and part not in TRANSIENT:
                est.parts[f"{name}: {part}"] = value
    est.parts[CAPTURE] = union_capture_bytes(
        target_config, request, cfg.per_device_batch_size, cfg.max_seq_length, BYTES[cfg.precision]
    )
    est.parts["largest working set (transient)"] = transient
    return est


def union_capture_bytes(target_config, request: CaptureRequest, B: int, T: int, dtype_bytes: int) -> float:
    """What one capture of `request` keeps per micro-batch: the input embeddings and rotary tables,
    the layers' hidden states, the last layer's K/V, the final hidden state."""
    text = target_text_config(target_config)
    H, heads = text.hidden_size, text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    hd = getattr(text, "head_dim", None) or H // heads
    per_token = (
        H
        + 2 * hd
        + len(request.layers) * H
        + (2 * kv * hd if request.last_layer_kv else 0)
        + (H if request.final_hidden else 0)
    )
    return B * T * per_token * dtype_bytes
