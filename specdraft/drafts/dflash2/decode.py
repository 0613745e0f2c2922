"""DFlash2 at inference: DFlash's round (one backbone forward drafts the block's hidden states and
unary logits), then the selector walks the block slot by slot from the anchor, each slot's
predecessor the token chosen at the slot before:

    chain  slot s: the K unary candidates scored by the selector; greedy: the best; sampled: drawn
           from softmax(scores / T) over them, which is the q verification rejects against, so
           decoding stays lossless (sample() over logits -inf outside the candidates)
    tree   a node at depth d fills slot first + d with its own token as predecessor; its children
           are its slot's candidates by their log-probabilities"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from specdraft.decode.cache import cache_length
from specdraft.decode.drafters import grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import DraftTree, chain
from specdraft.drafts.dflash.decode import DFlashDrafter


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"

    def _slot_scores(self, hidden: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """N rows of one slot: hidden (N, H), unary (N, V), previous (N,) -> (N, V) float scores,
        -inf outside each row's K unary candidates."""
        selector = self.draft.candidate_selector
        candidates = unary.topk(selector.top_k, dim=-1).indices
        scores = selector.score_candidates(unary, hidden, previous, candidates).float()
        return torch.full_like(unary, float("-inf"), dtype=torch.float32).scatter(-1, candidates, scores)

    def _block(self, tokens, target_cache):
        n = cache_length(target_cache)
        anchor = int(tokens[n])
        hidden = self.block_hidden(anchor, n)[0]  # (S, H)
        unary = self.draft.block_head(hidden[None], None, self.head_weight).logits()[0].float()  # (S, V)
        return anchor, hidden, unary

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator) -> DraftTree:
        anchor, hidden, unary = self._block(tokens, target_cache)
        first = self.layout.first_slot
        previous = torch.tensor([anchor], device=self.device)
        drafted, qs = [], []
        for j in range(min(gamma, self.layout.predictions)):
            slot = first + j
            scores = self._slot_scores(hidden[slot : slot + 1], unary[slot : slot + 1], previous)[0]
            token, q = sample(scores, temperature, generator)  # q: what the token was drawn from
            drafted.append(token)
            qs.append(q)
            previous = torch.tensor([token], device=self.device)
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths: Sequence[int]) -> DraftTree:
        anchor, hidden, unary = self._block(tokens, target_cache)
        first = self.layout.first_slot

        def slot_logprobs(depth: int, previous: torch.Tensor) -> torch.Tensor:
            count = previous.shape[0]
            slot = first + depth
            scores = self._slot_scores(hidden[slot].expand(count, -1), unary[slot].expand(count, -1), previous)
            return F.log_softmax(scores, dim=-1)

        root = slot_logprobs(0, torch.tensor([anchor], device=self.device))[0]
        return grow_tree(
            root,
            list(widths)[: self.layout.predictions],
            lambda rows, new_tokens, depth: slot_logprobs(depth, new_tokens.to(self.device)),
        )
