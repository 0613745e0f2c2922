"""P-EAGLE at inference: EAGLE-3's drafter (drafts/eagle3/decode.py: the draft's cache of depth-0
entries, fed with the target's states of verified tokens) proposing every token of a round in
ONE draft forward.

A round from x_n (target cache holding 0..n-1): the queries are the indices not fed yet up to
n-1 at depth 0 (index t embeds x_{t+1} with fc(target states at t), position t+1), then depths
1..m at anchor n-1 (the mask token's embedding, fc(mask_hidden), position n+d), which see every
depth-0 entry and the earlier depths of their own rollout (training's visibility, cod.py). Depth
d's logits are the distribution of x_{n+1+d}. Only the depth-0 entries stay in the cache.

A chain samples depth d's token from depth d's distribution (lossless: each drafted token's q is
the distribution it was drawn from). A tree keeps the widths[d] best children of depth d's
frontier by cumulative log-probability; the draft's distributions do not depend on the path (the
deeper slots read the mask token, not the drafted ones), so every node at depth d has depth d's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.decode.cache import append_kv, cache_length
from specdraft.decode.drafters import grow_tree
from specdraft.decode.sampling import sample
from specdraft.decode.tree import chain
from specdraft.drafts.eagle3.decode import Eagle3Drafter


class PEagleDrafter(Eagle3Drafter):
    name = "peagle"

    @torch.no_grad()
    def _parallel(self, tokens: torch.Tensor, n: int, depths: int) -> torch.Tensor:
        """One forward -> (depths, N) draft logits of x_{n+1} .. x_{n+depths}."""
        cache = self.cache
        cache.crop(n - 1)  # index n-1 is fed again if it was already (a second proposal this round)
        start, m = cache.fed, depths - 1
        count = n - start
        dev = self.device
        mask_embedding = self.draft.mask_embedding.to(dev, self.dtype)
        fed = tokens[start + 1 : n + 1].to(dev)
        real = self._embed(fed[None])[0]
        real = torch.where((fed == self.draft.dims.mask_token_id)[:, None], mask_embedding[None], real)  # one row
        embeds = torch.cat([real, mask_embedding.expand(m, -1)])
        mask_hidden = self.draft.fuse(self.draft.mask_hidden.to(dev, self.dtype)[0])  # (1, H)
        hidden = torch.cat([cache.states[start:n], mask_hidden.expand(m, -1)])
        positions = torch.cat([torch.arange(start + 1, n + 1, device=dev), n + torch.arange(1, m + 1, device=dev)])
        visible = torch.zeros(count + m, start + count + m, dtype=torch.bool, device=dev)
        visible[:, :start] = True
        visible[:count, start : start + count] = torch.ones(count, count, dtype=torch.bool, device=dev).tril()
        visible[count:, start : start + count] = True
        visible[count:, start + count :] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        _, head_in, k, v = self.draft.step(embeds[None], hidden[None], positions, cache.keys, cache.values, visible)
        keep = slice(0, count)  # the cache keeps the depth-0 entries only
        cache.fed_up_to(n, append_kv(cache.keys, k[:, :, keep]), append_kv(cache.values, v[:, :, keep]))
        return self.draft.logits(head_in[0, count - 1 :])

    def propose_chain(self, tokens, target_cache, gamma, temperature, generator):
        logits = self._parallel(tokens, cache_length(target_cache), gamma)
        drafted, qs = [], []
        for d in range(gamma):
            token, q = sample(self._target_logits(logits[d]), temperature, generator)
            drafted.append(token)
            qs.append(q)
        return chain(drafted, torch.stack(qs))

    def propose_tree(self, tokens, target_cache, widths):
        logprobs = F.log_softmax(
            self._target_logits(self._parallel(tokens, cache_length(target_cache), len(widths))), dim=-1
        )

        def expand(parent_rows, new_tokens, depth):
            return logprobs[depth].expand(len(new_tokens), -1)

        return grow_tree(logprobs[0], widths, expand)
