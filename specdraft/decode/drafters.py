"""Drafters: what proposes tokens for the target to verify, behind one small interface.

    drafter.start()                                         a new sequence
    drafter.propose_chain(tokens, target_cache, gamma, temperature, generator) -> DraftTree
    drafter.propose_tree(tokens, target_cache, widths) -> DraftTree
    drafter.rollback(length)                                forget state at positions >= length

`tokens` (n+1,) is the whole sequence so far; the target cache holds positions 0..n-1 and the
last token x_n (the root of this round) is not in it yet.

GlideDrafter      a trained (or freshly built) GLIDE draft reading the target's KV cache
ModelDrafter      any transformers causal LM with its own cache; ModelDrafter(target) is "self"
PromptLookupDrafter  n-gram lookup in the sequence itself (no model)
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import cache_length, crop, forward, last_layer_kv, new_cache
from specdraft.decode.sampling import sample
from specdraft.decode.tree import DraftTree, chain, empty_tree
from specdraft.drafts.glide import GlideDraft, SlidingWindowCache


UNTRAINED_DEPTH = 5  # chain length / tree depth of a drafter trained for no particular depth


class Drafter(ABC):
    name = "drafter"
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
    def propose_chain(self, tokens: torch.Tensor, target_cache, gamma: int, temperature: float,
                      generator: Optional[torch.Generator]) -> DraftTree:
        """Up to gamma tokens following tokens[-1]; q holds the distributions they were drawn from
        (None when they are deterministic picks)."""

    @abstractmethod
    def propose_tree(self, tokens: torch.Tensor, target_cache, widths: Sequence[int]) -> DraftTree:
        """A tree with at most widths[d] nodes at depth d + 1 (deterministic picks)."""

    def rollback(self, length: int) -> None:
        """Forget whatever was computed for positions >= length (tokens the target rejected)."""


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
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     scores=torch.cat(cumulative))


# -- GLIDE -----------------------------------------------------------------------------------

class GlideDrafter(Drafter):
    """A GLIDE draft at inference, reading the target's cache the way it was trained.

    Drafting after x_n (index n): step j feeds the token at index n + j - 1 and reads target K/V
    at positions <= n - 1 (all of the cache), i.e. lag j — training drew lags in [1, max_lag].
    The draft's own self-attention cache is the bounded SlidingWindowCache and only ever holds
    verified tokens: drafted tokens go to a shallow fork of it that is dropped after the round
    (append rebinds the fork's tensors, never writes into the shared ones). So a rejection needs
    no rollback, and the window never loses verified entries to rejected ones.
    """

    name = "glide"

    def __init__(self, draft: GlideDraft, target: nn.Module):
        self.draft = draft
        self.trained_depth = draft.trained_depth
        self.embed_tokens = target.get_input_embeddings()
        self.rotary_emb = target.model.rotary_emb
        weight = next(draft.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        # A copy, not a view: under ZeRO-3 the parameter's storage is released again after each
        # target forward, and this tensor is read outside any module call.
        self.lm_head = target.get_output_embeddings().weight.detach().to(self.device, self.dtype, copy=True)
        self.start()

    def start(self) -> None:
        self.cache = SlidingWindowCache(self.draft.dims.sliding_window)
        self.length = 0  # token indices < length are in self.cache (or slid out of the window)

    def rollback(self, length: int) -> None:
        self.cache.crop(length)
        self.length = min(self.length, length)

    @torch.no_grad()
    def _logits(self, ids: torch.Tensor, index: torch.Tensor, cross_limit: torch.Tensor, target_cache,
                cache: SlidingWindowCache) -> torch.Tensor:
        # ids (R, T) at token indices index (T,) -> logits (R, T, V); R rows share one index
        ids, index, cross_limit = ids.to(self.device), index.to(self.device), cross_limit.to(self.device)
        embeds = self.embed_tokens(ids).to(self.dtype)  # (R, T, H)
        cos, sin = self.rotary_emb(embeds, index[None])  # (1, T, D)
        keys, values = last_layer_kv(target_cache)  # (1, KV, S, D)
        rows = ids.shape[0]
        keys, values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
        hidden = self.draft(embeds, cos.to(self.dtype), sin.to(self.dtype), keys, values,
                            cross_limit, index, cache)
        return self.draft.logits(hidden, self.lm_head).float()

    def _catch_up(self, tokens: torch.Tensor, target_cache) -> torch.Tensor:
        """Feed the verified tokens the draft has not seen, up to and including x_n: -> (V,) logits."""
        n = cache_length(target_cache)
        if self.length > n:  # proposed before in this round: x_n's entry is there, refeed it
            self.rollback(n)
        index = torch.arange(self.length, n + 1)
        # only x_n's output is used. The others just fill the self-attention cache, whose K/V
        # come from the token embeddings alone (one layer), so their cross limit does not matter.
        # Tokens accepted last round are fed here again (their drafted entries were in the fork).
        logits = self._logits(tokens[self.length:n + 1][None], index, index - 1, target_cache, self.cache)
        self.length = n + 1
        return logits[0, -1]

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        n = cache_length(target_cache)
        logits = self._catch_up(tokens, target_cache)
        fork = copy.copy(self.cache)
        drafted, qs = [], []
        for j in range(1, gamma + 1):
            token, q = sample(logits, temperature, generator)
            drafted.append(token)
            qs.append(q)
            if j < gamma:  # token j sits at index n + j and reads the cache up to n - 1
                logits = self._logits(torch.tensor([[token]]), torch.tensor([n + j]), torch.tensor([n - 1]),
                                      target_cache, fork)[0, -1]
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths):
        n = cache_length(target_cache)
        root = self._catch_up(tokens, target_cache)
        rows = copy.copy(self.cache)  # batch row r = the path to frontier node r

        def expand(parent_rows, new_tokens, depth):
            rows.keys, rows.values = rows.keys[parent_rows], rows.values[parent_rows]
            logits = self._logits(new_tokens[:, None], torch.tensor([n + depth]), torch.tensor([n - 1]),
                                  target_cache, rows)
            return F.log_softmax(logits[:, -1], dim=-1)

        return grow_tree(F.log_softmax(root, dim=-1), widths, expand)


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
        return forward(self.model, self.cache, tokens[m:n + 1], torch.arange(m, n + 1))[-1]

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
            starts = (windows == pattern).all(dim=1).nonzero().flatten().flip(0)[:4 * self.max_matches]
            # latest first
            follows = [tokens[start + size:start + size + length].tolist() for start in starts.tolist()]
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
        return DraftTree(torch.tensor([node_tokens[i] for i in order], dtype=torch.long),
                         torch.tensor([new_id[parents[i]] if parents[i] >= 0 else -1 for i in order],
                                      dtype=torch.long))
