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
from specdraft.drafts import build_draft
from specdraft.drafts.base import MemoryShape, target_text_config
from specdraft.target.capture import CaptureRequest
from specdraft.drafts.loss import default_chunk_size

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
    per_layer = sum(p.numel() for p in target.model.layers[0].parameters())
    embed = target.get_input_embeddings().weight.numel()
    return {"target": sum(p.numel() for p in target.parameters()), "draft": sum(p.numel() for p in draft.parameters()),
            "target_layer": per_layer, "embed": embed, "layers": text.num_hidden_layers}


def reduce_bucket_elements(draft_params: int) -> int:
    """ZeRO-1/2's gradient bucket, allocated whole every micro-step: sized to the draft, not
    DeepSpeed's 5e8-element default (2 GB at fp32 for a draft that may hold 3 M parameters).
    Rounded up to a multiple of 8: ZeRO-1/2 assert an even allgather bucket (its 4-byte alignment
    at fp16), and a draft's count may be odd (a confidence head with one bias)."""
    return min(REDUCE_BUCKET, draft_params + (-draft_params) % 8)


def capture_working_set(text, tokens: int, p: int, sequence_parallel: int = 1) -> float:
    """The target's capture, one decoder layer under no_grad, for a rank's tokens: residual +
    normed input (2H), q/k/v/attn out (2 heads hd + 2 kv hd), MLP gate/up/product (3I); RMSNorm
    works in fp32 (2H x 4 B). Under SP the head exchange (all_to_all) of q/k/v and the attention
    output keeps a received copy of each (2 heads hd + 2 kv hd)."""
    H, I = text.hidden_size, text.intermediate_size
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    hd = getattr(text, "head_dim", None) or H // heads
    exchange = (2 * heads * hd + 2 * kv * hd) * p if sequence_parallel > 1 else 0
    return tokens * ((2 * H + 2 * heads * hd + 2 * kv * hd + 3 * I) * p + 2 * H * 4 + exchange)


def estimate_peak(target_config, cfg, world_size: int, target_placement: str = "replicated",
                  documents: Optional[bool] = None, sequence_parallel: Optional[int] = None) -> MemoryEstimate:
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
    V = text.vocab_size
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
    chunk = cfg.loss_chunk_size if cfg.loss_chunk_size > 0 else default_chunk_size(V)
    with_documents = cfg.document_mask if documents is None else documents
    terms = draft.memory_terms(MemoryShape(B=B, T=T, dtype_bytes=p, chunk=chunk, documents=bool(with_documents),
                                           target=text, whole_T=whole if S > 1 else 0))
    transient = {k: terms.pop(k) for k in ("draft activations", "loss chunk + hidden grads") if k in terms}
    est.parts.update(terms)
    # the capture builds no (B, 1, T, T) mask: its core attention is document-aware (target/capture.py)
    capture_transient = capture_working_set(text, tokens, p, S)
    if capture_transient > sum(transient.values()):
        est.parts["capture working set (transient)"] = capture_transient
    else:
        est.parts.update(transient)
    return est


SHARED_PARTS = ("target weights", "document masks")  # held once however many drafts a run trains
CAPTURE = "capture features"
TRANSIENT = ("draft activations", "loss chunk + hidden grads", "capture working set (transient)")


def estimate_run_peak(target_config, cfg, world_size: int, target_placement: str = "replicated",
                      documents: Optional[bool] = None) -> MemoryEstimate:
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
    est.parts[CAPTURE] = union_capture_bytes(target_config, request, cfg.per_device_batch_size, cfg.max_seq_length,
                                             BYTES[cfg.precision])
    est.parts["largest working set (transient)"] = transient
    return est


def union_capture_bytes(target_config, request: CaptureRequest, B: int, T: int, dtype_bytes: int) -> float:
    """What one capture of `request` keeps per micro-batch: the input embeddings and rotary tables,
    the layers' hidden states, the last layer's K/V, the final hidden state."""
    text = target_text_config(target_config)
    H, heads = text.hidden_size, text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    hd = getattr(text, "head_dim", None) or H // heads
    per_token = H + 2 * hd + len(request.layers) * H + (2 * kv * hd if request.last_layer_kv else 0) \
        + (H if request.final_hidden else 0)
    return B * T * per_token * dtype_bytes
