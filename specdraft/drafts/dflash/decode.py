"""DFlash at inference: one draft forward per round drafts the whole block.

Round from x_n (the last verified token; the target's cache holds positions 0..n-1):
    block [x_n, MASK x (S-1)] at positions n .. n+S-1, context = every position < n
    -> one forward -> logits of the predicting slots -> a chain (sampled per slot from its own
       distribution, so rejection sampling stays lossless) or a tree (top-k beam over the slots'
       log-probs; every node of depth d reads the same slot, so the tree costs no extra forward)

The context's per-layer K/V are cached by position and only ever hold VERIFIED positions: the
target's hidden states of the tokens it kept arrive through `observe_target` after every pass, so a
rejection needs no rollback and nothing drafted is ever cached.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.decode.cache import cache_length
from specdraft.decode.drafters import Drafter, grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import DraftTree, chain
from specdraft.target.capture import rotary_tables


class DFlashDrafter(Drafter):
    name = "dflash"

    def __init__(self, draft, target: nn.Module):
        self.draft = draft
        self.trained_depth = draft.trained_depth
        self.layout = draft.layout
        self.embed_tokens = target.get_input_embeddings()
        self.rotary_emb = rotary_tables(target.model)  # the capture's tables (gpt-oss's at head width)
        weight = draft.fc.weight
        self.dtype, self.device = weight.dtype, weight.device
        # Copies, not views: under ZeRO-3 the parameters' storage is released after each forward.
        self.lm_head = target.get_output_embeddings().weight.detach().to(self.dtype, copy=True)
        with torch.no_grad():
            self.head_weight = draft.head_weight(self.lm_head)  # made once: the head's (V, F) weight
        mask_id = torch.tensor([draft.dims.mask_token_id], device=self.embed_tokens.weight.device)
        with torch.no_grad():
            self.mask_embed = self.embed_tokens(mask_id)[0].to(self.device, self.dtype).clone()
        self.target_layers = tuple(draft.dims.target_layers)  # what speculative_generate hands over
        self.start()

    def start(self) -> None:
        self.keys: List[Optional[torch.Tensor]] = [None] * len(self.draft.layers)  # (1, KV, n, D)
        self.values: List[Optional[torch.Tensor]] = [None] * len(self.draft.layers)
        self.length = 0  # context positions 0..length-1 are cached

    def rollback(self, length: int) -> None:
        if length < self.length:
            self.keys = [k[:, :, :length] for k in self.keys]
            self.values = [v[:, :, :length] for v in self.values]
            self.length = length

    def _rotary(self, positions: torch.Tensor):
        positions = positions.to(self.device)[None]
        cos, sin = self.rotary_emb(self.mask_embed[None, None], positions)  # (1, T, D)
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.no_grad()
    def observe_target(self, hidden: Dict[int, torch.Tensor], start: int) -> None:
        """The target's hidden states {layer id: (T, H)} of verified tokens at positions start..
        start+T-1 -> their context K/V, cached (anything cached from `start` on is replaced)."""
        self.rollback(start)
        if start != self.length:
            raise RuntimeError(f"DFlash context holds positions < {self.length}; got states from {start}")
        context = self.draft.context({k: h.to(self.device)[None] for k, h in hidden.items()})
        positions = torch.arange(start, start + context.shape[1], device=self.device)
        cos, sin = self._rotary(positions)
        for i, (k, v) in enumerate(self.draft.context_keys_values(context, cos, sin)):
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.length = start + context.shape[1]  # from shapes: no read of a device value

    @torch.no_grad()
    def block_hidden(self, anchor_token: int, n: int) -> torch.Tensor:
        """One draft forward of the block anchored at x_n -> its hidden states (1, S, H)."""
        if self.length != n:
            raise RuntimeError(
                f"DFlash drafter holds context of {self.length} positions, the round needs {n}: "
                f"the decoding loop must pass the target's hidden states to observe_target()"
            )
        anchor = self.embed_tokens(torch.tensor([[anchor_token]], device=self.embed_tokens.weight.device))
        cos, sin = self._rotary(torch.arange(n, n + self.layout.block_size, device=self.device))
        return self.draft(
            anchor.to(self.device, self.dtype), self.mask_embed, cos, sin, list(zip(self.keys, self.values)), None
        )  # (1, S, H)

    @torch.no_grad()
    def block_logits(self, anchor_token: int, n: int) -> torch.Tensor:
        """One draft forward of the block anchored at x_n -> (S, V) float logits on the draft's
        device, through the draft's head (block_head: the same step as training's)."""
        return self.draft.block_head(self.block_hidden(anchor_token, n), None, self.head_weight).logits()[0].float()

    def predictions(self, anchor_token: int, n: int) -> torch.Tensor:
        """(P, V): row j = logits of the token at n + 1 + j, given x_n (one forward)."""
        return self.block_logits(anchor_token, n)[self.layout.first_slot :]

    def _round(self, tokens, target_cache) -> torch.Tensor:
        n = cache_length(target_cache)  # tokens[n] = x_n, the last verified token
        return self.predictions(int(tokens[n]), n)

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator) -> DraftTree:
        logits = self._round(tokens, target_cache)[:gamma]
        drafted, qs = [], []
        for row in logits:  # each slot's own distribution: q_i is what token i was drawn from
            token, q = sample(row, temperature, generator)
            drafted.append(token)
            qs.append(q)
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths: Sequence[int]) -> DraftTree:
        logprobs = F.log_softmax(self._round(tokens, target_cache), dim=-1)  # (P, V)
        widths = list(widths)[: logprobs.shape[0]]
        # every node at depth d takes slot d's distribution: the block drafts its positions jointly,
        # not conditioned on the path, so the beam ranks paths by the sum of slot log-probs
        return grow_tree(
            logprobs[0], widths, lambda rows, new_tokens, depth: logprobs[depth].expand(len(new_tokens), -1)
        )
