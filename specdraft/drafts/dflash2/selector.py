"""DFlash2's candidate selector (speculators 0.9.0, models/dflash2/model_definitions.py
CandidateSelector and metrics.py; vLLM's qwen3_dflash2.py): the backbone's unary logits keep their
top-K candidates at each slot, and a bilinear transition score reranks them given the token before:

    score(c | p, h) = unary[c] + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >

Drafting walks the block from the verified anchor: each slot's predecessor is the token chosen at
the slot before (the anchor for the first). Training scores the K candidates of every slot with the
data's previous token as predecessor (teacher-forced) against the target's argmax, a K-way
cross-entropy. Codebooks are raw parameters [V, R] (no `.weight` suffix), as the servers read them."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, initializer_range: float = 0.02):
        super().__init__()
        self.top_k = min(top_k, vocab_size)  # a config asking for more is refused (DFlash2Spec)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        # from a fixed seed, as every family's init: the same draft on every rank and beside other
        # drafts of a run (the global RNG is wherever building the drafts before it left it)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
                weight.copy_(torch.randn(weight.shape, generator=generator) * initializer_range)

    def transition_scores(self, hidden, predecessor_ids, candidate_ids) -> torch.Tensor:
        """hidden (..., H), predecessor_ids (...), candidate_ids (..., K) -> (..., K)."""
        context = self.predecessor_codebook[predecessor_ids.long()] * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype
        )
        return (context.unsqueeze(-2) * self.successor_codebook[candidate_ids.long()]).sum(dim=-1)

    def score_candidates(self, unary_logits, hidden, predecessor_ids, candidate_ids) -> torch.Tensor:
        """unary_logits (..., V) -> the candidates' reranked scores (..., K)."""
        return self.score_candidates_of(unary_logits.gather(-1, candidate_ids), hidden, predecessor_ids, candidate_ids)

    def score_candidates_of(self, unary, hidden, predecessor_ids, candidate_ids) -> torch.Tensor:
        """unary (..., K): the candidates' own unary logits (training makes only these) -> (..., K)."""
        return unary + self.transition_scores(hidden, predecessor_ids, candidate_ids).to(unary.dtype)


def training_candidates(
    candidate_ids: torch.Tensor, target_ids: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K candidates a slot trains on, its label's place among them, and whether the unary top-K
    held the label. A label outside the top-K replaces the weakest candidate (speculators'
    selector_training_candidates): every counted slot then teaches the selector, and the candidate
    set differs from serving's only where serving could not have drafted the label at all."""
    K = candidate_ids.shape[-1]
    matches = candidate_ids.eq(target_ids.unsqueeze(-1))
    contains = matches.any(dim=-1)
    positions = torch.where(contains, matches.long().argmax(dim=-1), K - 1)
    trained = candidate_ids.clone()
    trained[..., -1] = torch.where(contains, trained[..., -1], target_ids)
    return trained, positions, contains


def select_path(
    selector: CandidateSelector, unary_logits, hidden, anchor, temperature: float = 0.0, generator=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One block's draft (S slots: unary_logits (S, V), hidden (S, H)) from the verified anchor ->
    (tokens (S,), q (S, V): each token's proposal distribution, zero outside the slot's K
    candidates). Greedy (temperature 0): the best-scoring candidate, q one-hot; sampled: drawn
    from softmax(scores / T) over the K candidates, q that distribution, so verification by
    rejection sampling stays lossless."""
    candidates = unary_logits.topk(selector.top_k, dim=-1).indices  # (S, K)
    tokens, q = [], torch.zeros_like(unary_logits, dtype=torch.float32)
    previous = torch.as_tensor(anchor, device=unary_logits.device).reshape(())
    for s in range(unary_logits.shape[0]):  # sequential: a slot's predecessor is the slot before's pick
        scores = selector.score_candidates(unary_logits[s], hidden[s], previous, candidates[s]).float()
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1)
            pick = torch.multinomial(probs, 1, generator=generator)[0]
            q[s, candidates[s]] = probs
        else:
            pick = scores.argmax()
            q[s, candidates[s][pick]] = 1.0
        previous = candidates[s][pick]
        tokens.append(previous)
    return torch.stack(tokens), q
