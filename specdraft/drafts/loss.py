"""Next-token cross-entropy through a frozen lm_head, in chunks.

A full [tokens x vocab] fp32 logits tensor is the largest allocation of a draft step (4k tokens x
152k vocab = 2.5 GB). The forward pass here computes the loss and the gradient w.r.t. the hidden
states one chunk at a time and keeps only the (tokens x hidden) gradient for backward.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.utils.checkpoint import checkpoint


LOGITS_CHUNK_BYTES = 256 << 20  # fp32 logits of one chunk; sets the default chunk size


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about LOGITS_CHUNK_BYTES (a multiple
    of 64 rows, at least 64): 384 rows for a 152k vocab, 2048 for 32k, 16384 for 4k."""
    rows = LOGITS_CHUNK_BYTES // (4 * vocab_size)
    return max(64, rows // 64 * 64)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        # hidden (N, H), weight (V, H) frozen, labels (N,) -> summed loss (scalar, fp32)
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            y = labels[start:start + chunk_size]
            rows = torch.arange(len(y), device=y.device)
            # One (C, V) fp32 buffer, worked in place: the only vocab-sized tensor alive (plus its
            # bf16 matmul output / bf16 copy for the gradient matmul at bf16).
            logits = (h @ weight.t()).float()
            correct += (logits.argmax(dim=-1) == y).sum()
            label_logit = logits[rows, y]
            peak = logits.amax(dim=-1)
            probs = logits.sub_(peak[:, None]).exp_()  # exp(logit - max), in place
            sum_exp = probs.sum(dim=-1)
            total += (peak + sum_exp.log() - label_logit).sum()  # log Z - logit[y]
            if grad_hidden is not None:
                probs.div_(sum_exp[:, None])
                probs[rows, y] -= 1.0  # softmax - onehot
                grad_hidden[start:start + chunk_size] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits, probs
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_output, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_size: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of CE(hidden @ weight.T, labels), top-1 hits); weight is a constant.
    chunk_size <= 0: default_chunk_size(vocab)."""
    if hidden.shape[0] == 0:  # an all-masked batch: zero loss, graph still connected
        return hidden.sum() * 0.0, torch.zeros((), dtype=torch.long, device=hidden.device)
    if chunk_size <= 0:
        chunk_size = default_chunk_size(weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight.detach(), labels, chunk_size)


def restricted_soft_cross_entropy(student_hidden: torch.Tensor, student_head: torch.Tensor,
                                  teacher_hidden: torch.Tensor, teacher_rows: torch.Tensor,
                                  chunk_size: int = 1024) -> Tuple[torch.Tensor, torch.Tensor]:
    """Soft CE against the target restricted to a sub-vocabulary, in chunks of rows.

    student_hidden (M, H) through the draft's own head (N, H) (trainable); teacher_hidden (M, H)
    through teacher_rows (N, H): the target lm_head's rows of the same N tokens, so the teacher
    p = softmax(target logits[sub-vocab]) is never a full-vocab tensor. Returns (sum over rows of
    -sum p * log_softmax(student), student argmax (M,)). Each chunk is recomputed in backward
    (activation checkpointing), so at most one (chunk x N) logits tensor is alive.
    """
    if chunk_size <= 0:  # the config's 0: sized from the (sub-)vocab
        chunk_size = default_chunk_size(student_head.shape[0])
    total = student_hidden.new_zeros((), dtype=torch.float32)
    argmax = []
    teacher_rows = teacher_rows.detach()
    for start in range(0, student_hidden.shape[0], chunk_size):
        part, best = checkpoint(_soft_ce_chunk, student_hidden[start:start + chunk_size], student_head,
                                teacher_hidden[start:start + chunk_size], teacher_rows, use_reentrant=False)
        total = total + part
        argmax.append(best)
    if not argmax:  # nothing counted: zero loss, graph still connected to the head
        return (student_head.sum() * 0.0).float(), torch.zeros(0, dtype=torch.long, device=student_hidden.device)
    return total, torch.cat(argmax)


def _soft_ce_chunk(student_hidden, student_head, teacher_hidden, teacher_rows):
    with torch.no_grad():
        teacher = torch.softmax((teacher_hidden.to(teacher_rows.dtype) @ teacher_rows.t()).float(), dim=-1)
    logits = (student_hidden @ student_head.t()).float()  # (C, N)
    loss = -(teacher * torch.log_softmax(logits, dim=-1)).sum()
    return loss, logits.detach().argmax(dim=-1)
