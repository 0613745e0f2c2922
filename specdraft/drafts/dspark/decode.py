"""DSpark at inference: DFlash's round (one backbone forward drafts the block's hidden states), then
the block is drafted slot by slot, because the Markov head reads each slot's previous token:

    slots before the first predicting one: previous token = the anchor (they feed the rnn state)
    slot s: head(h_s, previous token, state) -> logits, confidence; the token drawn (chain) or the
            beam's children (tree) are the previous tokens of slot s + 1

Confidence stop (confidence_threshold c > 0): a chain stops at the first slot whose confidence
sigmoid(conf_s) < c (that slot is not drafted); in a tree a node whose children's slot has
confidence < c gets no children. Every proposed token is still verified by the target as before
(rejection sampling from the distribution it was drawn from), so decoding stays lossless.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from specdraft.decode.cache import cache_length
from specdraft.decode.drafters import grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import DraftTree, chain, empty_tree
from specdraft.drafts.dflash.decode import DFlashDrafter


def keep_nodes(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """The tree without the nodes where keep (N,) is False and their descendants."""
    keep = keep.clone()
    for i, parent in enumerate(tree.parents.tolist()):  # parents come first
        if parent >= 0 and not keep[parent]:
            keep[i] = False
    index = keep.nonzero().flatten()
    new_id = torch.full((len(tree),), -1, dtype=torch.long, device=index.device)
    new_id[index] = torch.arange(index.numel(), device=index.device)
    parents = tree.parents[index]
    parents = torch.where(parents >= 0, new_id[parents.clamp_min(0)], parents)
    return DraftTree(
        tree.tokens[index],
        parents,
        None if tree.q is None else tree.q[index],
        None if tree.scores is None else tree.scores[index],
    )


class DSparkDrafter(DFlashDrafter):
    name = "dspark"

    def __init__(self, draft, target, confidence_threshold: Optional[float] = None):
        super().__init__(draft, target)
        # decoding's stop; the config's draft.confidence_threshold unless eval overrides it
        self.confidence_threshold = float(
            draft.dims.confidence_threshold if confidence_threshold is None else confidence_threshold
        )

    def _head(self, hidden: torch.Tensor, previous: torch.Tensor, state):
        """One slot for N rows: hidden (N, H), previous (N,) -> (logits (N, V) float, confidence (N,), state)."""
        head = self.draft.block_head(hidden[:, None], previous[:, None], self.head_weight, state)
        return head.logits()[:, 0].float(), torch.sigmoid(head.confidence[:, 0].float()).detach(), head.state

    def _start_block(self, tokens, target_cache):
        """The round's backbone forward and the head up to the first predicting slot -> (hidden (S, H),
        that slot's logits (V,), its confidence, the state after it)."""
        n = cache_length(target_cache)
        anchor = int(tokens[n])
        hidden = self.block_hidden(anchor, n)[0]
        previous = torch.tensor([anchor], device=self.device)
        state = None
        for slot in range(self.layout.first_slot + 1):
            logits, confidence, state = self._head(hidden[slot : slot + 1], previous, state)
        return hidden, logits[0], float(confidence[0]), state

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator) -> DraftTree:
        hidden, logits, confidence, state = self._start_block(tokens, target_cache)
        first = self.layout.first_slot
        drafted, qs = [], []
        for j in range(min(gamma, self.layout.predictions)):
            if confidence < self.confidence_threshold:  # the block stops before this slot
                break
            token, q = sample(logits, temperature, generator)  # q: what the token was drawn from
            drafted.append(token)
            qs.append(q)
            if j + 1 < min(gamma, self.layout.predictions):
                row, conf, state = self._head(
                    hidden[first + j + 1 : first + j + 2], torch.tensor([token], device=self.device), state
                )
                logits, confidence = row[0], float(conf[0])
        return chain(drafted, torch.stack(qs)) if drafted else empty_tree()

    def propose_tree(self, tokens, target_cache, widths: Sequence[int]) -> DraftTree:
        hidden, logits, confidence, state = self._start_block(tokens, target_cache)
        if confidence < self.confidence_threshold:
            return empty_tree()
        first = self.layout.first_slot
        carried = {"state": state}

        def expand(rows, new_tokens, depth):
            # every node at depth d fills slot first + d, reading its own token as the previous one
            count = len(new_tokens)
            state = carried["state"]
            logits, confidence, carried["state"] = self._head(
                hidden[first + depth].expand(count, -1),
                new_tokens.to(self.device),
                None if state is None else state[rows.to(state.device)],
            )
            logprobs = F.log_softmax(logits, dim=-1)
            # a node whose next slot falls below the threshold gets no children (dropped below)
            return logprobs.masked_fill((confidence < self.confidence_threshold)[:, None], float("-inf"))

        tree = grow_tree(F.log_softmax(logits, dim=-1), list(widths)[: self.layout.predictions], expand)
        return keep_nodes(tree, torch.isfinite(tree.scores.cpu())) if self.confidence_threshold > 0 else tree
