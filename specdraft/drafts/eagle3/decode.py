"""EAGLE-3 at inference: a Drafter fed with the target's hidden states of verified tokens.

Index t of the draft's own K/V cache holds (target states at position t, token x_{t+1}) at RoPE
position t + 1, exactly as TTT step 0 saw them in training. A round from x_n (target cache
holding 0..n-1): feed the indices not fed yet up to n-1 (their target states arrive through
observe_target after each verification) -> logits of x_{n+1}; each further drafted token is one
more step whose hidden input is the draft's own output and whose key sits after the verified
ones (TTT step k). Drafted entries live in round-local tensors only, so a rejection needs no
rollback of the cache. Draft ids map to target ids through d2t; the draft distribution is put on
the target vocab (zero outside the draft vocab), so rejection sampling stays lossless.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import DraftCache, append_kv, cache_length
from specdraft.decode.drafters import Drafter, grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import chain
from specdraft.drafts.eagle3.vocab import draft_to_target_ids


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, draft: nn.Module, target: nn.Module):
        self.draft = draft
        self.trained_depth = draft.trained_depth
        self.target_layers = tuple(draft.dims.target_layers)
        self.embed_tokens = target.get_input_embeddings()
        weight = next(draft.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self.draft_ids = draft_to_target_ids(draft.d2t).to(self.device)  # (N,) target id of each draft id
        self.vocab_size = draft.dims.vocab_size
        self.start()

    def start(self) -> None:
        self.cache = DraftCache()  # states: fc(target states) (P, H) of positions 0..P-1

    def observe_target(self, hidden: Dict[int, torch.Tensor], start: int) -> None:
        aux = torch.cat([hidden[layer] for layer in self.target_layers], dim=-1).to(self.device, self.dtype)
        with torch.no_grad():
            fused = self.draft.fuse(aux)  # (T, H)
        self.cache.observe(fused, start)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., N) draft logits -> (..., V) on the target vocab, -inf outside the draft vocab."""
        full = logits.new_full(logits.shape[:-1] + (self.vocab_size,), float("-inf"))
        full[..., self.draft_ids] = logits
        return full.float()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(self.device, self.dtype)

    @torch.no_grad()
    def _catch_up(self, tokens: torch.Tensor, n: int):
        """Feed indices fed..n-1 (target states, next tokens) -> (hidden, logits) of index n-1."""
        cache = self.cache
        start, visible = cache.catch_up(n, self.device)
        embeds = self._embed(tokens[start + 1 : n + 1][None])  # (1, count, H) x_{t+1}
        positions = torch.arange(start + 1, n + 1, device=self.device)
        hidden, head_in, k, v = self.draft.step(
            embeds, cache.states[None, start:n], positions, cache.keys, cache.values, visible
        )
        cache.fed_up_to(n, append_kv(cache.keys, k), append_kv(cache.values, v))
        return hidden[:, -1:], self.draft.logits(head_in[:, -1])  # (1, 1, H), (1, N)

    @torch.no_grad()
    def _draft_step(self, token_ids: torch.Tensor, hidden, keys, values, position: int):
        """Rows r: token_ids[r] at `position` after keys[r] (all visible) -> hidden, logits, k, v."""
        positions = torch.tensor([position], device=self.device)
        hidden, head_in, k, v = self.draft.step(
            self._embed(token_ids[:, None]), hidden, positions, keys, values, visible=None
        )
        return hidden, self.draft.logits(head_in[:, -1]), append_kv(keys, k), append_kv(values, v)

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        n = cache_length(target_cache)
        hidden, logits = self._catch_up(tokens, n)
        keys, values = self.cache.keys, self.cache.values
        drafted, qs = [], []
        for j in range(1, gamma + 1):
            token, q = sample(self._target_logits(logits[0]), temperature, generator)
            drafted.append(token)
            qs.append(q)
            if j < gamma:  # drafted token j: index n - 1 + j, position n + j
                hidden, logits, keys, values = self._draft_step(
                    torch.tensor([token], device=self.device), hidden, keys, values, n + j
                )
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths):
        n = cache_length(target_cache)
        hidden, logits = self._catch_up(tokens, n)
        rows = {"hidden": hidden, "keys": self.cache.keys, "values": self.cache.values}  # row r: frontier node r's path

        def expand(parent_rows, new_tokens, depth):
            parent_rows = parent_rows.to(self.device)
            h, lg, k, v = self._draft_step(
                new_tokens,
                rows["hidden"][parent_rows],
                rows["keys"][parent_rows],
                rows["values"][parent_rows],
                n + depth,
            )
            rows.update(hidden=h, keys=k, values=v)
            return F.log_softmax(self._target_logits(lg), dim=-1)

        return grow_tree(F.log_softmax(self._target_logits(logits[0]), dim=-1), widths, expand)
