"""MTP at inference: the layer's own K/V cache over the target's final hidden states of verified
tokens, as vLLM's MTP proposer runs it (method "mtp").

Index t of the cache holds (target final hidden h_t, token x_{t+1}) at RoPE position t, as step 0
saw it in training. A round from x_n (target cache holding 0..n-1): feed the indices not fed yet
up to n-1 -> the output at n-1, whose logits through the target's lm_head propose x_{n+1}; each
further drafted token is one more pass at the next position whose hidden input is the layer's own
previous output (the recursion), its key after the verified ones. Drafted entries live in
round-local tensors only, so a rejection needs no rollback of the cache. The draft proposes over
the target's whole vocabulary; rejection sampling keeps decoding lossless.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import DraftCache, append_kv, cache_length
from specdraft.decode.drafters import Drafter, grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import chain


class RoundCache:
    """What transformers' attention asks of a cache (update(k, v, layer_idx) -> all keys, values),
    over given past keys/values (R, KV, S, D): the new ones are kept apart for the caller."""

    def __init__(self, keys: Optional[torch.Tensor], values: Optional[torch.Tensor]):
        self.keys, self.values = keys, values
        self.new_keys = self.new_values = None

    def update(self, keys, values, layer_idx, *args, **kwargs):
        self.new_keys, self.new_values = keys, values
        return append_kv(self.keys, keys), append_kv(self.values, values)


class MTPDrafter(Drafter):
    name = "mtp"

    def __init__(self, draft: nn.Module, target: nn.Module):
        self.draft = draft
        self.trained_depth = draft.trained_depth
        self.target_layers = (target.config.get_text_config().num_hidden_layers,)  # the final norm's input
        self.target_model = target.model
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings().weight
        weight = next(draft.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self.start()

    def start(self) -> None:
        self.cache = DraftCache()  # states: the target's final hidden states (P, H) of positions 0..P-1

    def observe_target(self, hidden: Dict[int, torch.Tensor], start: int) -> None:
        # the last layer's output, through the target's own final norm: its lm_head's input
        (layer_output,) = hidden.values()
        with torch.no_grad():
            final = self.target_model.norm(layer_output).to(self.device, self.dtype)
        self.cache.observe(final, start)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(self.device, self.dtype)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return (out.to(self.lm_head.dtype) @ self.lm_head.t().to(out.device)).float()

    def _pass(self, hidden, ids, positions, keys, values, visible):
        """The layer over rows of new entries: hidden (R, N, H), ids (R, N) at positions (N,), after
        past keys/values (R, KV, S, D) -> (output (R, N, H), all keys, all values)."""
        cos, sin = self.target_model.rotary_emb(hidden, positions[None].expand(hidden.shape[0], -1))
        cache = RoundCache(keys, values)
        mask = None if visible is None else visible[None, None].expand(hidden.shape[0], 1, -1, -1)
        out = self.draft.step(hidden, self._embed(ids), cos, sin, mask, cache)
        return out, append_kv(keys, cache.new_keys), append_kv(values, cache.new_values)

    @torch.no_grad()
    def _catch_up(self, tokens: torch.Tensor, n: int):
        """Feed indices fed..n-1 (target hidden h_t, token x_{t+1}) -> the output at index n-1 (1, 1, H)."""
        cache = self.cache
        start, visible = cache.catch_up(n, self.device)
        out, keys, values = self._pass(
            cache.states[None, start:n],
            tokens[start + 1 : n + 1][None],
            torch.arange(start, n, device=self.device),
            cache.keys,
            cache.values,
            visible,
        )
        cache.fed_up_to(n, keys, values)
        return out[:, -1:]

    @torch.no_grad()
    def _draft_step(self, token_ids: torch.Tensor, hidden, keys, values, position: int):
        """Rows r: the layer's previous output hidden[r] with token_ids[r] at `position`, after keys[r]."""
        positions = torch.tensor([position], device=self.device)
        return self._pass(hidden, token_ids[:, None], positions, keys, values, visible=None)

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        n = cache_length(target_cache)
        hidden = self._catch_up(tokens, n)
        keys, values = self.cache.keys, self.cache.values
        drafted, qs = [], []
        for j in range(1, gamma + 1):
            token, q = sample(self._logits(hidden[0, -1]), temperature, generator)
            drafted.append(token)
            qs.append(q)
            if j < gamma:  # drafted token j (x_{n+j}) sits at index n - 1 + j, position n - 1 + j
                hidden, keys, values = self._draft_step(
                    torch.tensor([token], device=self.device), hidden, keys, values, n - 1 + j
                )
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths):
        n = cache_length(target_cache)
        hidden = self._catch_up(tokens, n)
        rows = {"hidden": hidden, "keys": self.cache.keys, "values": self.cache.values}  # row r: frontier node r's path

        def expand(parent_rows, new_tokens, depth):
            parent_rows = parent_rows.to(self.device)
            h, k, v = self._draft_step(
                new_tokens.to(self.device),
                rows["hidden"][parent_rows],
                rows["keys"][parent_rows],
                rows["values"][parent_rows],
                n - 1 + depth,
            )
            rows.update(hidden=h, keys=k, values=v)
            return F.log_softmax(self._logits(h[:, -1]), dim=-1)

        return grow_tree(F.log_softmax(self._logits(hidden[0, -1]), dim=-1), widths, expand)
