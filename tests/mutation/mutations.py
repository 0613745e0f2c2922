"""Semantic mutations the test suite must kill, one list per family / module.

A mutation replaces one exact snippet of one file. The snippet must occur exactly once: when a
refactor moves or rewrites it, `make mutation` (and tests/test_mutation_list.py, part of `make
test`) says "snippet not found" instead of silently skipping the mutation — update the entry to the
new code then. `tests` are pytest arguments, run in order with -x: put the fastest killer first.

To add a family: write its list below and add it to MUTATIONS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Mutation:
    name: str  # unique across all lists
    file: str  # relative to the repository root
    original: str  # exact snippet, occurring once in `file`
    replacement: str
    tests: Tuple[str, ...]  # pytest arguments (files, node ids, -k ...)
    why: str = ""  # the wrong behaviour it stands for


SEMANTICS = "tests/test_glide_semantics.py"
GLIDE_UNIT = "tests/test_glide.py"
DECODE = "tests/test_decode.py"
DECODE_FAST = (DECODE, "--deselect",
               f"{DECODE}::test_speculative_sampling_matches_the_target_distribution_end_to_end",
               "--deselect", f"{DECODE}::test_evaluate_reports_tau_acceptance_and_speedup")
GLIDE_TRAIN = (SEMANTICS, GLIDE_UNIT)
GLIDE_DECODE = (f"{SEMANTICS}::test_chain_drafting_logits_equal_training_logits_at_lag_j",
                f"{SEMANTICS}::test_tree_drafting_logits_equal_training_logits_at_lag_depth") + DECODE_FAST
SAMPLING = (f"{DECODE}::test_rejection_rule_reproduces_the_target_distribution",
            f"{DECODE}::test_speculative_sampling_matches_the_target_distribution_end_to_end")

GLIDE_PY = "specdraft/drafts/glide.py"

GLIDE: List[Mutation] = [
    # labels and the counted positions
    Mutation("glide/label-is-current-token", GLIDE_PY,
             "labels = input_ids[:, 1:][counted]", "labels = input_ids[:, :-1][counted]", GLIDE_TRAIN,
             "the draft learns to repeat the current token"),
    Mutation("glide/label-two-ahead", GLIDE_PY,
             "labels = input_ids[:, 1:][counted]", "labels = input_ids.roll(-2, dims=1)[:, :-1][counted]",
             GLIDE_TRAIN, "the draft learns the token after next"),
    Mutation("glide/prediction-shift", GLIDE_PY,
             "predictions = hidden[:, :-1][counted]", "predictions = hidden[:, 1:][counted]", GLIDE_TRAIN,
             "hidden[t+1] trained on token t+1"),
    Mutation("glide/loss-mask-shift", GLIDE_PY,
             "counted = loss_mask[:, 1:].bool()", "counted = loss_mask[:, :-1].bool()", GLIDE_TRAIN,
             "the mask of the current token instead of the predicted one"),
    Mutation("glide/count-from-lag-minus-1", GLIDE_PY,
             "(index[None, :-1] >= lag)", "(index[None, :-1] >= lag - 1)", GLIDE_TRAIN,
             "a position without target context is trained"),
    Mutation("glide/count-from-lag-plus-1", GLIDE_PY,
             "(index[None, :-1] >= lag)", "(index[None, :-1] > lag)", GLIDE_TRAIN,
             "the first position with context is dropped"),
    Mutation("glide/loss-normaliser", GLIDE_PY,
             "loss=total / max(tokens, 1)", "loss=total / max(tokens + 1, 1)", GLIDE_TRAIN),
    # lag in training
    Mutation("glide/train-lag-plus-1", GLIDE_PY,
             "cross_limit=index - lag, index=index)", "cross_limit=index - lag + 1, index=index)",
             GLIDE_TRAIN, "query t sees target K/V one position further than inference gives it"),
    Mutation("glide/train-lag-minus-1", GLIDE_PY,
             "cross_limit=index - lag, index=index)", "cross_limit=index - lag - 1, index=index)",
             GLIDE_TRAIN, "query t sees one target position less than inference gives it"),
    Mutation("glide/cross-limit-exclusive", GLIDE_PY,
             "torch.arange(S, device=x.device)[None, :] <= limit[:, None]",
             "torch.arange(S, device=x.device)[None, :] < limit[:, None]", GLIDE_TRAIN),
    Mutation("glide/no-context-rows-not-zeroed", GLIDE_PY,
             "out = out * has_context[None, None, :, None].to(out.dtype)", "out = out", GLIDE_TRAIN,
             "rows without target context attend to position 0"),
    Mutation("glide/lag-never-max", GLIDE_PY,
             "torch.randint(1, self.dims.max_lag + 1,", "torch.randint(1, self.dims.max_lag,", GLIDE_TRAIN),
    Mutation("glide/lag-zero-drawn", GLIDE_PY,
             "torch.randint(1, self.dims.max_lag + 1,", "torch.randint(0, self.dims.max_lag + 1,", GLIDE_TRAIN,
             "lag 0: query t reads the target's own state at t"),
    # the self-attention window
    Mutation("glide/window-plus-1", GLIDE_PY,
             "(distance < self.d.sliding_window)", "(distance <= self.d.sliding_window)", GLIDE_TRAIN),
    Mutation("glide/window-minus-1", GLIDE_PY,
             "(distance < self.d.sliding_window)", "(distance < self.d.sliding_window - 1)", GLIDE_TRAIN),
    Mutation("glide/self-attention-sees-next", GLIDE_PY,
             "(distance >= 0) &", "(distance >= -1) &", GLIDE_TRAIN, "a query sees the next draft token"),
    Mutation("glide/cache-window-plus-1", GLIDE_PY,
             "(keys[:, :, -self.window:], values[:, :, -self.window:],\n"
             "                                              index[-self.window:])",
             "(keys[:, :, -self.window - 1:], values[:, :, -self.window - 1:],\n"
             "                                              index[-self.window - 1:])", GLIDE_DECODE,
             "the inference cache keeps one entry more than the window (memory bound broken)"),
    Mutation("glide/cache-window-minus-1", GLIDE_PY,
             "(keys[:, :, -self.window:], values[:, :, -self.window:],\n"
             "                                              index[-self.window:])",
             "(keys[:, :, 1 - self.window:], values[:, :, 1 - self.window:],\n"
             "                                              index[1 - self.window:])", GLIDE_DECODE,
             "the inference cache drops the oldest entry the window still sees"),
    Mutation("glide/cache-crop-keeps-rejected", GLIDE_PY,
             "keep = self.index < length", "keep = self.index <= length", GLIDE_DECODE),
    # what the layer reads
    Mutation("glide/target-keys-values-swapped", GLIDE_PY,
             "_attend(q, target_keys.to(q.dtype), target_values.to(q.dtype), visible)",
             "_attend(q, target_values.to(q.dtype), target_keys.to(q.dtype), visible)", GLIDE_TRAIN),
    Mutation("glide/cross-query-without-rope", GLIDE_PY,
             "q = apply_rope(self.q_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2), cos, sin)\n"
             "        S = target_keys.shape[2]",
             "q = self.q_proj(x).view(B, T, -1, self.d.head_dim).transpose(1, 2)\n"
             "        S = target_keys.shape[2]", GLIDE_TRAIN),
    Mutation("glide/final-norm-ignored", GLIDE_PY,
             "return self.norm(x) if self.norm is not None else x", "return x", GLIDE_TRAIN),
    Mutation("glide/anchor-sinks-off-by-one", GLIDE_PY,
             "positions[sinks:] += offset", "positions[sinks + 1:] += offset", GLIDE_TRAIN),
    # the shared loss and the target's features
    Mutation("loss/no-onehot-in-gradient", "specdraft/drafts/loss.py",
             "probs[torch.arange(len(y)), y] -= 1.0", "probs[torch.arange(len(y)), y] -= 0.0", GLIDE_TRAIN),
    Mutation("loss/wrong-label-logit", "specdraft/drafts/loss.py",
             "logits.gather(1, y[:, None]).squeeze(1)", "logits[:, 0]", GLIDE_TRAIN),
    Mutation("target/first-layer-kv", "specdraft/target/model.py",
             "last = cache.layers[-1]", "last = cache.layers[0]", GLIDE_TRAIN,
             "GLIDE reads the target's first layer instead of its last"),
    Mutation("target/keys-values-swapped", "specdraft/target/model.py",
             "last_keys=last.keys, last_values=last.values", "last_keys=last.values, last_values=last.keys",
             GLIDE_TRAIN),
]

DRAFTERS_PY = "specdraft/decode/drafters.py"

# Not listed, because they are equivalent: the drafter's cross limit n - 1 -> n (the target cache
# holds positions 0..n-1, so both read all of it), and the catch-up's `index - 1` -> `index` (only
# x_n's output is used, for which the same holds).
GLIDE_DRAFTER: List[Mutation] = [
    Mutation("glide-drafter/chain-lag-plus-1", DRAFTERS_PY,
             "torch.tensor([n + j]), torch.tensor([n - 1]),", "torch.tensor([n + j]), torch.tensor([n - 2]),",
             GLIDE_DECODE, "drafted token j+1 reads one target position less than in training (lag j+1)"),
    Mutation("glide-drafter/tree-lag-plus-1", DRAFTERS_PY,
             "torch.tensor([n + depth]), torch.tensor([n - 1]),",
             "torch.tensor([n + depth]), torch.tensor([n - 2]),", GLIDE_DECODE),
    Mutation("glide-drafter/catch-up-lag-plus-1", DRAFTERS_PY,
             "index, index - 1, target_cache, self.cache)", "index, index - 2, target_cache, self.cache)",
             GLIDE_DECODE, "the first drafted token is predicted at lag 2"),
    Mutation("glide-drafter/chain-position", DRAFTERS_PY,
             "torch.tensor([[token]]), torch.tensor([n + j]),", "torch.tensor([[token]]), torch.tensor([n + j - 1]),",
             GLIDE_DECODE, "a drafted token fed at its parent's index (RoPE and window)"),
    Mutation("glide-drafter/tree-position", DRAFTERS_PY,
             "self._logits(new_tokens[:, None], torch.tensor([n + depth]),",
             "self._logits(new_tokens[:, None], torch.tensor([n + depth - 1]),", GLIDE_DECODE),
    Mutation("glide-drafter/no-fork", DRAFTERS_PY,
             "fork = copy.copy(self.cache)", "fork = self.cache", GLIDE_DECODE,
             "drafted tokens written into the verified window"),
    Mutation("glide-drafter/tree-rows-not-reordered", DRAFTERS_PY,
             "rows.keys, rows.values = rows.keys[parent_rows], rows.values[parent_rows]",
             "rows.keys, rows.values = rows.keys[parent_rows.flip(0)], rows.values[parent_rows.flip(0)]",
             GLIDE_DECODE, "a tree node continues another node's path"),
    Mutation("glide-drafter/rollback-keeps-length", DRAFTERS_PY,
             "self.length = min(self.length, length)", "self.length = self.length", GLIDE_DECODE),
    Mutation("glide-drafter/window-plus-1", DRAFTERS_PY,
             "SlidingWindowCache(self.draft.dims.sliding_window)",
             "SlidingWindowCache(self.draft.dims.sliding_window + 1)", GLIDE_DECODE),
    Mutation("drafters/tree-parent", DRAFTERS_PY,
             "parents += [frontier[r] for r in rows.tolist()]", "parents += [frontier[0] for r in rows.tolist()]",
             GLIDE_DECODE),
]

DECODING: List[Mutation] = [
    Mutation("sampling/residual-forgets-q", "specdraft/decode/sampling.py",
             "residual = (p - q).clamp_min(0.0)", "residual = p.clamp_min(0.0)", SAMPLING,
             "a rejected token is resampled from p instead of norm(max(0, p - q))"),
    Mutation("sampling/residual-reversed", "specdraft/decode/sampling.py",
             "residual = (p - q).clamp_min(0.0)", "residual = (q - p).clamp_min(0.0)", SAMPLING),
    Mutation("sampling/acceptance-inverted", "specdraft/decode/sampling.py",
             "if u * q[token] < p[token]:", "if u * p[token] < q[token]:", SAMPLING),
    Mutation("sampling/acceptance-deterministic", "specdraft/decode/sampling.py",
             "if u * q[token] < p[token]:", "if q[token] <= p[token]:", SAMPLING,
             "accept iff p >= q, no coin"),
    Mutation("tree/parent-only-mask", "specdraft/decode/tree.py",
             "seen[i] |= seen[parent]", "seen[i, parent] = True", DECODE_FAST,
             "a node sees its parent but not the rest of its path"),
    Mutation("tree/root-sees-nodes", "specdraft/decode/tree.py",
             "in_tree[0, 1:] = False", "in_tree[0, 1:] = True", DECODE_FAST),
    Mutation("tree/node-positions", "specdraft/decode/tree.py",
             "torch.zeros(1, dtype=torch.long), tree.depth])", "torch.zeros(1, dtype=torch.long), tree.depth + 1])",
             DECODE_FAST),
    Mutation("cache/prefix-keeps-one-less", "specdraft/decode/cache.py",
             "layer.keys[..., :len(keep), :], layer.values[..., :len(keep), :]",
             "layer.keys[..., :len(keep) - 1, :], layer.values[..., :len(keep) - 1, :]", DECODE_FAST),
    Mutation("cache/always-prefix", "specdraft/decode/cache.py",
             "prefix = bool((keep == torch.arange(len(keep))).all())", "prefix = True", DECODE_FAST,
             "an accepted tree branch is kept as if it were the first nodes"),
    Mutation("cache/last-layer-is-first", "specdraft/decode/cache.py",
             "layer = cache.layers[-1]", "layer = cache.layers[0]", GLIDE_DECODE,
             "the drafter reads another layer than the one it was trained on"),
    Mutation("speculative/keep-positions-shift", "specdraft/decode/speculative.py",
             "n + 1 + torch.tensor(path, dtype=torch.long)", "n + torch.tensor(path, dtype=torch.long)",
             DECODE_FAST, "the cache keeps the root's neighbour instead of the accepted node"),
]

MUTATIONS: Dict[str, List[Mutation]] = {
    "glide": GLIDE,
    "glide-drafter": GLIDE_DRAFTER,
    "decoding": DECODING,
}


def all_mutations() -> List[Mutation]:
    return [m for group in MUTATIONS.values() for m in group]
