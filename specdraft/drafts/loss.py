"""Next-token cross-entropy through a frozen lm_head, in chunks.

A full [tokens x vocab] fp32 logits tensor is the largest allocation of a draft step (4k tokens x
152k vocab = 2.5 GB). The forward pass here computes the loss and the gradient w.r.t. the hidden
states one chunk at a time and keeps only the (tokens x hidden) gradient for backward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from specdraft.transfer import to_device

LOGITS_CHUNK_BYTES = 256 << 20  # fp32 logits of one chunk; sets the default chunk size


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about LOGITS_CHUNK_BYTES (a multiple
    of 64 rows, at least 64): 384 rows for a 152k vocab, 2048 for 32k, 16384 for 4k."""
    rows = LOGITS_CHUNK_BYTES // (4 * vocab_size)
    return max(64, rows // 64 * 64)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, row_weights=None):
        # hidden (N, H), weight (V, H) frozen, labels (N,), row_weights (N,) constants or None
        # -> summed (weighted) loss (scalar, fp32)
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]
            y = labels[start : start + chunk_size]
            rows = torch.arange(len(y), device=y.device)
            # One (C, V) fp32 buffer, worked in place: the only vocab-sized tensor alive (plus its
            # bf16 matmul output / bf16 copy for the gradient matmul at bf16).
            logits = (h @ weight.t()).float()
            correct += (logits.argmax(dim=-1) == y).sum()
            label_logit = logits[rows, y]
            peak = logits.amax(dim=-1)
            probs = logits.sub_(peak[:, None]).exp_()  # exp(logit - max), in place
            sum_exp = probs.sum(dim=-1)
            w = None if row_weights is None else row_weights[start : start + chunk_size]
            ce = peak + sum_exp.log() - label_logit  # log Z - logit[y]
            total += (ce if w is None else ce * w).sum()
            if grad_hidden is not None:
                probs.div_(sum_exp[:, None])
                probs[rows, y] -= 1.0  # softmax - onehot
                if w is not None:
                    probs.mul_(w[:, None])
                grad_hidden[start : start + chunk_size] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits, probs
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_output, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 0, row_weights=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of CE(hidden @ weight.T, labels), top-1 hits); weight is a constant.
    chunk_size <= 0: default_chunk_size(vocab). row_weights (N,): constants each row's CE (and its
    gradient) is multiplied by (D-PACE's)."""
    if hidden.shape[0] == 0:  # an all-masked batch: zero loss, graph still connected
        return hidden.sum() * 0.0, torch.zeros((), dtype=torch.long, device=hidden.device)
    if chunk_size <= 0:
        chunk_size = default_chunk_size(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight.detach(), labels, chunk_size, row_weights)


def row_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 0
) -> torch.Tensor:
    """(N,) CE of each row of hidden @ weight.T at labels, without gradient, a chunk at a time."""
    if chunk_size <= 0:
        chunk_size = default_chunk_size(weight.shape[0])
    with torch.no_grad():
        return torch.cat(
            [
                torch.logsumexp(z, dim=-1) - z.gather(1, y[:, None]).squeeze(1)
                for z, y in (
                    ((h @ weight.t()).float(), y) for h, y in zip(hidden.split(chunk_size), labels.split(chunk_size))
                )
            ]
            or [hidden.new_zeros(0, dtype=torch.float32)]
        )


def whole_vocab_pass(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int, logsumexp: bool = True, argmax: bool = False
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(N, H) hidden states through a (V, H) head, one (C, V) block at a time, no grad -> (their
    logits' log-sum-exp (N,) float32, their argmax (N,)), each None unless asked: one matmul for
    both (EAGLE-3 with LK over a draft vocab reads both of the target's whole vocabulary). A block
    holds its matmul output and, for the log-sum-exp, one fp32 copy worked in place."""
    chunk = chunk_size if chunk_size > 0 else default_chunk_size(weight.shape[0])
    lse, top1 = [], []
    with torch.no_grad():
        for part in hidden.split(chunk):
            logits = part.to(weight.dtype) @ weight.t()
            if argmax:
                top1.append(logits.argmax(dim=-1))
            if logsumexp:  # torch.logsumexp's own steps, without its (C, V) temporary
                logits = logits.float()
                peak = logits.amax(dim=-1)
                lse.append(logits.sub_(peak[:, None]).exp_().sum(dim=-1).log_().add_(peak))
            del logits
    return (torch.cat(lse) if logsumexp else None), (torch.cat(top1) if argmax else None)


def teacher_vocab_pass(
    final: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    chunk_size: int,
    draft_vocab: int,
    logsumexp: bool,
    argmax: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What a teacher over a draft vocab reads of the target's whole vocabulary (EAGLE-3's
    in_vocab top-1, LK's log-sum-exp): whole_vocab_pass over `rows` only, the host indices of the
    rows of final (N, Ht) the loss reads (a teacher row of some step or depth), -> (N,) tensors,
    0 at the rows no loss reads. A block has the elements of the loss's largest chunk (chunk_size
    rows, 0: sized from the draft vocab, of draft_vocab logits; at most len(rows) rows, about what
    one call of the loss has: EAGLE-3's step 0, P-EAGLE's depth 0), at 6 bytes each at most where
    the loss holds 30 or more: the pass holds less than the loss does."""
    device, V = final.device, weight.shape[0]
    chunk = min(chunk_size if chunk_size > 0 else default_chunk_size(draft_vocab), rows.numel())
    at = to_device(rows, device)
    lse, top1 = whole_vocab_pass(final.index_select(0, at), weight, max(1, chunk * draft_vocab // V), logsumexp, argmax)
    n = final.shape[0]
    return (
        None if lse is None else lse.new_zeros(n).index_copy_(0, at, lse),
        None if top1 is None else top1.new_zeros(n).index_copy_(0, at, top1),
    )
