"""GLIDE at inference: its sliding-window self-attention cache and its Drafter.

The drafter reads the target's last-layer KV cache with the lag the draft was trained on; its own
self-attention cache is a bounded buffer of the last `sliding_window` verified tokens.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import cache_length, last_layer_kv
from specdraft.decode.drafters import Drafter, grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import chain
from specdraft.target.capture import rotary_tables


class SlidingWindowCache:
    """The draft's self-attention K/V at inference: a bounded buffer of the last `window` tokens.

    Entries are keyed by token index, so a rejected draft is undone by `crop(n)` and the next
    round simply writes its positions again.
    """

    def __init__(self, window: int):
        self.window = window
        self.keys: Optional[torch.Tensor] = None  # (B, KV, <=window, D)
        self.values: Optional[torch.Tensor] = None
        self.index: Optional[torch.Tensor] = None  # (<=window,) token index of each entry

    def append(self, keys, values, index) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add new entries; return what the new queries may attend to (old + new)."""
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
            index = torch.cat([self.index, index])
        self.keys, self.values, self.index = (
            keys[:, :, -self.window :],
            values[:, :, -self.window :],
            index[-self.window :],
        )
        return keys, values, index

    def crop(self, length: int) -> None:
        """Forget entries at token index >= length (drafted tokens the target rejected)."""
        if self.index is not None:
            keep = self.index < length
            self.keys, self.values, self.index = self.keys[:, :, keep], self.values[:, :, keep], self.index[keep]

    def __len__(self) -> int:
        return 0 if self.index is None else int(self.index.numel())


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

    def __init__(self, draft: nn.Module, target: nn.Module):
        self.draft = draft
        self.trained_depth = draft.trained_depth
        self.embed_tokens = target.get_input_embeddings()
        self.rotary_emb = rotary_tables(target.model)  # the capture's: the RoPE of the last layer's keys
        weight = next(draft.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        # A copy, not a view: under ZeRO-3 the parameter's storage is released again after each
        # target forward, and this tensor is read outside any module call.
        self.lm_head = target.get_output_embeddings().weight.detach().to(self.dtype, copy=True)
        self.start()

    def start(self) -> None:
        self.cache = SlidingWindowCache(self.draft.dims.sliding_window)
        self.length = 0  # token indices < length are in self.cache (or slid out of the window)

    def rollback(self, length: int) -> None:
        self.cache.crop(length)
        self.length = min(self.length, length)

    @torch.no_grad()
    def _logits(
        self, ids: torch.Tensor, index: torch.Tensor, cross_limit: torch.Tensor, target_cache, cache: SlidingWindowCache
    ) -> torch.Tensor:
        # ids (R, T) at token indices index (T,) -> logits (R, T, V); R rows share one index
        ids, index, cross_limit = ids.to(self.device), index.to(self.device), cross_limit.to(self.device)
        embeds = self.embed_tokens(ids).to(self.dtype)  # (R, T, H)
        cos, sin = self.rotary_emb(embeds, index[None])  # (1, T, D)
        keys, values = last_layer_kv(target_cache)  # (1, KV, S, D)
        rows = ids.shape[0]
        keys, values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
        hidden = self.draft(embeds, cos.to(self.dtype), sin.to(self.dtype), keys, values, cross_limit, index, cache)
        return self.draft.logits(hidden, self.lm_head).float()

    def _catch_up(self, tokens: torch.Tensor, target_cache) -> torch.Tensor:
        """Feed the verified tokens the draft has not seen, up to and including x_n: -> (V,) logits."""
        n = cache_length(target_cache)
        if self.length > n:  # proposed before in this round: x_n's entry is there, refeed it
            self.rollback(n)
        index = torch.arange(self.length, n + 1, device=self.device)
        # only x_n's output is used. The others just fill the self-attention cache, whose K/V
        # come from the token embeddings alone (one layer), so their cross limit does not matter.
        # Tokens accepted last round are fed here again (their drafted entries were in the fork).
        logits = self._logits(tokens[self.length : n + 1][None], index, index - 1, target_cache, self.cache)
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
                index = torch.tensor([n + j, n - 1], device=self.device)  # token index, cross limit
                logits = self._logits(
                    torch.tensor([[token]], device=self.device), index[:1], index[1:], target_cache, fork
                )[0, -1]
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths):
        n = cache_length(target_cache)
        root = self._catch_up(tokens, target_cache)
        rows = copy.copy(self.cache)  # batch row r = the path to frontier node r

        def expand(parent_rows, new_tokens, depth):
            rows.keys, rows.values = rows.keys[parent_rows], rows.values[parent_rows]
            index = torch.tensor([n + depth, n - 1], device=self.device)  # token index, cross limit
            logits = self._logits(new_tokens[:, None], index[:1], index[1:], target_cache, rows)
            return F.log_softmax(logits[:, -1], dim=-1)

        return grow_tree(F.log_softmax(root, dim=-1), widths, expand)
