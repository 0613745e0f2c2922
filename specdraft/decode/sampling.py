"""The one sampler, shared by draft and target, and the speculative accept/resample rule.

Temperature 0 is greedy: `probabilities` returns a one-hot on the argmax, so the same rejection
rule below becomes "accept iff the draft token is the target's argmax, otherwise emit the argmax".
Greedy and sampled decoding thus run through one code path.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities; one-hot argmax at temperature 0."""
    logits = logits.float()
    if temperature <= 0:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    return torch.softmax(logits / temperature, dim=-1)


def sample_from(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """One token from a (V,) distribution (a one-hot always gives its index)."""
    if probs.max() >= 1.0:  # one-hot (greedy): no random draw, so greedy output ignores the seed
        return int(probs.argmax())
    # inverse CDF (several times faster than torch.multinomial for one sample on CPU);
    # right=True skips zero-probability tokens
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u[None], right=True)), probs.numel() - 1)


def sample(
    logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None
) -> Tuple[int, torch.Tensor]:
    """(V,) logits -> (token, the (V,) distribution it was drawn from)."""
    probs = probabilities(logits, temperature)
    return sample_from(probs, generator), probs


def verify_token(
    p: torch.Tensor, q: torch.Tensor, token: int, generator: Optional[torch.Generator] = None
) -> Tuple[bool, torch.Tensor]:
    """Speculative rejection step: accept `token` ~ q with probability min(1, p/q).

    Returns (accepted, p'): p' is p when accepted, else the residual norm(max(0, p - q)) that the
    next candidate (a sibling in a tree) is checked against, or the final token is drawn from.
    A deterministic candidate (tree node, prompt lookup) is q = one-hot(token): then acceptance is
    p(token) and the residual is p with that token removed — lossless for any number of siblings.
    """
    u = torch.rand((), generator=generator)
    if u * q[token] < p[token]:  # u < p/q without dividing by a zero q
        return True, p
    residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q: unreachable in exact arithmetic (acceptance was certain)
        return False, p
    return False, residual / total


def one_hot(token: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    q = torch.zeros(vocab_size, device=device)
    q[token] = 1.0
    return q
