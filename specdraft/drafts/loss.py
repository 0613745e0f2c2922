"""Next-token cross-entropy through a frozen lm_head, in chunks.

A full [tokens x vocab] fp32 logits tensor is the largest allocation of a draft step (4k tokens x
152k vocab = 2.5 GB). The forward pass here computes the loss and the gradient w.r.t. the hidden
states one chunk at a time and keeps only the (tokens x hidden) gradient for backward.
"""

from __future__ import annotations

from typing import Tuple

import torch


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
            logits = (h @ weight.t()).float()  # (C, V): the only vocab-sized tensor alive
            log_z = torch.logsumexp(logits, dim=-1)
            total += (log_z - logits.gather(1, y[:, None]).squeeze(1)).sum()
            correct += (logits.argmax(dim=-1) == y).sum()
            if grad_hidden is not None:
                probs = torch.exp(logits - log_z[:, None])
                probs[torch.arange(len(y), device=probs.device), y] -= 1.0  # softmax - onehot
                grad_hidden[start:start + chunk_size] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_output, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_size: int = 1024) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of CE(hidden @ weight.T, labels), top-1 hits); weight is a constant."""
    if hidden.shape[0] == 0:  # an all-masked batch: zero loss, graph still connected
        return hidden.sum() * 0.0, torch.zeros((), dtype=torch.long, device=hidden.device)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight.detach(), labels, chunk_size)
