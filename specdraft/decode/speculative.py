"""Speculative decoding (chain or tree) and plain decoding, as functions over one target cache.

One round, from x_n (sampled, not yet in the target's cache of positions 0..n-1):
    draft a chain / tree after x_n -> one target pass over [x_n, nodes...] at their positions
    -> accept a root-to-leaf path with the rejection rule, plus one target token
    -> keep the cache entries of x_n and the accepted path (rejected ones are dropped)
    -> a drafter with `target_layers` gets the target's hidden states of those kept entries
       (observe_target), as it got the prompt's after the prefill
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import torch
from torch import nn

from specdraft.decode.cache import cache_length, forward, forward_with_hidden, keep_positions, new_cache
from specdraft.decode.drafters import Drafter
from specdraft.decode.sampling import probabilities, sample
from specdraft.decode.tree import accept_path, chain_tv, verification_inputs
from specdraft.errors import SpecdraftError


@dataclass
class Generation:
    tokens: List[int]  # the new tokens (prompt excluded), cut at the first stop token / max_new_tokens
    seconds: float
    accepted: List[int] = field(default_factory=list)  # draft tokens accepted by each target pass
    drafted: List[int] = field(default_factory=list)  # draft tokens proposed to each target pass
    tv: List[float] = field(default_factory=list)  # with record_tv: TV(p, q) at each checked chain position

    @property
    def target_forwards(self) -> int:  # verification passes (the prefill is not counted)
        return len(self.accepted)


def _prompt_tensor(prompt_ids: Sequence[int]) -> torch.Tensor:
    prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    if prompt.numel() == 0:
        raise SpecdraftError("empty prompt: decoding needs at least one prompt token")
    return prompt


def _finished(new_tokens: List[int], max_new_tokens: int, stop: frozenset) -> bool:
    return len(new_tokens) >= max_new_tokens or any(t in stop for t in new_tokens)


def _cut(new_tokens: List[int], max_new_tokens: int, stop: frozenset) -> List[int]:
    new_tokens = new_tokens[:max_new_tokens]
    for i, token in enumerate(new_tokens):
        if token in stop:
            return new_tokens[: i + 1]
    return new_tokens


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    gamma: Optional[int] = None,
    tree: Optional[Sequence[int]] = None,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    stop_tokens: Iterable[int] = (),
    record_tv: bool = False,
) -> Generation:
    """Generate with `drafter` proposing a chain of `gamma` tokens, or a tree of `tree` widths.

    Lossless: greedy output equals the target's greedy decoding; sampled output follows the
    target's distribution. Every round is verified in full (the last one may pass
    max_new_tokens; its extra tokens are cut from `tokens` but counted in the statistics).
    record_tv (chains): also record TV(target p, draft q) at every position the target checked.
    """
    stop = frozenset(stop_tokens)
    gamma = drafter.default_depth if gamma is None else gamma
    device = target.get_input_embeddings().weight.device  # a parameter, or a buffer when held outside ZeRO-3
    t0 = time.perf_counter()
    prompt = _prompt_tensor(prompt_ids)
    cache = new_cache(target)
    layers = drafter.target_layers  # target hidden states the drafter reads (most read none)
    logits, hidden = forward_with_hidden(target, cache, prompt, torch.arange(len(prompt)), layers=layers)
    first, _ = sample(logits[-1], temperature, generator)
    tokens = torch.cat([prompt, torch.tensor([first])])
    drafter.start()
    if layers:
        drafter.observe_target(hidden, 0)
    result = Generation(tokens=[], seconds=0.0)
    while not _finished(tokens[len(prompt) :].tolist(), max_new_tokens, stop):
        n = cache_length(cache)  # tokens[n] is this round's root
        if tree is None:
            draft = drafter.propose_chain(tokens, cache, gamma, temperature, generator)
        else:
            draft = drafter.propose_tree(tokens, cache, tree)
        ids, positions, visible = verification_inputs(draft, int(tokens[-1]), n, device)
        logits, hidden = forward_with_hidden(target, cache, ids, positions, visible, layers=layers)
        target_probs = probabilities(logits, temperature)
        path, next_token = accept_path(draft, target_probs, generator)
        kept = torch.tensor([0] + [1 + node for node in path], dtype=torch.long)  # rows: root, accepted path
        keep_positions(cache, torch.cat([torch.arange(n), n + kept]))
        drafter.rollback(cache_length(cache))
        if layers:  # the verified tokens' states, now at positions n .. n + len(path)
            drafter.observe_target({layer: h[kept.to(h.device)] for layer, h in hidden.items()}, n)
        tokens = torch.cat([tokens, draft.tokens[path], torch.tensor([next_token])])
        result.accepted.append(len(path))
        result.drafted.append(len(draft))
        if record_tv and tree is None and len(draft):
            result.tv.extend(chain_tv(draft, target_probs, len(path)))
    result.tokens = _cut(tokens[len(prompt) :].tolist(), max_new_tokens, stop)
    result.seconds = time.perf_counter() - t0
    return result


@torch.no_grad()
def generate_plain(
    target: nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    stop_tokens: Iterable[int] = (),
) -> Generation:
    """The baseline: one target forward per token, same cache and sampler as above."""
    stop = frozenset(stop_tokens)
    t0 = time.perf_counter()
    prompt = _prompt_tensor(prompt_ids)
    cache = new_cache(target)
    logits = forward(target, cache, prompt, torch.arange(len(prompt)))
    new_tokens: List[int] = []
    while True:
        token, _ = sample(logits[-1], temperature, generator)
        new_tokens.append(token)
        if _finished(new_tokens, max_new_tokens, stop):
            break
        position = len(prompt) + len(new_tokens) - 1
        logits = forward(target, cache, torch.tensor([token]), torch.tensor([position]))
    return Generation(tokens=_cut(new_tokens, max_new_tokens, stop), seconds=time.perf_counter() - t0)
