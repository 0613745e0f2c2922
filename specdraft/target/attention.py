"""The target's attention as its layers run it while capturing (target/capture.py's core), and
attention inside packed documents without a (T, T) mask, which the drafts' attentions share.

The target's rule per layer: causal, inside each packed document, with the layer's own sliding
window, attention sinks and soft-cap (target_attention; one sequence per row: causal_attention),
computed in query tiles (tiled_attention) where no fused kernel applies.

Packed rows hold several conversations; a query sees keys of its own one only (EAGLE-3: those
<= its position; GLIDE and DFlash add their window, lag or block rule on top). One path per
device (attention_path):
- CPU ("slices"): each conversation is one slice of the row, attended as a row of its own (no
  document mask at all). Its borders are read on the host, which costs nothing there.
- CUDA ("flex"): flex_attention with a block mask built on the device from the document ids (no
  T^2 tensor, no host sync). flex_attention has no backward on CPU (torch 2.13), hence the slices.
- Any other device ("dense"; meta, the tests' stand-in for a second device): a dense mask.
Tests run the CUDA path on the CPU under `forced_attention_path("flex")` (forward only there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F


_forced: Optional[tuple] = None  # forced_attention_path's (path, compile, backend), for the CPU


def attention_path(device) -> str:
    """How packed documents are attended on `device`: "slices" (CPU), "flex" (CUDA), "dense" (else)."""
    if _forced is not None and torch.device(device).type == "cpu":
        return _forced[0]
    return {"cpu": "slices", "cuda": "flex"}.get(torch.device(device).type, "dense")


@contextlib.contextmanager
def forced_attention_path(path: str, compile: bool = True, backend="inductor"):
    """Tests only: the CPU attends packed documents along `path` ("flex": the CUDA path, its block
    masks and flex_attention compiled as on CUDA when `compile`, with torch.compile's `backend`, a
    name or a callable: any keeps dynamo's guards and recompiles, without inductor's slow CPU
    codegen). The CPU has no flex backward: run forwards only there. Never set by the package."""
    global _forced
    saved, _forced = _forced, (path, compile, backend)
    try:
        yield
    finally:
        _forced = saved


# Compiled entries per compiled function: one per call site of the flex path (the target's, each
# draft's: its shapes, grad mode, log-sum-exp or not), all made in the first step. Dynamo's default
# recompile_limit (8) runs any further one eagerly, scores and all: every family at once made 15.
COMPILED_VARIANTS = 64


def _compiled(fn, device):
    """fn compiled as the flex path compiles it on `device` (CUDA, or the CPU under
    forced_attention_path(compile=True)), one compiled function per (fn, backend); None: eager.
    Static shapes (dynamic=False): each call site compiles once for its own shapes. Dynamo's
    automatic dynamic shapes would recompile the first call site whose shapes differ from an
    earlier one's (the target's T x T beside a draft's lagged or block queries) into a graph with
    symbolic sizes, and any size a batch changes (a lag, an anchor count) on its second value."""
    device = torch.device(device)
    if device.type == "cuda":
        backend = "inductor"
    elif device.type == "cpu" and _forced is not None and _forced[1]:
        backend = _forced[2]
    else:
        return None
    key = (fn.__name__, backend)
    if key not in _compiled_functions:
        # the process's limit, raised once (a patch around each call costs ~20 us of host time)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)
        _compiled_functions[key] = torch.compile(fn, backend=backend, dynamic=False)
    return _compiled_functions[key]


_compiled_functions: dict = {}


@dataclass(frozen=True)
class PackedDocuments:
    """The document ids (B, T) and what the attention of this device needs, built once per batch."""

    ids: torch.Tensor
    segments: Optional[List[List[Tuple[int, int]]]] = None  # CPU: per row, each conversation's [start, end)
    block_mask: Optional[object] = None  # CUDA: flex_attention's BlockMask
    # CUDA: the target's windowed block masks, one per window, built at its first layer of that window
    window_masks: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, documents) -> Optional["PackedDocuments"]:
        if documents is None or isinstance(documents, PackedDocuments):
            return documents
        path = attention_path(documents.device)
        if path == "slices":
            return cls(documents, segments=document_segments(documents))
        if path == "flex":
            return cls(documents, block_mask=document_block_mask(documents))
        return cls(documents)

    def dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool: key j <= query t, both in the same conversation."""
        T = self.ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]


def document_causal_attention(
    q, k, v, documents: Optional[PackedDocuments] = None, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal attention inside each conversation, without a (T, T) mask on CPU and CUDA.
    q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D). documents None: one per row."""
    gqa = q.shape[1] != k.shape[1]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    if documents is None:
        return causal(q, k, v)
    if documents.segments is not None:
        return per_document(causal, documents.segments, q, k, v)
    if documents.block_mask is not None:
        return flex_attention(q, k, v, documents.block_mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.dense(), scale=scale, enable_gqa=gqa)


def document_attention(document_ids: Optional[torch.Tensor]):
    """The target's core attention for packed data (capture's `attention`): causal
    inside each document of document_ids (B, T), with each layer's own window, sinks and
    soft-cap (target_attention). None: one document per row (plain causal SDPA where no layer
    rule applies; flex_attention for one on CUDA, where capture's own core computes tiles)."""
    documents = PackedDocuments.of(document_ids)

    def core(q, k, v, scale=None, window=None, sinks=None, softcap=None):
        return target_attention(q, k, v, documents, scale, window, sinks, softcap)

    return core


def document_segments(documents: torch.Tensor) -> List[List[Tuple[int, int]]]:
    """documents (B, T) on the host -> per row the [start, end) of each conversation (contiguous ids)."""
    T = documents.shape[1]
    starts = documents[:, 1:] != documents[:, :-1]
    rows = []
    for row in starts:
        borders = [0, *(torch.nonzero(row).flatten() + 1).tolist(), T]
        rows.append(list(zip(borders[:-1], borders[1:])))
    return rows


def per_document(
    attend: Callable[..., torch.Tensor], segments: List[List[Tuple[int, int]]], *tensors: torch.Tensor
) -> torch.Tensor:
    """attend(*slices) on each conversation's slice (dim 2 of every (B, H, T, D) tensor), joined
    back along T: causal attention per conversation, one call each."""
    rows = []
    for b, row in enumerate(segments):
        rows.append(torch.cat([attend(*(t[b : b + 1, :, start:end] for t in tensors)) for start, end in row], dim=2))
    return torch.cat(rows, dim=0)


def document_block_mask(documents: torch.Tensor, key_documents: Optional[torch.Tensor] = None):
    """Query q sees key kv <= q of its own document. documents (B, Q): the queries' document ids;
    key_documents (B, KV): the keys' (default: the same), e.g. shifted for a lagged attention."""
    key_documents = documents if key_documents is None else key_documents

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (documents[b, q] == key_documents[b, kv])

    B, Q = documents.shape
    return make_block_mask(same_document_causal, B, Q, key_documents.shape[1], documents.device)


def make_block_mask(mask_mod, B: int, q_len: int, kv_len: int, device):
    """flex_attention's BlockMask of mask_mod(b, h, q, kv): (B, 1, q_len/128, kv_len/128) block
    indices. Eager create_block_mask first evaluates mask_mod over the whole (B, 1, Q, KV) grid (a
    T^2 bool tensor, then freed); compiled (CUDA) it evaluates it block by block instead."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled(create_block_mask, device) or create_block_mask
    return build(mask_mod, B, None, q_len, kv_len, device=device)


def flex_attention(
    q, k, v, block_mask, scale: Optional[float] = None, return_lse: bool = False, score_mod: Optional[Callable] = None
):
    """flex_attention with `block_mask`; compiled on CUDA (eager flex materialises the scores).
    return_lse: also the (B, H, T) natural log-sum-exp of each row's scores (differentiable).
    score_mod: flex's, applied to each scaled score before the mask (the target's soft-capping)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention as eager

    flex = _compiled(eager, q.device) or eager
    gqa = q.shape[1] != k.shape[1]
    if not return_lse:
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = flex(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


# -- the target's own attention per layer: sliding windows, attention sinks, soft-capping ---------


def target_attention(
    q,
    k,
    v,
    documents: Optional[PackedDocuments] = None,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """A target layer's attention inside each document (target/capture.py's core), as transformers'
    eager attention computes it, without a (T, T) tensor on CPU and CUDA.

    q (B, H, T, D), k (B, KV, T, D), v (B, KV, T, Dv) -> (B, H, T, Dv); documents None: one per row.
    window: query t sees keys t - window < s <= t (transformers' sliding_window_overlay); None, or
    one covering the sequence: causal. sinks (H,): one more logit per head in each row's softmax
    denominator with no value (gpt-oss): out * sigmoid(lse - sink), lse the row's log-sum-exp
    over its visible keys. softcap: scores -> softcap * tanh(scores / softcap) before the mask
    (transformers' `softcap` argument; Gemma 2 passes it, Gemma 3 does not).
    - CPU ("slices"): each document alone, in query tiles attending only to the keys their window
      reaches (a (tile, tile + window) score tensor), or one SDPA call where no window cuts and
      neither sinks nor a soft-cap change the softmax (today's path).
    - CUDA ("flex"): flex_attention over a block mask of document, causality and window (one per
      window and batch, the window a constant of the mask_mod: one compilation per layer kind),
      softcap as its score_mod, sinks through its log-sum-exp.
    - Other devices ("dense"): the CPU's tiles, the documents as a per-tile mask.
    """
    T = q.shape[2]
    window = window if window is not None and window < T else None
    if window is None and sinks is None and softcap is None:
        return document_causal_attention(q, k, v, documents, scale)
    path = attention_path(q.device)
    if path == "flex":
        if documents is not None and documents.block_mask is None:  # built for another device
            documents = PackedDocuments.of(documents.ids)
        if window is None:
            block_mask = documents.block_mask if documents is not None else _causal_block_mask(T, q.device)
        elif documents is None:
            block_mask = _causal_block_mask(T, q.device, window)
        else:
            if window not in documents.window_masks:
                documents.window_masks[window] = document_window_block_mask(documents.ids, window)
            block_mask = documents.window_masks[window]
        score_mod = None if softcap is None else _softcap_score(softcap)
        if sinks is None:
            return flex_attention(q, k, v, block_mask, scale=scale, score_mod=score_mod)
        out, lse = flex_attention(q, k, v, block_mask, scale=scale, return_lse=True, score_mod=score_mod)
        return out * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])[..., None].to(out.dtype)

    def attend(q, k, v, ids=None):
        return tiled_attention(q, k, v, scale, window, sinks, softcap, ids)

    if documents is None:
        return attend(q, k, v)
    if path == "slices":
        segments = documents.segments if documents.segments is not None else document_segments(documents.ids)
        return per_document(attend, segments, q, k, v)
    return attend(q, k, v, documents.ids)


def document_window_block_mask(documents: torch.Tensor, window: int):
    """Query q sees key kv of its own document with q - window < kv <= q, as a flex BlockMask.
    The window is a constant of the mask_mod: fixed per layer kind of a target, so one
    compilation each, never one per batch."""

    def same_document_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window) & (documents[b, q] == documents[b, kv])

    B, T = documents.shape
    return make_block_mask(same_document_window, B, T, T, documents.device)


def _causal_block_mask(T: int, device, window: Optional[int] = None):
    """Causal (within `window`) over one sequence per row: a BlockMask of batch 1 that
    flex_attention broadcasts, kept per (T, window, device): it depends on nothing else."""
    key = (T, window, str(torch.device(device)))
    if key not in _causal_block_masks:
        if window is None:

            def mask_mod(b, h, q, kv):
                return q >= kv
        else:

            def mask_mod(b, h, q, kv):
                return (q >= kv) & (q - kv < window)

        _causal_block_masks[key] = make_block_mask(mask_mod, 1, T, T, device)
    return _causal_block_masks[key]


_causal_block_masks: dict = {}


def _softcap_score(softcap: float):
    """flex's score_mod of a soft-cap, one function per value (kept: the same object each layer)."""
    if softcap not in _softcap_scores:

        def softcapped(score, b, h, q, kv):
            return torch.tanh(score / softcap) * softcap

        _softcap_scores[softcap] = softcapped
    return _softcap_scores[softcap]


_softcap_scores: dict = {}


# -- tiles: one sequence per row, a query tile at a time ------------------------------------------


def causal_attention(q, k, v, scale=None, window=None, sinks=None, softcap=None):
    """One document per row: plain causal SDPA (its fast kernels, no mask); a layer's window,
    sinks or soft-cap in query tiles (tiled_attention: no (T, T) tensor). The training path's core
    (target/attention.py's document_attention) takes flex_attention for these on CUDA."""
    window = window if window is not None and window < q.shape[2] else None  # one covering T cuts nothing
    if window is None and sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return tiled_attention(q, k, v, scale, window, sinks, softcap)


TARGET_QUERY_BLOCK = 128  # queries per tile of tiled_attention without a window


def tiled_attention(
    q,
    k,
    v,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of one sequence per row, computed as transformers' eager attention does
    (scores, soft-cap, mask, softmax with the sink logit, weights @ v), one query tile at a time:
    tiles of `window` queries over the keys [tile start - window + 1, tile end) with a windowed
    layer, of TARGET_QUERY_BLOCK queries over [0, tile end) without one. No (T, T) tensor: the
    scores of one tile, (B, H, tile, <= tile + window) or (B, H, tile, <= T). Shapes depend on T
    and the window only (no host read): any device. documents (B, T): ids, attended inside each.

    q (B, H, T, D), k (B, KV, T, D), v (B, KV, T, Dv) -> (B, H, T, Dv)."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    group = H // KV
    scale = D**-0.5 if scale is None else scale
    tile = window if window is not None else TARGET_QUERY_BLOCK
    sink = None if sinks is None else sinks.to(q.dtype).view(1, KV, group, 1, 1)
    upcast = torch.promote_types(q.dtype, torch.float32)  # the softmax in fp32 at least, as transformers' eager
    outs = []
    for start in range(0, T, tile):
        end = min(start + tile, T)
        first = 0 if window is None else max(0, start - window + 1)
        qs = q[:, :, start:end].reshape(B, KV, group, end - start, D)  # grouped queries: no repeat of k/v
        scores = torch.matmul(qs, k[:, :, None, first:end].transpose(-1, -2)) * scale  # (B, KV, g, n, m)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        t = torch.arange(start, end, device=q.device)[:, None]
        s = torch.arange(first, end, device=q.device)[None, :]
        visible = s <= t
        if window is not None:
            visible = visible & (t - s < window)
        if documents is not None:
            same = documents[:, start:end, None] == documents[:, None, first:end]  # (B, n, m)
            visible = visible & same[:, None, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink is not None:
            logits = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
            weights = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1, dtype=upcast)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1, dtype=upcast)
        outs.append(torch.matmul(weights.to(v.dtype), v[:, :, None, first:end]).reshape(B, H, end - start, -1))
    return torch.cat(outs, dim=2)
