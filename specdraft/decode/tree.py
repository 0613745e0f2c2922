"""Draft trees: what a drafter proposes in one round, how the target sees it, which path it keeps.

A round starts from the last committed token x_n (the "root": sampled, not yet in the target's
cache). A chain of gamma tokens is the tree whose node i has parent i - 1.

    nodes   0 .. N-1, ordered so that a parent comes before its children and siblings are in the
            drafter's order of preference (the order they are offered to the target)
    parents (N,) index of the parent node, -1 for a child of the root
    depth   (N,) 1 for children of the root
    q       (N, V) the draft distribution each node's token was sampled from, or None when the
            nodes are deterministic picks (top-k, prompt lookup): then q is one-hot(token)
    scores  (N,) optional: the draft's cumulative log-probability of the path to each node
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from specdraft.decode.sampling import one_hot, sample_from, verify_token


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long, -1 = child of the root
    q: Optional[torch.Tensor] = None  # (N, V) sampling distributions; None: deterministic picks
    scores: Optional[torch.Tensor] = None  # (N,) cumulative draft log-prob of each node's path

    def __post_init__(self):
        assert self.tokens.shape == self.parents.shape
        assert bool((self.parents < torch.arange(len(self.parents))).all()), "parents come first"

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def depth(self) -> torch.Tensor:  # (N,) 1 for children of the root
        depth = torch.zeros(len(self), dtype=torch.long)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(len(self)) - 1).all())

    def children(self, node: int) -> List[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def ancestors(self) -> torch.Tensor:
        """(N, N) bool: [i, j] when node j is node i or one of its ancestors."""
        n = len(self)
        seen = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                seen[i] |= seen[parent]
        return seen


def empty_tree() -> DraftTree:
    return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


def chain(tokens: Sequence[int], q: Optional[torch.Tensor] = None) -> DraftTree:
    n = len(tokens)
    return DraftTree(torch.tensor(list(tokens), dtype=torch.long), torch.arange(n) - 1, q)


def verification_inputs(
    tree: DraftTree, root_token: int, cache_length: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The target's verification pass over [root, nodes...], on `device` (the target's):
    (ids (1+N,), positions (1+N,), visible).

    visible is None for a chain (plain causal attention) and otherwise the (1+N, cache_length+1+N)
    bool mask: every query sees the whole cache, its ancestors in the tree, the root and itself.
    """
    # the tree's structure is host bookkeeping (small); only the results go to the device
    ids = torch.cat([torch.tensor([root_token]), tree.tokens]).to(device)
    positions = (cache_length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])).to(device)
    if tree.is_chain:
        return ids, positions, None
    n = len(tree)
    in_tree = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()  # root row/column; rest replaced
    in_tree[1:, 1:] = tree.ancestors()
    in_tree[0, 1:] = False
    # the cache-wide block is the big one: made where it is used
    visible = torch.cat([torch.ones(n + 1, cache_length, dtype=torch.bool, device=device), in_tree.to(device)], dim=1)
    return ids, positions, visible


def chain_tv(tree: DraftTree, target_probs: torch.Tensor, accepted: int) -> List[float]:
    """TV(p, q) = 1/2 sum |p - q| at each chain position the target checked: the `accepted` ones and
    the first rejected one. Speculative sampling accepts position j with probability 1 - TV(p_j, q_j).

    target_probs (1+N, V): row j is the target's distribution where node j was drafted. q is the
    draft's sampling distribution, one-hot(token) for deterministic picks.
    """
    checked = min(accepted + 1, len(tree))
    p = target_probs[:checked]
    q = tree.q[:checked].to(p) if tree.q is not None else one_hot_rows(tree.tokens[:checked], p)
    return (0.5 * (p - q).abs().sum(dim=-1)).tolist()


def one_hot_rows(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens.to(like.device), like.shape[-1]).to(like.dtype)


def accept_path(
    tree: DraftTree, target_probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> Tuple[List[int], int]:
    """Walk the tree from the root, checking each node's children in order.

    target_probs (1+N, V): row 0 is the target's next-token distribution at the root, row i+1 at
    node i. Returns (accepted node ids, root to leaf; the next token: the residual's sample where
    the walk stopped, or the bonus token after the last accepted node).
    """
    vocab = target_probs.shape[-1]
    path: List[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        for child in tree.children(node):
            token = int(tree.tokens[child])
            q = tree.q[child] if tree.q is not None else one_hot(token, vocab, p.device)
            accepted, p = verify_token(p, q, token, generator)
            if accepted:
                path.append(child)
                node = child
                break
        else:
            return path, sample_from(p, generator)
