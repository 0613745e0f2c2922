"""Drafters: what proposes tokens for the target to verify, behind one small interface.

    drafter.start()                                         a new sequence
    drafter.propose_chain(tokens, target_cache, gamma, temperature, generator) -> DraftTree
    drafter.propose_tree(tokens, target_cache, widths) -> DraftTree
    drafter.rollback(length)                                forget state at positions >= length

`tokens` (n+1,) is the whole sequence so far; the target cache holds positions 0..n-1 and the
last token x_n (the root of this round) is not in it yet.

A drafter that needs the target's hidden states of verified tokens names the layers in
`target_layers` (vLLM's convention: the input of each layer); speculative_generate then hands
them over through `observe_target(hidden, start)` after the prefill and every verification.

Drafters of trained draft models live with their family in specdraft.drafts (draft.make_drafter).
ModelDrafter      any transformers causal LM with its own cache; ModelDrafter(target) is "self"
PromptLookupDrafter  n-gram lookup in the sequence itself (no model)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import cache_length, crop, forward, new_cache
from specdraft.decode.sampling import sample
from specdraft.decode.tree import DraftTree, chain, empty_tree


UNTRAINED_DEPTH = 5  # chain length / tree depth of a drafter trained for no particular depth


class Drafter(ABC):
    name = "drafter"
    target_layers: Tuple[int, ...] = ()  # target hidden states this drafter reads (layer inputs)
    # How many tokens ahead the drafter's model was trained to propose; None: no training to
    # follow (prompt lookup, the target itself)
    trained_depth: Optional[int] = None

    @property
    def default_depth(self) -> int:
        """The chain length and tree depth used when none is asked for."""
        return self.trained_depth or UNTRAINED_DEPTH

    def start(self) -> None:
        """Reset per-sequence state."""

    @abstractmethod
    def propose_chain(
        self, tokens: torch.Tensor, target_cache, gamma: int, temperature: float, generator: Optional[torch.Generator]
    ) -> DraftTree:
        """Up to gamma tokens following tokens[-1]; q holds the distributions they were drawn from
        (None when they are deterministic picks)."""

    @abstractmethod
    def propose_tree(self, tokens: torch.Tensor, target_cache, widths: Sequence[int]) -> DraftTree:
        """A tree with at most widths[d] nodes at depth d + 1 (deterministic picks)."""

    def rollback(self, length: int) -> None:
        """Forget whatever was computed for positions >= length (tokens the target rejected)."""

    def observe_target(self, hidden: Dict[int, torch.Tensor], start: int) -> None:
        """The target's hidden states {layer: (T, H)} of verified tokens at positions start..start+T-1
        (called only when target_layers is not empty)."""


# -- tree growth shared by the model drafters ------------------------------------------------

Expand = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def grow_tree(root_logprobs: torch.Tensor, widths: Sequence[int], expand: Expand) -> DraftTree:
    """Top-k per depth (beam over cumulative draft log-probability, as EAGLE-2 / LongSpec).

    Depth d keeps the widths[d-1] best children of all depth d-1 nodes together. `expand(rows,
    tokens, depth)` runs the draft on the new frontier — node i continues frontier row rows[i] —
    and returns their next-token log-probs (len(tokens), V).
    """
    tokens: List[int] = []
    parents: List[int] = []
    cumulative: List[torch.Tensor] = []
    logprobs = root_logprobs[None]  # (rows, V), one row per frontier node
    scores = root_logprobs.new_zeros(1)
    frontier = [-1]  # node id of each row; the root is -1
    for d, width in enumerate(widths):
        total = (scores[:, None] + logprobs).flatten()
        scores, flat = total.topk(min(int(width), total.numel()))
        rows = flat // logprobs.shape[1]
        new_tokens = flat % logprobs.shape[1]
        first = len(tokens)
        parents += [frontier[r] for r in rows.tolist()]
        tokens += new_tokens.tolist()
        cumulative.append(scores)
        frontier = list(range(first, len(tokens)))
        if d + 1 < len(widths):
            logprobs = expand(rows, new_tokens, d + 1)
    # nodes are level by level and best-first within a level: parents precede children and
    # siblings are offered to the target in the draft's order of preference
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), scores=torch.cat(cumulative)
    )


# -- any causal LM (including the target itself) ---------------------------------------------


class ModelDrafter(Drafter):
    """A separate transformers causal LM drafting with its own position-indexed cache.

    ModelDrafter(target) is the "self" drafter (the target drafting for itself): every greedy
    chain is accepted whole, tau = gamma + 1 — a check of the harness, and tau's ceiling.
    """

    def __init__(self, model: nn.Module, name: str = "model"):
        self.model = model
        self.name = name
        self.start()

    def start(self) -> None:
        self.cache = new_cache(self.model)

    def rollback(self, length: int) -> None:
        crop(self.cache, length)

    def _catch_up(self, tokens: torch.Tensor, n: int) -> torch.Tensor:
        if cache_length(self.cache) > n:  # drafted entries of an earlier proposal this round
            crop(self.cache, n)
        m = cache_length(self.cache)
        return forward(self.model, self.cache, tokens[m : n + 1], torch.arange(m, n + 1))[-1]

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        n = cache_length(target_cache)
        logits = self._catch_up(tokens, n)
        drafted, qs = [], []
        for j in range(1, gamma + 1):
            token, q = sample(logits, temperature, generator)
            drafted.append(token)
            qs.append(q)
            if j < gamma:
                logits = forward(self.model, self.cache, torch.tensor([token]), torch.tensor([n + j]))[-1]
        return chain(drafted, torch.stack(qs))  # rejected entries are cropped by rollback

    def propose_tree(self, tokens, target_cache, widths):
        n = cache_length(target_cache)
        root = self._catch_up(tokens, n)
        base = n + 1  # the cache now holds positions 0..n; tree nodes are appended after them
        state = {"paths": [[]], "fed": 0}  # cache slots of each frontier row's tree ancestors

        def expand(parent_rows, new_tokens, depth):
            fed, count = state["fed"], len(new_tokens)
            paths = [state["paths"][r] + [base + fed + i] for i, r in enumerate(parent_rows.tolist())]
            visible = torch.zeros(count, base + fed + count, dtype=torch.bool)
            visible[:, :base] = True
            for i, slots in enumerate(paths):
                visible[i, slots] = True
            logits = forward(self.model, self.cache, new_tokens, torch.full((count,), n + depth), visible)
            state["paths"], state["fed"] = paths, fed + count
            return F.log_softmax(logits, dim=-1)

        tree = grow_tree(F.log_softmax(root, dim=-1), widths, expand)
        crop(self.cache, base)  # drop the tree nodes: the next round re-feeds what was accepted
        return tree


# -- prompt lookup ---------------------------------------------------------------------------


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it. No model, no state."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 64):
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    def continuations(self, tokens: torch.Tensor, length: int) -> List[List[int]]:
        """Continuations of earlier matches: longest n-gram first; then the longest continuation
        (a match just before the end, as in a repetition, leaves only a token or two); then the
        latest match."""
        found: List[List[int]] = []
        total = tokens.numel()
        for size in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            pattern = tokens[-size:]
            windows = tokens[:-1].unfold(0, size, 1)  # (total - size, size): every earlier n-gram
            starts = (windows == pattern).all(dim=1).nonzero().flatten().flip(0)[: 4 * self.max_matches]
            # latest first
            follows = [tokens[start + size : start + size + length].tolist() for start in starts.tolist()]
            for follow in sorted(follows, key=len, reverse=True):  # stable: latest first among equals
                if follow not in found:
                    found.append(follow)
                if len(found) >= self.max_matches:
                    return found
        return found

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        found = self.continuations(tokens, gamma)
        return chain(found[0]) if found else empty_tree()

    def propose_tree(self, tokens, target_cache, widths):
        # merge the continuations into a trie, at most widths[d] nodes at depth d + 1
        node_tokens: List[int] = []
        parents: List[int] = []
        per_depth = [0] * len(widths)
        child = {}  # (parent node, token) -> node
        for follow in self.continuations(tokens, len(widths)):
            parent = -1
            for d, token in enumerate(follow):
                key = (parent, token)
                if key not in child:
                    if per_depth[d] >= widths[d]:
                        break
                    child[key] = len(node_tokens)
                    node_tokens.append(token)
                    parents.append(parent)
                    per_depth[d] += 1
                parent = child[key]
        if not node_tokens:
            return empty_tree()
        # level order keeps "parents first" and each node's children in match preference order
        depth = [0] * len(node_tokens)
        for i, parent in enumerate(parents):
            depth[i] = 0 if parent < 0 else depth[parent] + 1
        order = sorted(range(len(node_tokens)), key=lambda i: (depth[i], i))
        new_id = {old: new for new, old in enumerate(order)}
        return DraftTree(
            torch.tensor([node_tokens[i] for i in order], dtype=torch.long),
            torch.tensor([new_id[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=torch.long),
        )
