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
DECODE_FAST = (
    DECODE,
    "--deselect",
    f"{DECODE}::test_speculative_sampling_matches_the_target_distribution_end_to_end",
    "--deselect",
    f"{DECODE}::test_evaluate_reports_tau_acceptance_and_speedup",
)
GLIDE_TRAIN = (SEMANTICS, GLIDE_UNIT)
GLIDE_DECODE = (
    f"{SEMANTICS}::test_chain_drafting_logits_equal_training_logits_at_lag_j",
    f"{SEMANTICS}::test_tree_drafting_logits_equal_training_logits_at_lag_depth",
) + DECODE_FAST
SAMPLING = (
    f"{DECODE}::test_rejection_rule_reproduces_the_target_distribution",
    f"{DECODE}::test_speculative_sampling_matches_the_target_distribution_end_to_end",
)

GLIDE_PY = "specdraft/drafts/glide/model.py"
GLIDE_TRAIN_PY = "specdraft/drafts/glide/train.py"
LONGSPEC_PY = "specdraft/drafts/glide/export.py"
GLIDE_DECODE_PY = "specdraft/drafts/glide/decode.py"
LAYERS_PY = "specdraft/drafts/layers.py"
CAPTURE_PY = "specdraft/target/capture.py"

GLIDE: List[Mutation] = [
    # labels and the counted positions
    Mutation(
        "glide/label-is-current-token",
        GLIDE_TRAIN_PY,
        "labels = shard.local(F.pad(input_ids[:, 1:], (0, 1))).flatten()[rows]",
        "labels = shard.local(input_ids).flatten()[rows]",
        GLIDE_TRAIN,
        "the draft learns to repeat the current token",
    ),
    Mutation(
        "glide/label-two-ahead",
        GLIDE_TRAIN_PY,
        "labels = shard.local(F.pad(input_ids[:, 1:], (0, 1))).flatten()[rows]",
        "labels = shard.local(F.pad(input_ids[:, 2:], (0, 2))).flatten()[rows]",
        GLIDE_TRAIN,
        "the draft learns the token after next",
    ),
    Mutation(
        "glide/prediction-shift",
        GLIDE_TRAIN_PY,
        "predictions = hidden.flatten(0, 1)[rows]",
        "predictions = hidden.flatten(0, 1)[rows + 1]",
        GLIDE_TRAIN,
        "hidden[t+1] trained on token t+1",
    ),
    Mutation(
        "glide/loss-mask-shift",
        GLIDE_TRAIN_PY,
        "counted[:, :-1] = loss_mask[:, 1:].bool() & (index[None, :-1] >= lag)",
        "counted[:, :-1] = loss_mask[:, :-1].bool() & (index[None, :-1] >= lag)",
        GLIDE_TRAIN,
        "the mask of the current token instead of the predicted one",
    ),
    Mutation(
        "glide/count-from-lag-minus-1",
        GLIDE_TRAIN_PY,
        "(index[None, :-1] >= lag)",
        "(index[None, :-1] >= lag - 1)",
        GLIDE_TRAIN,
        "a position without target context is trained",
    ),
    Mutation(
        "glide/count-from-lag-plus-1",
        GLIDE_TRAIN_PY,
        "(index[None, :-1] >= lag)",
        "(index[None, :-1] > lag)",
        GLIDE_TRAIN,
        "the first position with context is dropped",
    ),
    Mutation(
        "glide/loss-normaliser",
        "specdraft/parallel/sequence.py",
        "return summed / tokens.clamp_min(1), tokens",
        "return summed / (tokens + 1).clamp_min(1), tokens",
        GLIDE_TRAIN,
        "every family's per-token mean (SequenceShard.token_mean at size 1)",
    ),
    # lag in training
    # The training path has no cross_limit any more: GlideCrossAttention passes `lag` to
    # layers.lagged_cross_attention (queries [lag:] over keys [:T-lag]); the lag it is given is
    # shifted by one while the counted positions keep the drawn lag.
    Mutation(
        "glide/train-lag-plus-1",
        GLIDE_PY,
        "keys, values, lag, documents)",
        "keys, values, lag - 1, documents)",
        GLIDE_TRAIN,
        "query t sees target K/V one position further than inference gives it (the "
        "training cross-attention is called with lag - 1; was cross_limit=index - lag + 1)",
    ),
    Mutation(
        "glide/train-lag-minus-1",
        GLIDE_PY,
        "keys, values, lag, documents)",
        "keys, values, lag + 1, documents)",
        GLIDE_TRAIN,
        "query t sees one target position less than inference gives it (the training "
        "cross-attention is called with lag + 1; was cross_limit=index - lag - 1)",
    ),
    Mutation(
        "glide/lagged-keys-not-shifted",
        LAYERS_PY,
        "q, k, v = q[:, :, lag:], k[:, :, : T - lag], v[:, :, : T - lag]",
        "q, k, v = q[:, :, lag:], k[:, :,lag:], v[:, :, lag:]",
        GLIDE_TRAIN,
        "lagged_cross_attention: query t reads target keys up to t instead of t - lag",
    ),
    Mutation(
        "glide/cross-limit-exclusive",
        GLIDE_PY,
        "[None, :] <= limit[:, None]",
        "[None, :] < limit[:, None]",
        GLIDE_TRAIN,
    ),
    Mutation(
        "glide/no-context-rows-not-zeroed",
        GLIDE_PY,
        "out = out * has_context[None, None, :, None].to(out.dtype)",
        "out = out",
        GLIDE_TRAIN,
        "rows without target context attend to position 0",
    ),
    Mutation(
        "glide/lag-never-max",
        GLIDE_TRAIN_PY,
        "torch.randint(1, self.dims.max_lag + 1,",
        "torch.randint(1, self.dims.max_lag,",
        GLIDE_TRAIN,
    ),
    Mutation(
        "glide/lag-zero-drawn",
        GLIDE_TRAIN_PY,
        "torch.randint(1, self.dims.max_lag + 1,",
        "torch.randint(0, self.dims.max_lag + 1,",
        GLIDE_TRAIN,
        "lag 0: query t reads the target's own state at t",
    ),
    # the self-attention window
    Mutation(
        "glide/window-plus-1",
        GLIDE_PY,
        "(distance < self.d.sliding_window)",
        "(distance <= self.d.sliding_window)",
        GLIDE_TRAIN,
    ),
    Mutation(
        "glide/window-minus-1",
        GLIDE_PY,
        "(distance < self.d.sliding_window)",
        "(distance < self.d.sliding_window - 1)",
        GLIDE_TRAIN,
    ),
    Mutation(
        "glide/train-window-plus-1",
        LAYERS_PY,
        "visible = ((distance >= 0) & (distance < window))[None, None]",
        "visible = ((distance >= 0) & (distance <= window))[None, None]",
        GLIDE_TRAIN,
        "sliding_window_attention (one band mask, T <= 2 window): a query sees one key too many",
    ),
    Mutation(
        "glide/train-window-minus-1",
        LAYERS_PY,
        "visible = ((distance >= 0) & (distance < window))[None, None]",
        "visible = ((distance >= 0) & (distance < window - 1))[None, None]",
        GLIDE_TRAIN,
        "sliding_window_attention (one band mask, T <= 2 window): a query misses its oldest key",
    ),
    Mutation(
        "glide/train-blocked-window-plus-1",
        LAYERS_PY,
        "band = (distance >= 0) & (distance < window)",
        "band = (distance >= 0) & (distance <= window)",
        GLIDE_TRAIN,
        "sliding_window_attention (blocks, T > 2 window): a query sees one key too many",
    ),
    Mutation(
        "glide/self-attention-sees-next",
        GLIDE_PY,
        "(distance >= 0) &",
        "(distance >= -1) &",
        GLIDE_TRAIN,
        "a query sees the next draft token",
    ),
    Mutation(
        "glide/cache-window-plus-1",
        GLIDE_DECODE_PY,
        'keys[:, :, -self.window :],\n            values[:, :, -self.window :],\n            index[-self.window :],',
        'keys[:, :, -self.window - 1 :],\n            values[:, :, -self.window - 1 :],\n            index[-self.window - 1 :],',
        GLIDE_DECODE,
        "the inference cache keeps one entry more than the window (memory bound broken)",
    ),
    Mutation(
        "glide/cache-window-minus-1",
        GLIDE_DECODE_PY,
        'keys[:, :, -self.window :],\n            values[:, :, -self.window :],\n            index[-self.window :],',
        'keys[:, :, 1 - self.window :],\n            values[:, :, 1 - self.window :],\n            index[1 - self.window :],',
        GLIDE_DECODE,
        "the inference cache drops the oldest entry the window still sees",
    ),
    Mutation(
        "glide/cache-crop-keeps-rejected",
        GLIDE_DECODE_PY,
        "keep = self.index < length",
        "keep = self.index <= length",
        GLIDE_DECODE,
    ),
    # what the layer reads
    Mutation(
        "glide/target-keys-values-swapped",
        GLIDE_PY,
        "keys, values = target_keys.to(q.dtype), target_values.to(q.dtype)",
        "keys, values = target_values.to(q.dtype), target_keys.to(q.dtype)",
        GLIDE_TRAIN,
        "training cross-attention reads target values as keys",
    ),
    Mutation(
        "glide/decode-target-keys-values-swapped",
        GLIDE_PY,
        "attend(q, keys, values, visible)",
        "attend(q, values, keys, visible)",
        GLIDE_DECODE,
        "inference cross-attention (cross_limit path) reads target values as keys",
    ),
    Mutation(
        "glide/cross-query-without-rope",
        GLIDE_PY,
        "q = rope(self.heads(self.q_proj(x)), cos, sin)\n        keys, values",
        "q = self.heads(self.q_proj(x))\n        keys, values",
        GLIDE_TRAIN,
    ),
    Mutation(
        "glide/final-norm-ignored",
        GLIDE_PY,
        'lag=lag, documents=documents, shard=shard\n        )\n        x = x + self.mlp(self.post_attention_layernorm(x))\n        return self.norm(x) if self.norm is not None else x',
        'lag=lag, documents=documents, shard=shard\n        )\n        x = x + self.mlp(self.post_attention_layernorm(x))\n        return x',
        GLIDE_TRAIN,
        "forward_sequence (training) skips the final norm",
    ),
    Mutation(
        "glide/anchor-sinks-off-by-one",
        GLIDE_TRAIN_PY,
        "positions[sinks:] += offset",
        "positions[sinks + 1:] += offset",
        GLIDE_TRAIN,
    ),
    # the shared loss and the target's features
    Mutation(
        "loss/no-onehot-in-gradient",
        "specdraft/drafts/loss.py",
        "probs[rows, y] -= 1.0",
        "probs[rows, y] -= 0.0",
        GLIDE_TRAIN,
    ),
    Mutation(
        "loss/wrong-label-logit",
        "specdraft/drafts/loss.py",
        "label_logit = logits[rows, y]",
        "label_logit = logits[:, 0]",
        GLIDE_TRAIN,
    ),
    Mutation(
        "target/first-layer-kv",
        CAPTURE_PY,
        "_LastLayerKV(num_layers - 1, stop=",
        "_LastLayerKV(0, stop=",
        GLIDE_TRAIN,
        "GLIDE reads the target's first layer instead of its last",
    ),
    Mutation(
        "target/keys-values-swapped",
        CAPTURE_PY,
        "features.last_keys, features.last_values = kv.keys, kv.values",
        "features.last_keys, features.last_values = kv.values, kv.keys",
        GLIDE_TRAIN,
    ),
]

DRAFTERS_PY = "specdraft/decode/drafters.py"  # the shared tree growth; GLIDE's drafter is in GLIDE_DECODE_PY

# Not listed, because they are equivalent: the drafter's cross limit n - 1 -> n (the target cache
# holds positions 0..n-1, so both read all of it), and the catch-up's `index - 1` -> `index` (only
# x_n's output is used, for which the same holds).
GLIDE_DRAFTER: List[Mutation] = [
    Mutation(
        "glide-drafter/chain-lag-plus-1",
        GLIDE_DECODE_PY,
        "torch.tensor([n + j, n - 1], device",
        "torch.tensor([n + j, n - 2], device",
        GLIDE_DECODE,
        "drafted token j+1 reads one target position less than in training (lag j+1)",
    ),
    Mutation(
        "glide-drafter/tree-lag-plus-1",
        GLIDE_DECODE_PY,
        "torch.tensor([n + depth, n - 1], device",
        "torch.tensor([n + depth, n - 2], device",
        GLIDE_DECODE,
    ),
    Mutation(
        "glide-drafter/catch-up-lag-plus-1",
        GLIDE_DECODE_PY,
        "index, index - 1, target_cache, self.cache)",
        "index, index - 2, target_cache, self.cache)",
        GLIDE_DECODE,
        "the first drafted token is predicted at lag 2",
    ),
    Mutation(
        "glide-drafter/chain-position",
        GLIDE_DECODE_PY,
        "torch.tensor([n + j, n - 1], device",
        "torch.tensor([n + j - 1, n - 1], device",
        GLIDE_DECODE,
        "a drafted token fed at its parent's index (RoPE and window)",
    ),
    Mutation(
        "glide-drafter/tree-position",
        GLIDE_DECODE_PY,
        "torch.tensor([n + depth, n - 1], device",
        "torch.tensor([n + depth - 1, n - 1], device",
        GLIDE_DECODE,
    ),
    Mutation(
        "glide-drafter/no-fork",
        GLIDE_DECODE_PY,
        "fork = copy.copy(self.cache)",
        "fork = self.cache",
        GLIDE_DECODE,
        "drafted tokens written into the verified window",
    ),
    Mutation(
        "glide-drafter/tree-rows-not-reordered",
        GLIDE_DECODE_PY,
        "rows.keys, rows.values = rows.keys[parent_rows], rows.values[parent_rows]",
        "rows.keys, rows.values = rows.keys[parent_rows.flip(0)], rows.values[parent_rows.flip(0)]",
        GLIDE_DECODE,
        "a tree node continues another node's path",
    ),
    Mutation(
        "glide-drafter/rollback-keeps-length",
        GLIDE_DECODE_PY,
        "self.length = min(self.length, length)",
        "self.length = self.length",
        GLIDE_DECODE,
    ),
    Mutation(
        "glide-drafter/window-plus-1",
        GLIDE_DECODE_PY,
        "SlidingWindowCache(self.draft.dims.sliding_window)",
        "SlidingWindowCache(self.draft.dims.sliding_window + 1)",
        GLIDE_DECODE,
    ),
    Mutation(
        "drafters/tree-parent",
        DRAFTERS_PY,
        "parents += [frontier[r] for r in rows.tolist()]",
        "parents += [frontier[0] for r in rows.tolist()]",
        GLIDE_DECODE,
    ),
]

DECODING: List[Mutation] = [
    Mutation(
        "sampling/residual-forgets-q",
        "specdraft/decode/sampling.py",
        "residual = (p - q).clamp_min(0.0)",
        "residual = p.clamp_min(0.0)",
        SAMPLING,
        "a rejected token is resampled from p instead of norm(max(0, p - q))",
    ),
    Mutation(
        "sampling/residual-reversed",
        "specdraft/decode/sampling.py",
        "residual = (p - q).clamp_min(0.0)",
        "residual = (q - p).clamp_min(0.0)",
        SAMPLING,
    ),
    Mutation(
        "sampling/acceptance-inverted",
        "specdraft/decode/sampling.py",
        "if u * q[token] < p[token]:",
        "if u * p[token] < q[token]:",
        SAMPLING,
    ),
    Mutation(
        "sampling/acceptance-deterministic",
        "specdraft/decode/sampling.py",
        "if u * q[token] < p[token]:",
        "if q[token] <= p[token]:",
        SAMPLING,
        "accept iff p >= q, no coin",
    ),
    Mutation(
        "tree/parent-only-mask",
        "specdraft/decode/tree.py",
        "seen[i] |= seen[parent]",
        "seen[i, parent] = True",
        DECODE_FAST,
        "a node sees its parent but not the rest of its path",
    ),
    Mutation(
        "tree/root-sees-nodes",
        "specdraft/decode/tree.py",
        "in_tree[0, 1:] = False",
        "in_tree[0, 1:] = True",
        DECODE_FAST,
    ),
    Mutation(
        "tree/node-positions",
        "specdraft/decode/tree.py",
        "torch.zeros(1, dtype=torch.long), tree.depth])",
        "torch.zeros(1, dtype=torch.long), tree.depth + 1])",
        DECODE_FAST,
    ),
    Mutation(
        "cache/prefix-keeps-one-less",
        "specdraft/decode/cache.py",
        "layer.keys[..., : len(keep), :], layer.values[..., : len(keep), :]",
        "layer.keys[..., : len(keep) - 1, :], layer.values[..., :len(keep) - 1, :]",
        DECODE_FAST,
    ),
    Mutation(
        "cache/always-prefix",
        "specdraft/decode/cache.py",
        "prefix = bool((keep == torch.arange(len(keep))).all())",
        "prefix = True",
        DECODE_FAST,
        "an accepted tree branch is kept as if it were the first nodes",
    ),
    Mutation(
        "cache/last-layer-is-first",
        "specdraft/decode/cache.py",
        "layer = cache.layers[-1]",
        "layer = cache.layers[0]",
        GLIDE_DECODE,
        "the drafter reads another layer than the one it was trained on",
    ),
    Mutation(
        "speculative/keep-positions-shift",
        "specdraft/decode/speculative.py",
        "[0] + [1 + node for node in path]",
        "[0] + [node for node in path]",
        DECODE_FAST,
        "the cache keeps the root's neighbour instead of the accepted node",
    ),
]

# EAGLE-3 (from notes/eagle3-mutations.py)
E3 = "specdraft/drafts/eagle3/model.py"
EAGLE3_TRAIN_PY = "specdraft/drafts/eagle3/train.py"
E3_LAYER = "specdraft/drafts/eagle3/layer.py"
E3_DECODE = "specdraft/drafts/eagle3/decode.py"
E3_VOCAB = "specdraft/drafts/eagle3/vocab.py"
E3_TRAIN = ("tests/test_eagle3.py",)
ATTENTION_PY = "specdraft/target/attention.py"
DOCUMENT_TESTS = ("tests/test_document_attention.py",)  # GLIDE's and DFlash's paths over packed documents
TTT_ATTENTION_PY = "specdraft/drafts/eagle3/ttt_attention.py"
TTT_TESTS = ("tests/test_ttt_attention.py", "tests/test_eagle3.py")
E3_SPEC = ("tests/test_eagle3_export.py",)

EAGLE3: List[Mutation] = [
    Mutation(
        "eagle3/d2t-off-by-one",
        E3_VOCAB,
        "return torch.arange(d2t.numel(), device=d2t.device) + d2t",
        "return torch.arange(d2t.numel(), device=d2t.device) + d2t + 1",
        E3_TRAIN,
        "draft id i mapped to the next target id",
    ),
    Mutation(
        "eagle3/d2t-not-relative",
        E3_VOCAB,
        "d2t = torch.from_numpy(used - np.arange(draft_vocab_size))",
        "d2t = torch.from_numpy(used)",
        E3_TRAIN,
        "d2t stores target ids instead of offsets",
    ),
    Mutation(
        "eagle3/ttt-token-shift",
        E3,
        "embeds = shard.shift_left(input_embeds, 1 + k)  # x_{t+1+k}",
        "embeds = shard.shift_left(input_embeds, 1)",
        E3_TRAIN,
        "every TTT step embeds x_{t+1} instead of x_{t+1+k}",
    ),
    Mutation(
        "eagle3/ttt-position-shift",
        E3,
        "index + 1 + k, keys, values,",
        "index + 1, keys, values,",
        E3_TRAIN + E3_SPEC,
        "RoPE positions not advanced per TTT step",
    ),
    Mutation(
        "eagle3/ttt-label-shift",
        EAGLE3_TRAIN_PY,
        "counted[:, : max(T - 2 - k, 0)] = taught[:, 2 + k :]",
        "counted[:, : max(T - 2 - k, 0)] = taught[:,1 + k:-1]",
        E3_TRAIN,
        "the mask of the input token instead of the predicted one",
    ),
    Mutation(
        "eagle3/answer-label-shift",
        EAGLE3_TRAIN_PY,
        "= host.loss_mask[:, 2 + k :].bool()",
        "= host.loss_mask[:,1 + k:-1].bool()",
        E3_TRAIN,
        "CE's answer rows read from the input token's mask",
    ),
    Mutation(
        "eagle3/ce-counts-labels-outside-the-draft-vocab",
        "specdraft/drafts/objectives.py",
        "has_label = labels >= 0",
        "has_label = labels >= -1",
        E3_TRAIN,
        "a target token outside the draft vocab trained as draft id 0",
    ),
    Mutation(
        "eagle3/ttt-teacher-shift",
        EAGLE3_TRAIN_PY,
        "teacher_at = rows + rows // local * extend + 1 + k",
        "teacher_at = rows + rows // local * extend + k",
        E3_TRAIN,
        "the teacher one position early",
    ),
    Mutation(
        "eagle3/packed-conversations-see-each-other",
        ATTENTION_PY,
        "return cls(documents, segments=document_segments(documents))",
        "return cls(documents, segments=[[(0, documents.shape[1])]] * documents.shape[0])",
        (
            "tests/test_eagle3.py::test_a_conversation_packed_after_another_computes_what_it_computes_alone",
            "tests/test_ttt_attention.py",
        ),
        "under document_mask a packed conversation attends to the one before",
    ),
    Mutation(
        "eagle3/decay-ignored",
        EAGLE3_TRAIN_PY,
        "weighted = step_loss * self.dims.ttt_decay**k",
        "weighted = step_loss",
        E3_TRAIN,
    ),
    Mutation(
        "eagle3/decay-off-by-one",
        EAGLE3_TRAIN_PY,
        "weighted = step_loss * self.dims.ttt_decay**k",
        "weighted = step_loss * self.dims.ttt_decay**(k + 1)",
        E3_TRAIN,
    ),
    Mutation(
        "eagle3/visibility-no-diagonal",
        TTT_ATTENTION_PY,
        "q_ext = torch.cat([q, log_zd / scale], dim=-1)",
        "q_ext = torch.cat([q, log_zd * 0 - 1e4], dim=-1)",
        TTT_TESTS,
        "step k sees only the step-0 keys, not its own and earlier steps' diagonal",
    ),
    Mutation(
        "eagle3/visibility-causal-later-steps",
        TTT_ATTENTION_PY,
        "merged = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, is_causal=True, scale=scale, enable_gqa=gqa)",
        "merged = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, scale=scale, enable_gqa=gqa)",
        TTT_TESTS,
        "a later step's query sees the step-0 keys after its position",
    ),
    Mutation(
        "eagle3/ttt-packed-conversations-ignored",
        ATTENTION_PY,
        "starts = documents[:, 1:] != documents[:, :-1]",
        "starts = documents[:, 1:] != documents[:, 1:]",
        TTT_TESTS,
        "a TTT step of a packed row attends to the conversation before it (CPU slices)",
    ),
    Mutation(
        "eagle3/ttt-dense-path-ignores-conversations",
        ATTENTION_PY,
        "return (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]",
        "return (causal & (self.ids[:, :, None] >= 0))[:, None]",
        TTT_TESTS,
        "on a device without slices or flex (meta), packed conversations see each other",
    ),
    Mutation(
        "eagle3/ttt-flex-block-mask-ignores-conversations",
        ATTENTION_PY,
        "return (q >= kv) & (documents[b, q] == key_documents[b, kv])",
        "return q >= kv",
        TTT_TESTS,
        "on CUDA, packed conversations see each other",
    ),
    Mutation(
        "eagle3/ttt-flex-merge-drops-the-diagonal",
        TTT_ATTENTION_PY,
        "torch.sigmoid(log_z0.unsqueeze(-1) - log_zd)",
        "torch.sigmoid(log_z0.unsqueeze(-1) - log_zd * 0 + 1e4)",
        TTT_TESTS,
        "on CUDA, step k sees only the step-0 keys",
    ),
    Mutation(
        "eagle3/hidden-not-fed-back",
        E3,
        "hidden, head_in, new_k, new_v = self.step(embeds, hidden,",
        "_, head_in, new_k, new_v = self.step(embeds, hidden,",
        E3_TRAIN,
        "every step reads the target's states instead of the draft's own output",
    ),
    Mutation(
        "eagle3/layer-ids-output-convention",
        "specdraft/target/capture.py",
        "module = base_model.norm if layer_id == num_layers else base_model.layers[layer_id]",
        "module = base_model.norm if layer_id + 1 == num_layers else base_model.layers[layer_id + 1]",
        ("tests/test_capture.py", "tests/test_eagle3.py"),
        "SpecForge's output-of-layer ids instead of vLLM's",
    ),
    Mutation(
        "eagle3/default-layers",
        E3_LAYER,
        "layers = [2, num_layers // 2, num_layers - 3]",
        "layers = [1, num_layers // 2, num_layers - 2]",
        E3_TRAIN,
    ),
    Mutation(
        "eagle3/residual-flag-inverted",
        E3_LAYER,
        "residual = normed if self.norm_before_residual else hidden",
        "residual = hidden if self.norm_before_residual else normed",
        E3_TRAIN + E3_SPEC,
    ),
    Mutation(
        "eagle3/drafter-position",
        E3_DECODE,
        "positions = torch.arange(start + 1, n + 1, device=self.device)",
        "positions = torch.arange(start, n, device=self.device)",
        E3_TRAIN,
        "inference RoPE positions one off the training ones",
    ),
]

# DFlash (from notes/dflash_mutations.py)
DFLASH_PY = "specdraft/drafts/dflash/model.py"
DFLASH_TRAIN_PY = "specdraft/drafts/dflash/train.py"
DFLASH_BLOCKS_PY = "specdraft/drafts/dflash/blocks.py"
DFLASH_DECODE_PY = "specdraft/drafts/dflash/decode.py"
DFLASH_SPEC_PY = "specdraft/drafts/dflash/export.py"
DFLASH_TESTS = ("tests/test_dflash.py",)
DFLASH_REF = ("tests/test_dflash.py::test_vectorised_forward_loss_and_grads_equal_the_reference",)
DFLASH_EXPORT = ("tests/test_dflash_export.py",)  # needs the speculators venv for the logits check

DFLASH: List[Mutation] = [
    Mutation(
        'dflash/context-includes-anchor',
        DFLASH_BLOCKS_PY,
        'before_anchor = kv < anchors[b, block]',
        'before_anchor = kv <= anchors[b, block]',
        DFLASH_TESTS,
        "the anchor's own target state leaks in",
    ),
    Mutation(
        'dflash/context-misses-last',
        DFLASH_BLOCKS_PY,
        'before_anchor = kv < anchors[b, block]',
        'before_anchor = kv < anchors[b, block] - 1',
        DFLASH_TESTS,
        'the last verified position is dropped',
    ),
    Mutation(
        'dflash/sees-other-blocks',
        DFLASH_BLOCKS_PY,
        'same_block = (kv - context_len) // block_size == block',
        'same_block = kv >= context_len',
        DFLASH_TESTS,
        'a block attends to other blocks',
    ),
    Mutation(
        'dflash/causal-in-block',
        DFLASH_BLOCKS_PY,
        'same_block = (kv - context_len) // block_size == block',
        'same_block = ((kv - context_len) // block_size == block) & (kv - context_len <= q)',
        DFLASH_TESTS,
        'causal instead of bidirectional inside the block',
    ),
    Mutation(
        'dflash/label-offset-plus-1',
        DFLASH_BLOCKS_PY,
        'label_pos = anchors[..., None] + 1 + torch.arange(',
        'label_pos = anchors[..., None] + 2 + torch.arange(',
        DFLASH_TESTS,
        'block predicts one token too far',
    ),
    Mutation(
        'dflash/label-offset-0',
        DFLASH_BLOCKS_PY,
        'label_pos = anchors[..., None] + 1 + torch.arange(',
        'label_pos = anchors[..., None] + 0 + torch.arange(',
        DFLASH_TESTS,
        'the anchor is its own label',
    ),
    Mutation(
        'dflash/loss-ignores-first-slot',
        DFLASH_TRAIN_PY,
        'head.features[:, :, first + j].flatten(0, 1)[rows]',
        'head.features[:, :, j].flatten(0, 1)[rows]',
        DFLASH_TESTS,
        'the anchor slot trained on anchor+1 when it should not',
    ),
    Mutation(
        'dflash/layout-swapped',
        "specdraft/drafts/dflash/options.py",
        'return 0 if self.sample_from_anchor else 1',
        'return 1 if self.sample_from_anchor else 0',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/anchor-needs-own-mask',
        DFLASH_BLOCKS_PY,
        'candidate[:, 1 : last + 1] = loss_mask[:, 2 : last + 2].bool()',
        'candidate[:, 1 : last + 1] = loss_mask[:,1:last + 1].bool()',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/anchor-0-allowed',
        DFLASH_BLOCKS_PY,
        'candidate[:, 1 : last + 1] = loss_mask[:, 2 : last + 2].bool()',
        'candidate[:,0:last + 1] = loss_mask[:, 1: last + 2].bool()',
        DFLASH_TESTS,
        'a block without context',
    ),
    Mutation('dflash/padding-anchors-valid', DFLASH_BLOCKS_PY, 'valid = top >= 0', 'valid = top >= -1', DFLASH_TESTS),
    Mutation(
        'dflash/padding-anchors-counted',
        DFLASH_BLOCKS_PY,
        '.view_as(label_pos).bool() & valid[..., None]',
        '.view_as(label_pos).bool()',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/block-positions-shift',
        DFLASH_BLOCKS_PY,
        'return anchor_positions[..., None] + torch.arange(self.block_size',
        'return anchor_positions[..., None] + 1 + torch.arange(self.block_size',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/crossing-block-takes-next-positions',
        DFLASH_BLOCKS_PY,
        'return anchor_positions[..., None] + torch.arange(self.block_size, device=self.anchors.device)',
        'return position_ids.gather(1, (self.anchors[..., None] + torch.arange(self.block_size, '
        'device=self.anchors.device)).flatten(1)).view(*self.anchors.shape, -1)',
        ("tests/test_dflash.py::test_a_block_crossing_into_the_next_conversation_keeps_its_own_positions",),
        "slot s at the position of token anchor + s, the next packed conversation's (issue 19, defect 4)",
    ),
    Mutation(
        'dflash/weights-from-1',
        DFLASH_BLOCKS_PY,
        'return [math.exp(-j / gamma) for j in range(layout.predictions)]',
        'return [math.exp(-(j + 1) / gamma) for j in range(layout.predictions)]',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/teacher-one-ahead',
        DFLASH_TRAIN_PY,
        'final_hidden.flatten(0, 1)[anchor_rows[rows] + j]',
        'final_hidden.flatten(0, 1)[anchor_rows[rows] + j + 1]',
        DFLASH_TESTS,
        "prediction j taught by the target's distribution of the token after its label",
    ),
    Mutation(
        'dflash/weights-ignored',
        DFLASH_TRAIN_PY,
        'total = total + weights[j] * (out.loss + extra)',
        'total = total + (out.loss + extra)',
        DFLASH_REF,
    ),
    Mutation(
        'dflash/loss-normaliser',
        "specdraft/parallel/sequence.py",
        'return summed * (self.size / max(group_tokens, 1)), weight',
        'return summed * (self.size / max(group_tokens + 1, 1)), weight',
        ("tests/test_sequence_parallel.py::test_every_family_at_sp2_equals_one_rank_loss_and_gradients",),
        "the per-token mean under sequence parallelism (every family's)",
    ),
    Mutation(
        'dflash/no-hidden-norm',
        DFLASH_PY,
        'return self.hidden_norm(self.fc(stacked.to(self.fc.weight.dtype)))',
        'return self.fc(stacked.to(self.fc.weight.dtype))',
        DFLASH_REF + DFLASH_EXPORT,
    ),
    Mutation(
        'dflash/mask-delta-ignored',
        DFLASH_PY,
        'mask = (mask_embed.to(self.mask_delta.dtype) + self.mask_delta)',
        'mask = (mask_embed.to(self.mask_delta.dtype) + 0 * self.mask_delta)',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/no-k-norm',
        'specdraft/drafts/dflash/layer.py',
        'k = apply_rope(self.k_norm(self.heads(self.k_proj(x))), cos, sin)',
        'k = apply_rope(self.heads(self.k_proj(x)), cos, sin)',
        DFLASH_REF + DFLASH_EXPORT,
    ),
    Mutation(
        'dflash/no-final-norm',
        DFLASH_PY,
        '        return self.norm(x)\n',
        '        return x\n',
        DFLASH_REF + DFLASH_EXPORT,
    ),
    Mutation(
        'dflash/drafter-positions-shift',
        DFLASH_DECODE_PY,
        'torch.arange(n, n + self.layout.block_size, device=self.device)',
        'torch.arange(n + 1, n + 1 + self.layout.block_size, device=self.device)',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/drafter-reads-anchor-slot',
        DFLASH_DECODE_PY,
        'return self.block_logits(anchor_token, n)[self.layout.first_slot :]',
        'return self.block_logits(anchor_token, n)[1:]',
        DFLASH_TESTS,
        'sample_from_anchor=True drafts one too far',
    ),
    Mutation(
        'dflash/tree-wrong-slot',
        DFLASH_DECODE_PY,
        'logprobs[depth].expand(len(new_tokens), -1)',
        'logprobs[depth - 1].expand(len(new_tokens), -1)',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/context-positions-from-0',
        DFLASH_DECODE_PY,
        'positions = torch.arange(start, start + context.shape[1], device=self.device)',
        'positions = torch.arange(context.shape[1], device=self.device)',
        DFLASH_TESTS,
    ),
    Mutation(
        'dflash/export-mask-id',
        DFLASH_SPEC_PY,
        '"mask_token_id": dims.mask_token_id,',
        '"mask_token_id": dims.mask_token_id - 1,',
        DFLASH_EXPORT,
    ),
    Mutation(
        'dflash/export-layers-reversed',
        DFLASH_SPEC_PY,
        '"aux_hidden_state_layer_ids": list(dims.target_layers),',
        '"aux_hidden_state_layer_ids": list(reversed(dims.target_layers)),',
        DFLASH_EXPORT,
    ),
    Mutation(
        'dflash/export-speculative-tokens',
        DFLASH_SPEC_PY,
        '"speculative_tokens": draft.layout.predictions,',
        '"speculative_tokens": dims.block_size,',
        DFLASH_EXPORT,
    ),
    Mutation('dflash/export-trained-mask', DFLASH_SPEC_PY, 'if bool((delta != 0).any()):', 'if False:', DFLASH_EXPORT),
]

OBJECTIVES_PY = "specdraft/drafts/objectives.py"
LK_PY = "specdraft/drafts/lk.py"
OBJECTIVE_TESTS = ("tests/test_objectives.py",)
DISTILL_TOKENS_TESTS = OBJECTIVE_TESTS + ("tests/test_eagle3.py", "tests/test_dflash.py")

# draft.distill_tokens: all -- which rows the teacher terms and CE learn, and CE's normalisation
DISTILL_TOKENS: List[Mutation] = [
    Mutation(
        "distill/ce-mean-over-all-rows",
        "specdraft/drafts/objective_options.py",
        'if answers in (0, rows) or "ce" not in self.names:',
        "if True:",
        DISTILL_TOKENS_TESTS,
        "CE divided by every distilled row, so its weight shrinks with the prompt share",
    ),
    Mutation(
        "distill/ce-on-prompt-tokens",
        OBJECTIVES_PY,
        "return labels.masked_fill(to_device(~is_answer, labels.device), -1), answers",
        "return labels, answers",
        DISTILL_TOKENS_TESTS,
        "CE learns the prompt's text as if the target wrote it",
    ),
    Mutation(
        "distill/glide-all-tokens-ignored",
        GLIDE_TRAIN_PY,
        "counted = counted_predictions(self.objective.taught(host.loss_mask, host.token_mask), host.documents, lag)",
        "counted = counted_predictions(host.loss_mask, host.documents, lag)",
        OBJECTIVE_TESTS,
        "distill_tokens: all silently trains on answers only",
    ),
    Mutation(
        "distill/eagle3-all-tokens-ignored",
        EAGLE3_TRAIN_PY,
        "taught = self.objective.taught(host.loss_mask, host.token_mask).bool()",
        "taught = host.loss_mask.bool()",
        E3_TRAIN,
    ),
    Mutation(
        "distill/dflash-anchors-among-answers-only",
        DFLASH_TRAIN_PY,
        "self.objective.taught(host.loss_mask, host.token_mask),\n            batch.options",
        "host.loss_mask,\n            batch.options",
        DFLASH_TESTS,
    ),
    Mutation(
        "distill/eagle3-label-in-the-next-conversation",
        EAGLE3_TRAIN_PY,
        "counted[:, : max(T - 2 - k, 0)] &= host.documents[:, 2 + k :] == host.documents[:, : max(T - 2 - k, 0)]",
        "pass",
        E3_TRAIN,
    ),
    Mutation(
        "distill/dflash-label-in-the-next-conversation",
        DFLASH_BLOCKS_PY,
        'counted &= (\n            documents.gather(1, label_pos.flatten(1)).view_as(label_pos) == documents.gather(1, anchors)[..., None]\n        )',
        'pass',
        DFLASH_TESTS,
    ),
    Mutation(
        "dflash/context-of-the-previous-conversation",
        DFLASH_BLOCKS_PY,
        "before_anchor = before_anchor & (kv >= context_start[b, block])",
        "before_anchor = before_anchor",
        DOCUMENT_TESTS + DFLASH_TESTS,
        "a packed block attends to the conversation before (the dense and flex paths; CPU slices it away)",
    ),
    Mutation(
        "distill/dflash-anchor-before-the-next-conversation",
        DFLASH_BLOCKS_PY,
        "candidate[:, 1 : last + 1] &= documents[:, 2 : last + 2] == documents[:, 1 : last + 1]",
        "pass",
        DFLASH_TESTS,
    ),
]

# Serving conventions (issue 19): what a server computes from our files equals what we trained
E3_EXPORT = "specdraft/drafts/eagle3/export.py"
CONV = "tests/test_serving_conventions.py"
E3_TEACHER = ("tests/test_eagle3.py", "-k", "objectives_read")

CONVENTIONS: List[Mutation] = [
    Mutation(
        "conventions/sglang-ids-unshifted",
        E3_EXPORT,
        "return [layer - 1 for layer in layers]",
        "return list(layers)",
        (f"{CONV}::test_sglang_gets_our_layer_ids_minus_one",),
        "SGLang captures one layer deeper",
    ),
    Mutation(
        "conventions/layers-unsorted",
        E3_LAYER,
        "layers = sorted(int(layer) for layer in draft_cfg.target_layers or [])",
        "layers = [int(layer) for layer in draft_cfg.target_layers or []]",
        (f"{CONV}::test_captured_states_concatenate_in_increasing_layer_order",),
        "fc trained on a permutation of what the server concatenates",
    ),
    Mutation(
        "conventions/shallow-default-unsorted",
        E3_LAYER,
        "return sorted(layers), \"vLLM's default [2, L//2, L-3]\"",
        "return layers, \"vLLM's default [2, L//2, L-3]\"",
        ("tests/test_eagle3.py::test_default_layers_follow_vllm_and_shallow_targets_get_three_distinct",),
        "a 3-layer target's default [2, 1, 0] kept unsorted",
    ),
    Mutation(
        "conventions/last-layer-exported",
        "specdraft/drafts/base.py",
        "if num_target_layers is not None and num_target_layers in target_layers:",
        "if False:",
        (
            f"{CONV}::test_a_layer_no_server_captures_is_refused_in_one_line",
            "tests/test_dflash.py::test_a_speculators_export_of_the_last_layers_output_is_refused_and_not_a_default",
        ),
        "layer L exported (EAGLE-3 and DFlash), which no server captures",
    ),
    Mutation(
        "conventions/dflash-shallow-default-takes-the-last-output",
        "specdraft/drafts/dflash/options.py",
        "start, end = min(1, num_target_layers - 1), num_target_layers - 1",
        "start, end = 1, num_target_layers",
        ("tests/test_dflash.py::test_default_target_layers_are_five_evenly_spaced_inputs_of_layers",),
        "a shallow target's default includes layer L: no speculators export",
    ),
    Mutation(
        "conventions/sglang-embeddings-id",
        E3_EXPORT,
        "if 0 in dims.target_layers:",
        "if False:",
        (f"{CONV}::test_a_layer_no_server_captures_is_refused_in_one_line",),
        "the embeddings written as SGLang id -1",
    ),
    Mutation(
        "conventions/sglang-norm-before-residual",
        E3_EXPORT,
        'for flag in ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")',
        'for flag in ("fc_norm", "norm_before_fc", "norm_output")',
        ("tests/test_eagle3_export.py::test_sglang_export_has_exactly_its_keys_and_config",),
        "SGLang's midlayer ignores norm_before_residual: exported anyway",
    ),
    Mutation(
        "conventions/inv-freq-cast",
        "specdraft/drafts/base.py",
        "return cast_parameters(self, dtype)",
        "return self.to(dtype)",
        (f"{CONV}::test_a_bf16_draft_keeps_its_rotary_fp32_as_training_does",),
        "bf16 eval rounds the rotary inv_freq that training kept fp32",
    ),
    Mutation(
        "conventions/rope-scaling-ignored",
        "specdraft/target/rotary.py",
        'getattr(text, "rope_parameters", None)\n        or {"rope_type": "default",',
        '{"rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"]}or {"rope_type": "default",',
        (f"{CONV}::test_llama31_rope_scaling_is_the_targets_and_speculators_computes_our_logits",),
        "the draft ignores Llama-3.1's llama3 rope scaling",
    ),
    Mutation(
        "conventions/sglang-rope-keys",
        E3_EXPORT,
        "config.update(legacy_rope_keys(d.rope_parameters))",
        "config.update()",
        (f"{CONV}::test_sglang_config_spells_rope_as_its_llama_layer_reads_it",),
        "SGLang reads rope_theta / rope_scaling: served at theta 10000, unscaled",
    ),
    Mutation(
        "conventions/teacher-rows-ignored",
        EAGLE3_TRAIN_PY,
        "in_vocab = None if top1 is None else self.t2d[top1]",
        "in_vocab = None",
        E3_TEACHER,
        "the recipe's rows outside the draft vocab still taught",
    ),
    Mutation(
        "conventions/teacher-keep-ignored",
        "specdraft/drafts/objectives.py",
        "keep = None if teacher_keep is None else teacher_keep[rows]",
        "keep = None",
        E3_TEACHER,
        "the objective ignores the rows to drop",
    ),
]

# The checkpoint's frozen draft state (buffers, frozen parameters; issue 19, defects 10 and 11)
CHECKPOINT_PY = "specdraft/checkpoint/manager.py"
UNTRAINED_STATE_PY = "specdraft/checkpoint/untrained_state.py"
UNIVERSAL_PY = "specdraft/checkpoint/universal.py"
FROZEN_TRAVELS = (
    "tests/test_dflash_train.py::test_a_frozen_mask_row_travels_through_resume_elastic_resume_and_offline_export",
)
OFFLINE_EAGLE3 = ("tests/test_offline_commands.py", "-k", "eagle3")
CHECKPOINT = [
    Mutation(
        "checkpoint/frozen-state-not-restored",
        UNTRAINED_STATE_PY,
        "tensor.copy_(state[name].to(tensor.device))",
        "pass",
        FROZEN_TRAVELS,
        "a resumed draft keeps its fresh build's buffers / frozen parameters",
    ),
    Mutation(
        "checkpoint/frozen-state-not-saved",
        "specdraft/checkpoint/draft_parts.py",
        "write_untrained_state(draft_part(slot_dir, part.name), untrained_state(draft, part.weights))",
        "write_untrained_state(draft_part(slot_dir, part.name), {})",
        FROZEN_TRAVELS,
        "the slot lacks the frozen state",
    ),
    Mutation(
        "checkpoint/export-without-frozen-state",
        "specdraft/checkpoint/consolidate.py",
        '        **_trained_fp32(slot_dir, record),\n        **read_untrained_state(slot_dir),\n    }',
        '        **_trained_fp32(slot_dir, record),\n    }',
        FROZEN_TRAVELS,
        "`specdraft export` of a DFlash run: Missing key mask_delta",
    ),
    Mutation(
        "checkpoint/universal-step-from-a-buffer",
        UNIVERSAL_PY,
        'step = torch.load(trained[0] / "step.pt", weights_only=True)',
        'step = torch.load(params[0] / "step.pt", weights_only=True)',
        OFFLINE_EAGLE3,
        "EAGLE-3's elastic resume: zero/draft_model.d2t/step.pt does not exist",
    ),
]

# Memory per family and activation checkpointing (issue 22)
MEMORY = [
    Mutation(
        "memory/family-terms-ignored",
        "specdraft/train/memory.py",
        "    est.parts.update(terms)\n",
        "",
        ("tests/test_memory.py",),
        "the model adds nothing the family keeps but its activations",
    ),
    Mutation(
        "memory/checkpointed-call-sees-later-keys",
        "specdraft/drafts/base.py",
        "args = tuple(list(a) if isinstance(a, list) else a for a in args)",
        "args = tuple(args)",
        ("tests/test_activation_checkpointing.py",),
        "EAGLE-3's recomputed step reads the keys of the steps after it",
    ),
    Mutation(
        "memory/checkpointing-never-on",
        "specdraft/drafts/registry.py",
        'draft.gradient_checkpointing = bool(draft_cfg.get("gradient_checkpointing") or False)',
        "draft.gradient_checkpointing = False",
        ("tests/test_activation_checkpointing.py",),
        "draft.gradient_checkpointing is accepted and ignored",
    ),
]

# DSpark: the head wiring, the Markov shift, the confidence target, the stop
DSPARK_PY = "specdraft/drafts/dspark/model.py"
DSPARK_TRAIN_PY = "specdraft/drafts/dspark/train.py"
DSPARK_EXPORT_PY = "specdraft/drafts/dspark/export.py"
DSPARK_DECODE_PY = "specdraft/drafts/dspark/decode.py"
DSPARK_TESTS = ("tests/test_dspark.py",)
DSPARK_EXPORT = ("tests/test_dspark_export.py",)  # needs the speculators venv for the forward check
DSPARK: List[Mutation] = [
    Mutation(
        'dspark/markov-shift-one-late',
        DFLASH_BLOCKS_PY,
        'offsets = (torch.arange(self.block_size, device=self.anchors.device) - first_slot).clamp_min(0)',
        'offsets = (torch.arange(self.block_size, device=self.anchors.device) - first_slot + 1).clamp_min(0)',
        DSPARK_TESTS,
        "a slot's Markov bias reads the token it predicts (the label leaks in)",
    ),
    Mutation(
        'dspark/markov-shift-one-early',
        DFLASH_BLOCKS_PY,
        'offsets = (torch.arange(self.block_size, device=self.anchors.device) - first_slot).clamp_min(0)',
        'offsets = (torch.arange(self.block_size, device=self.anchors.device) - first_slot - 1).clamp_min(0)',
        DSPARK_TESTS,
        "a slot's Markov bias reads the token two before its label",
    ),
    Mutation(
        'dspark/markov-bias-dropped',
        DSPARK_PY,
        'return BlockHead(\n            torch.cat([hidden, m.to(hidden.dtype)], dim=-1),\n            head_weight,',
        'return BlockHead(\n            torch.cat([hidden, 0 * m.to(hidden.dtype)], dim=-1),\n            head_weight,',
        DSPARK_TESTS,
        "the head's Markov bias never reaches the logits",
    ),
    Mutation(
        'dspark/confidence-reads-the-bias-features',
        DSPARK_PY,
        'confidence_in = torch.cat([hidden, e.to(hidden.dtype)], dim=-1) if self.dims.confidence_with_markov else hidden',
        'confidence_in = torch.cat([hidden, m.to(hidden.dtype)], dim=-1) if self.dims.confidence_with_markov else hidden',
        DSPARK_EXPORT,
        "the confidence head reads the gated features, not markov_w1[previous] (speculators' wiring)",
    ),
    Mutation(
        'dspark/gate-inputs-swapped',
        DSPARK_PY,
        'torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e',
        'torch.sigmoid(self.gate_proj(torch.cat([e, hidden], dim=-1)[..., :hidden.shape[-1] + e.shape[-1]])) * e',
        DSPARK_EXPORT,
        "the gated head reads [e; h], speculators' reads [h; e]",
    ),
    Mutation(
        'dspark/rnn-state-not-carried',
        DSPARK_PY,
        'state = gate * state + (1.0 - gate) * torch.tanh(candidate)',
        'state = (1.0 - gate) * torch.tanh(candidate)',
        DSPARK_EXPORT,
        "the rnn head forgets its state",
    ),
    Mutation(
        'dspark/confidence-target-is-tv',
        DSPARK_TRAIN_PY,
        'out[rows] = torch.minimum(p, q).sum(dim=-1).clamp(0.0, 1.0)',
        'out[rows] = 1.0 - torch.minimum(p, q).sum(dim=-1).clamp(0.0, 1.0)',
        DSPARK_TESTS,
        "the confidence learns the rejection probability",
    ),
    Mutation(
        'dspark/confidence-target-ignores-temperature',
        DSPARK_TRAIN_PY,
        'q, p = torch.softmax(z / temperature, dim=-1), torch.softmax(t / temperature, dim=-1)',
        'q, p = torch.softmax(z, dim=-1), torch.softmax(t, dim=-1)',
        DSPARK_TESTS,
    ),
    Mutation(
        'dspark/confidence-target-without-markov',
        DSPARK_TRAIN_PY,
        'accepted = acceptance_targets(\n                student.detach(),\n                head.weight.detach(),\n                teacher,\n                lm_head_weight,',
        'accepted = acceptance_targets(\n                student.detach()[:, :lm_head_weight.shape[1]], lm_head_weight,\n                teacher,\n                lm_head_weight,',
        DSPARK_TESTS,
        "the acceptance target from DFlash's logits, not the Markov-biased ones drafted",
    ),
    Mutation(
        'dspark/confidence-loss-unweighted',
        DSPARK_TRAIN_PY,
        'return self.dims.confidence_loss_weight * bce, metrics',
        'return bce, metrics',
        DSPARK_TESTS,
    ),
    Mutation(
        'dspark/stop-keeps-the-low-slot',
        DSPARK_DECODE_PY,
        'if confidence < self.confidence_threshold:  # the block stops before this slot',
        'if j > 0 and confidence < self.confidence_threshold:  # the block stops before this slot',
        DSPARK_TESTS,
        "the first slot is drafted whatever its confidence",
    ),
    Mutation(
        'dspark/drafter-previous-is-anchor',
        DSPARK_DECODE_PY,
        'torch.tensor([token], device=self.device), state\n                )',
        'torch.tensor([int(tokens[-1])], device=self.device), state\n                )',
        DSPARK_TESTS,
        "every slot's bias reads the anchor at inference",
    ),
    Mutation(
        'dspark/tree-children-read-the-root',
        DSPARK_DECODE_PY,
        'hidden[first + depth].expand(count, -1),\n                new_tokens.to(self.device),',
        'hidden[first + depth].expand(count, -1),\n                new_tokens.to(self.device) * 0 + int(tokens[-1]),',
        DSPARK_TESTS,
        "a tree node's children read the anchor, not their parent's token",
    ),
    Mutation(
        'dspark/export-head-type',
        DSPARK_EXPORT_PY,
        'markov_rank=dims.markov_rank,\n        markov_head_type=dims.markov_head_type,',
        'markov_rank=dims.markov_rank,\n        markov_head_type="vanilla",',
        DSPARK_EXPORT,
    ),
]

# MTP: which token each recursive step reads and predicts, the recursion, the step weights, the
# target's names and layout, the stitched target, the drafter's positions and hidden input
MTP_PY = "specdraft/drafts/mtp/model.py"
MTP_TRAIN_PY = "specdraft/drafts/mtp/train.py"
MTP_LAYER_PY = "specdraft/drafts/mtp/layer.py"
MTP_EXPORT_PY = "specdraft/drafts/mtp/export.py"
MTP_TESTS = "tests/test_mtp.py"
MTP_SEMANTICS = f"{MTP_TESTS}::test_step_k_at_row_t_reads_tokens_up_to_t_plus_k_plus_1_and_predicts_t_plus_k_plus_2"
MTP_SPECULATORS = f"{MTP_TESTS}::test_speculators_loads_the_export_and_computes_our_logits_and_loss"
MTP_INIT = f"{MTP_TESTS}::test_the_new_draft_is_the_targets_own_mtp_layer"
MTP_DRAFTER = f"{MTP_TESTS}::test_the_drafter_proposes_what_training_step_zero_predicts"
MTP: List[Mutation] = [
    Mutation(
        "mtp/label-one-early",
        MTP_TRAIN_PY,
        "labels = input_ids[:, k + 2 : k + 2 + V].flatten()[rows]",
        "labels = input_ids[:, k +1:k + 1+ V].flatten()[rows]",
        (MTP_SEMANTICS, MTP_SPECULATORS),
        "step k learns x_{t+k+1}, the token it reads",
    ),
    Mutation(
        "mtp/every-step-reads-the-next-token",
        MTP_PY,
        "hidden = self.step(hidden, input_embeds[:, k + 1 : k + 1 + V]",
        "hidden = self.step(hidden, input_embeds[:,1:1 + V]",
        (MTP_SEMANTICS, MTP_SPECULATORS),
        "the recursion's token input does not advance with the step",
    ),
    Mutation(
        "mtp/no-recursion",
        MTP_PY,
        "hidden = self.step(hidden, input_embeds[:, k + 1 : k + 1 + V]",
        "hidden = self.step(final_hidden[:, :V], input_embeds[:, k + 1 : k + 1 + V]",
        (MTP_SPECULATORS,),
        "every step reads the target's hidden state instead of the previous step's output",
    ),
    Mutation(
        "mtp/uniform-step-weights",
        MTP_TRAIN_PY,
        "raw = [beta**k for k in range(steps)]",
        "raw = [1.0for k in range(steps)]",
        (f"{MTP_TESTS}::test_step_weights_are_beta_powers_normalised", MTP_SPECULATORS),
    ),
    Mutation(
        "mtp/document-border-counted",
        MTP_TRAIN_PY,
        "            if host.documents is not None:  # ... and in t's own conversation",
        "            if False:  # ... and in t's own conversation",
        (f"{MTP_TESTS}::test_packed_documents_count_no_row_whose_token_is_in_the_next_document",),
        "a row learns the first tokens of the next packed conversation",
    ),
    Mutation(
        "mtp/documents-attend-across-borders",
        MTP_PY,
        "mask = None if documents is None else PackedDocuments.of(documents[:, :V])",
        "mask = None",
        (f"{MTP_TESTS}::test_packed_documents_count_no_row_whose_token_is_in_the_next_document",),
        "a packed conversation attends to the one before it",
    ),
    Mutation(
        "mtp/target-without-mtp-accepted",
        MTP_EXPORT_PY,
        'if path != "the target" and not target_has_mtp(path):',
        "if False:",
        (f"{MTP_TESTS}::test_a_target_without_an_mtp_layer_is_refused_in_one_line",),
    ),
    Mutation(
        "mtp/input-order-swapped",
        MTP_LAYER_PY,
        "x = torch.cat([self.token_layernorm(token_embeddings), self.hidden_layernorm(hidden_states)], dim=-1)",
        "x = torch.cat([self.hidden_layernorm(hidden_states), self.token_layernorm(token_embeddings)], dim=-1)",
        (MTP_SPECULATORS,),
        "input_proj reads [hidden; embedding], vLLM's and speculators' read [embedding; hidden]",
    ),
    Mutation(
        "mtp/fc-norms-swapped",
        MTP_LAYER_PY,
        '    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),\n    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),',
        '    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.token_layernorm."),\n    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.hidden_layernorm."),',
        (MTP_INIT,),
        "the target's hidden-state norm read as the embedding's",
    ),
    Mutation(
        "mtp/experts-gate-up-swapped",
        MTP_LAYER_PY,
        'torch.cat([by_index[i]["gate_proj"], by_index[i]["up_proj"]])',
        'torch.cat([by_index[i]["up_proj"], by_index[i]["gate_proj"]])',
        (MTP_INIT,),
        "transformers' fused gate_up_proj holds [gate; up]",
    ),
    Mutation(
        "mtp/stitched-keeps-the-targets-layer",
        "specdraft/drafts/mtp/export.py",
        "trained[key].detach().to(\"cpu\", tensor.dtype).contiguous().clone() if key in trained",
        "trained[key].detach().to(\"cpu\", tensor.dtype).contiguous().clone() if False",
        (f"{MTP_TESTS}::test_the_stitched_target_is_the_target_with_the_trained_layer",),
    ),
    Mutation(
        "mtp/drafter-positions-one-late",
        "specdraft/drafts/mtp/decode.py",
        "torch.arange(start, n, device=self.device)",
        "torch.arange(start + 1, n + 1, device=self.device)",
        (MTP_DRAFTER,),
        "index t at position t + 1 (EAGLE-3's convention), training's is t",
    ),
    Mutation(
        "mtp/drafter-hidden-before-the-final-norm",
        "specdraft/drafts/mtp/decode.py",
        "final = self.target_model.norm(layer_output).to(self.device, self.dtype)",
        "final = layer_output.to(self.device, self.dtype)",
        (MTP_DRAFTER,),
        "the drafter reads the last layer's output, training the final norm's",
    ),
    Mutation(
        "mtp/linear-attention-rollback-not-refused",
        "specdraft/decode/cache.py",
        'if hasattr(layer, "recurrent_states"):',
        "if False:",
        (f"{MTP_TESTS}::test_a_hybrid_target_trains_and_eval_refuses_it_in_one_line",),
        "a hybrid target decodes with rejected tokens left in its recurrent state",
    ),
]

IMPORTS_PY = "specdraft/export/init_from.py"
IMPORTS_TESTS = ("tests/test_imports.py",)
IMPORTS_TRAIN = ("tests/test_imports_train.py",)

IMPORTS = [
    Mutation(
        "imports/longspec-norms-swapped",
        LONGSPEC_PY,
        '    "cross_layernorm.weight": "post_self_attention_layernorm.weight",\n    "post_attention_layernorm.weight": "post_cross_attention_layernorm.weight",',
        '    "cross_layernorm.weight": "post_cross_attention_layernorm.weight",\n    "post_attention_layernorm.weight": "post_self_attention_layernorm.weight",',
        IMPORTS_TESTS,
        "LongSpec's layer gets the cross-attention's norm before its MLP and the reverse",
    ),
    Mutation(
        "imports/speculators-flags-swapped",
        "specdraft/drafts/eagle3/export.py",
        '"norm_before_fc": "norm_before_fc",\n    "fc_norm": "fc_norm"',
        '"norm_before_fc": "fc_norm",\n                        "fc_norm": "norm_before_fc"',
        IMPORTS_TESTS,
        "an import reads speculators' fc_norm as norm_before_fc",
    ),
    Mutation(
        "imports/sglang-layer-ids-not-shifted",
        "specdraft/drafts/eagle3/export.py",
        '{"target_layers": [int(i) + 1 for i in ids]}',
        '{"target_layers": [int(i) for i in ids]}',
        IMPORTS_TESTS,
        "SGLang's ids (the output of layer i) read as ours (its input)",
    ),
    Mutation(
        "imports/identity-maps-dropped",
        "specdraft/drafts/eagle3/export.py",
        '    if d.draft_vocab_size != d.vocab_size:\n        return {}',
        '    if True:\n        return {}',
        IMPORTS_TESTS,
        "a whole-vocab speculators EAGLE-3 has no maps to load",
    ),
    Mutation(
        "imports/mask-delta-not-zero",
        DFLASH_SPEC_PY,
        'return {"mask_delta": torch.zeros(draft.dims.hidden_size)}',
        'return {"mask_delta": torch.ones(draft.dims.hidden_size)}',
        IMPORTS_TESTS,
        "MASK embedded unlike speculators after an import",
    ),
    Mutation(
        "imports/no-shape-check",
        IMPORTS_PY,
        "        if got.shape != want.shape:",
        "        if False:",
        IMPORTS_TESTS,
        "a wrong shape reaches load_state_dict (a traceback, not one line)",
    ),
    Mutation(
        "imports/pickle-runs-code",
        IMPORTS_PY,
        'loaded = torch.load(path, map_location="cpu", weights_only=True)',
        'loaded = torch.load(path, map_location="cpu", weights_only=False)',
        IMPORTS_TESTS,
        "an untrusted pickle runs its code",
    ),
    Mutation(
        "imports/oldest-export-of-a-run",
        IMPORTS_PY,
        "path = steps[-1] if steps else path",
        "path = steps[0] if steps else path",
        IMPORTS_TESTS,
        "a run directory imports its first export",
    ),
    Mutation(
        "imports/unexpected-tensor-ignored",
        IMPORTS_PY,
        "        if theirs not in names and theirs not in TARGET_TENSORS:",
        "        if False:",
        IMPORTS_TESTS,
        "a tensor the draft has no place for is dropped silently",
    ),
    Mutation(
        "imports/settings-not-checked",
        IMPORTS_PY,
        "        if plain(value) != plain(ours):",
        "        if False:",
        IMPORTS_TESTS,
        "a draft trained on other target layers imports as if it were this run's",
    ),
    Mutation(
        "imports/d2t-recounted",
        IMPORTS_PY,
        "    draft.load_state_dict(imported.state, strict=True)\n",
        "    draft.load_state_dict(imported.state, strict=True)\n"
        "    if data is not None and hasattr(draft, 'set_vocab_maps'):\n"
        "        from specdraft.drafts.eagle3.vocab import count_target_tokens, vocab_maps\n"
        "        draft.set_vocab_maps(*vocab_maps(count_target_tokens(data, draft.dims.vocab_size), "
        "draft.dims.draft_vocab_size))\n",
        IMPORTS_TRAIN,
        "EAGLE-3's d2t/t2d recounted from the run's data instead of the imported ones",
    ),
    Mutation(
        "imports/resume-imports-again",
        IMPORTS_PY,
        "    if resuming:\n",
        "    if False:\n",
        IMPORTS_TRAIN,
        "a resumed run imports its starting draft again",
    ),
    Mutation(
        "imports/glide-bias-ignored",
        "specdraft/drafts/layers.py",
        "self.q_proj = nn.Linear(in_size, d.num_heads * d.head_dim, bias=bias)",
        "self.q_proj = nn.Linear(in_size, d.num_heads * d.head_dim, bias=False)",
        IMPORTS_TESTS,
        "a Qwen2 target's GLIDE has no q bias: LongSpec's Qwen2 drafts do not load",
    ),
]

# -- packed documents without (T, T) masks: GLIDE and DFlash, per device path ----------------------

PEAGLE_PY = "specdraft/drafts/peagle/model.py"
PEAGLE_TRAIN_PY = "specdraft/drafts/peagle/train.py"
PEAGLE_COD = "specdraft/drafts/peagle/cod.py"
PEAGLE_DECODE = "specdraft/drafts/peagle/decode.py"
PEAGLE_EXPORT = "specdraft/drafts/peagle/export.py"
COD_ATTENTION = "specdraft/drafts/peagle/cod_attention.py"
PE_UNIT = ("tests/test_peagle.py", "-k", "not trains")
PE_SPEC = ("tests/test_peagle_export.py", "-k", "vocab100 or vllm")
PE_SP = ("tests/test_sequence_parallel.py", "-k", "peagle and equals_one_rank")
# the mask-free slot attention against the dense mask, then speculators' logits (one -k for both files)
PE_SLOTS = (
    "tests/test_cod_attention.py",
    "tests/test_peagle_export.py",
    "-k",
    "slot_attention_equals or vocab100 or vllm",
)
PEAGLE: List[Mutation] = [
    Mutation(
        "peagle/cod-no-shift",
        PEAGLE_COD,
        "pool = kept + 1\n",
        "pool = kept + 0\n",
        PE_UNIT,
        "deeper depths drawn from the same positions, not the next ones",
    ),
    Mutation(
        "peagle/cod-no-floor",
        PEAGLE_COD,
        ".double() * max(ratio**d, ratio_min)).long()",
        ".double() *ratio ** d).long()",
        PE_UNIT,
        "r_min ignored: deep depths starve",
    ),
    Mutation(
        "peagle/cod-invalid-kept",
        PEAGLE_COD,
        "pool = pool[valid[pool]]",
        "pool = pool",
        PE_UNIT,
        "slots whose label is not taught sampled",
    ),
    Mutation(
        "peagle/visibility-sees-later-context",
        PEAGLE_COD,
        "(k_anchor <= q_anchor)",
        "(k_anchor <= q_anchor + 1)",
        PE_UNIT,
        "a slot sees the next position's real token",
    ),
    Mutation(
        "peagle/visibility-no-rollout",
        PEAGLE_COD,
        "rollout = (k_anchor == q_anchor) & (key_depth[..., None, :] <= depth[..., :, None])",
        "rollout = (k_anchor == q_anchor) & (key_depth[..., None, :] == depth[..., :, None])",
        ("tests/test_cod_attention.py",) + PE_UNIT,  # PE_SPEC's -k would deselect the others
        "a deep slot does not see its own rollout",
    ),
    Mutation(
        "peagle/mask-hidden-unused",
        PEAGLE_PY,
        "self.mask_hidden.to(aux.dtype)[0]",
        "aux[anchor.clamp_min(0)]",
        PE_SPEC,
        "deeper slots read real target states",
    ),
    Mutation(
        "peagle/mask-token-row-not-shared",
        PEAGLE_PY,
        "~first | (ids.gather(1, (anchor + 1).clamp(max=ids.shape[1] - 1)) == self.dims.mask_token_id)",
        "~first",
        PE_SPEC,
        "the text's own mask token read with the target's row (speculators/vLLM read one row)",
    ),
    Mutation(
        "peagle/slot-position-shift",
        PEAGLE_PY,
        "positions = anchor + depth + 1",
        "positions = anchor + 1",
        PE_SPEC,
        "every depth at its anchor's RoPE position",
    ),
    Mutation(
        "peagle/drafter-depth-position",
        PEAGLE_DECODE,
        "n + torch.arange(1, m + 1, device=dev)",
        "n + torch.arange(0, m, device=dev)",
        PE_UNIT,
        "inference positions one off the training ones",
    ),
    Mutation(
        "peagle/slot-attention-no-rollout",
        COD_ATTENTION,
        "ttt_attention(query, keys, values, slots.documents)",
        "ttt_attention(query, keys[:1], values[:1], slots.documents)",
        PE_SLOTS,
        "a deep slot does not see its own rollout (the mask-free path)",
    ),
    Mutation(
        "peagle/slot-attention-wrong-anchor",
        COD_ATTENTION,
        "scatter(2, _rows(anchor, x), x)",
        "scatter(2, _rows(anchor.flip(-1), x), x)",
        PE_SLOTS,
        "a depth's slots put at another slot's position",
    ),
    Mutation(
        "peagle/sp-context-across-conversations",
        PEAGLE_PY,
        "cod_visibility(anchor, depth, documents, key_anchor=key_anchor,",
        "cod_visibility(anchor, depth, None, key_anchor=key_anchor,",
        PE_SP,
        "under SP a slot reads the gathered keys of other packed conversations",
    ),
    Mutation(
        "peagle/sp-teacher-row",
        PEAGLE_TRAIN_PY,
        "teacher_at = at // T * local_rows + at % T - shard.start + 1",
        "teacher_at = at // T * T + at % T - shard.start + 1",
        PE_SP,
        "under SP the teacher of row b > 0 read from the wrong row of the extended final states",
    ),
    Mutation(
        "sequence/gather-gradient-not-summed",
        "specdraft/parallel/sequence.py",
        "return total[ctx.rank], None, None, None",
        "return grad[ctx.rank], None, None, None",
        ("tests/test_sequence_parallel.py", "-k", "permuted_gradient or peagle and equals_one_rank"),
        "a gathered shard's gradient from the other ranks' reads lost",
    ),
    Mutation(
        "peagle/export-mask-row",
        PEAGLE_EXPORT,
        "embed[draft.dims.mask_token_id] = state_dict[\"mask_embedding\"]",
        "embed[0] = state_dict[\"mask_embedding\"]",
        PE_SPEC,
        "the trained mask row written to token 0",
    ),
]

DOCUMENTS: List[Mutation] = [
    Mutation(
        "documents/cuda-takes-the-dense-path",
        ATTENTION_PY,
        'return {"cpu": "slices", "cuda": "flex"}',
        'return {"cpu": "slices", "cuda": "dense"}',
        DOCUMENT_TESTS,
        "a GPU builds the dense document masks again",
    ),
    Mutation(
        "documents/cpu-takes-the-dense-path",
        ATTENTION_PY,
        'return {"cpu": "slices", "cuda": "flex"}',
        'return {"cpu": "dense", "cuda": "flex"}',
        DOCUMENT_TESTS,
        "CPU builds the dense document masks again",
    ),
    Mutation(
        "documents/cuda-block-masks-eager",
        ATTENTION_PY,
        "build = _compiled(create_block_mask, device) or create_block_mask",
        "build = create_block_mask",
        DOCUMENT_TESTS,
        "a GPU evaluates every block mask over the whole (B, 1, T, T) grid",
    ),
    Mutation(
        "documents/automatic-dynamic-shapes",
        ATTENTION_PY,
        "torch.compile(fn, backend=backend, dynamic=False)",
        "torch.compile(fn, backend=backend)",
        ("tests/test_recompile.py",),
        "the GPU path recompiles call sites into graphs of symbolic sizes",
    ),
    Mutation(
        "documents/default-recompile-limit",
        ATTENTION_PY,
        "max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)",
        "torch._dynamo.config.recompile_limit",
        ("tests/test_recompile.py",),
        "past 8 compiled call sites, flex_attention runs eagerly (the scores)",
    ),
    Mutation(
        "dflash/sp-anchor-count-per-batch",
        DFLASH_BLOCKS_PY,
        "A = blocks.anchors.shape[1] if static else",
        "A = max(1, int(mine.sum(dim=1).max())) if static else",
        ("tests/test_recompile.py",),
        "under SP the GPU path recompiles for each count of a rank's anchors",
    ),
    Mutation(
        "documents/segment-border-off-by-one",
        ATTENTION_PY,
        "borders = [0, *(torch.nonzero(row).flatten() + 1).tolist(), T]",
        "borders = [0, *(torch.nonzero(row).flatten() + 2).tolist(), T]",
        DOCUMENT_TESTS + TTT_TESTS,
        "a conversation's first token is attended with the one before",
    ),
    Mutation(
        "glide/flex-window-plus-1",
        LAYERS_PY,
        "return (q >= kv) & (q - kv < window) &",
        "return (q >= kv) & (q - kv <= window) &",
        DOCUMENT_TESTS,
        "on CUDA, a packed query sees one key beyond its window",
    ),
    Mutation(
        "glide/flex-window-ignores-conversations",
        LAYERS_PY,
        "& (documents[b, q] == documents[b, kv])",
        "& (documents[b, q] >= 0)",
        DOCUMENT_TESTS,
        "on CUDA, the sliding window crosses into the previous conversation",
    ),
    Mutation(
        "glide/flex-cross-lag-minus-1",
        LAYERS_PY,
        "last_key = torch.arange(T, device=documents.device) - lag",
        "last_key = torch.arange(T, device=documents.device) - lag + 1",
        DOCUMENT_TESTS,
        "on CUDA, a packed query reads the target one position closer than the lag",
    ),
    Mutation(
        "glide/flex-cross-ignores-conversations",
        LAYERS_PY,
        "& (documents[b, kv] == documents[b, q])",
        "& (documents[b, kv] >= 0)",
        DOCUMENT_TESTS,
        "on CUDA, a conversation's first queries read the previous one's target",
    ),
    Mutation(
        "glide/slices-window-plus-1",
        LAYERS_PY,
        "sliding_window_attention(*t, window), document_segments",
        "sliding_window_attention(*t, window + 1), document_segments",
        DOCUMENT_TESTS,
        "on CPU, a packed query sees one key beyond its window",
    ),
    Mutation(
        "glide/slices-lag-minus-1",
        LAYERS_PY,
        "lagged_cross_attention(*t, lag), document_segments",
        "lagged_cross_attention(*t, lag - 1), document_segments",
        DOCUMENT_TESTS,
        "on CPU, a packed query reads the target one position closer than the lag",
    ),
    Mutation(
        "dflash/slices-context-ends-one-early",
        DFLASH_BLOCKS_PY,
        "end = int(visibility.anchors[b, first:last].max())",
        "end = int(visibility.anchors[b, first:last].max()) - 1",
        DOCUMENT_TESTS,
        "on CPU, a conversation's last block loses the position before its anchor",
    ),
    Mutation(
        "dflash/slices-context-includes-anchor",
        DFLASH_BLOCKS_PY,
        "BlockVisibility(visibility.anchors[b : b + 1, first:last] - start, end - start, S)",
        "BlockVisibility(visibility.anchors[b : b + 1, first:last] - start + 1, end - start, S)",
        DOCUMENT_TESTS,
        "on CPU, a packed block sees its anchor's own target state",
    ),
    Mutation(
        "dflash/flex-ignores-conversations",
        DFLASH_BLOCKS_PY,
        "anchors, start, T, S = self.anchors, self.context_start, self.context_len, self.block_size",
        "anchors, start, T, S = self.anchors, None, self.context_len, self.block_size",
        DOCUMENT_TESTS,
        "on CUDA, a packed block attends to the conversations before its own",
    ),
]

CHAT_PY = "specdraft/data/chat.py"
PACKING_PY = "specdraft/data/packing.py"
SOURCES_PY = "specdraft/data/sources.py"
SPANS = "tests/test_spans.py"
DATA_COMMAND = "tests/test_data_command.py"
DATA_SPANS: List[Mutation] = [
    Mutation(
        "spans/no-reach-back-to-the-prompt",
        CHAT_PY,
        "        if shared < at:",
        "        if False:",
        (SPANS,),
        "Qwen3's last turn trained without the <think>\\n that opens its reasoning",
    ),
    Mutation(
        "spans/no-end-of-turn",
        CHAT_PY,
        "            return j + len(token)",
        "            return end",
        (SPANS,),
        "the end-of-turn token is not trained: the draft never learns to end a turn",
    ),
    Mutation(
        "spans/end-of-turn-only-when-adjacent",
        CHAT_PY,
        "    while j < len(text) and text[j].isspace():",
        "    while False:",
        (SPANS,),
        "Llama-2's ' ' + eos_token: its eos is not trained",
    ),
    Mutation(
        "spans/only-tokens-inside-the-answer",
        CHAT_PY,
        "return (a < stop and b > start) if b > a else start <= a < stop",
        "return (a >= start and b <= stop) if b > a else start <= a < stop",
        (SPANS,),
        "the token holding the answer's first character (' ' + content) is not trained",
    ),
    Mutation(
        "spans/header-tokens-trained",
        CHAT_PY,
        "return (a < stop and b > start) if b > a else start <= a < stop",
        "return (a < stop and b > start - 2) if b > a else start - 2 <= a < stop",
        (SPANS,),
        "the tokens just before the answer (the header's tail) are trained",
    ),
    Mutation(
        "spans/ids-used-when-the-template-rewrote-the-answer",
        CHAT_PY,
        'if ids is not None and text[start:end] != message["content"]:',
        "if False:",
        (SPANS,),
        "generated ids of the untrimmed answer spliced where the template rendered the trimmed one",
    ),
    Mutation(
        "spans/whitespace-answers-trained",
        CHAT_PY,
        "if text[s.start : s.end].strip()]",
        "ifs.end > s.start]",
        (SPANS, DATA_COMMAND),
        "an answer that renders as whitespace is trained (and its row not skipped)",
    ),
    Mutation(
        "spans/prefix-search-short",
        CHAT_PY,
        "            hi = mid - 1\n    return lo\n\n\ndef _common_suffix",
        "            hi = mid - 2\n    return lo\n\n\ndef _common_suffix",
        (SPANS,),
        "the shared prefix of the two renders found short: the answer starts inside its header",
    ),
    Mutation(
        "spans/suffix-search-short",
        CHAT_PY,
        "if a[len(a) - mid :] == b[len(b) - mid :]:",
        "if a[len(a) - mid - 1:] == b[len(b) - mid - 1:]:",
        (SPANS,),
        "the shared suffix found one character short: the answer ends one character late",
    ),
    Mutation(
        "spans/truncated-answer-ends-its-turn",
        CHAT_PY,
        'stop = end if message.get("truncated") else',
        "stop = end if False else",
        (SPANS,),
        "an answer cut at its token budget is trained with an end-of-turn: the draft learns to stop mid-sentence",
    ),
    Mutation(
        "data/strict-skips-anyway",
        PACKING_PY,
        "                if strict:\n                    raise",
        "                if False:\n                    raise",
        (f"{DATA_COMMAND}::test_data_strict_refuses_the_first_row_with_nothing_to_learn",),
        "data_strict: true no longer refuses a row with nothing to learn",
    ),
    Mutation(
        "data/skipped-rows-unnamed",
        PACKING_PY,
        "                rows.write(json.dumps({\"source\": where, \"skipped\": skip.reason}) + \"\\n\")",
        "                pass",
        (DATA_COMMAND,),
        "--json loses the skipped rows and every later row's source",
    ),
    Mutation(
        "data/tool-role-stops-the-build",
        SOURCES_PY,
        "    if name in TOOL_ROLES:",
        "    if False:",
        ("tests/test_data.py", "-k", "tool"),
        "a row with a tool turn stops the data build (unknown role) instead of being skipped and counted",
    ),
    Mutation(
        "data/tool-call-counted-as-null-content",
        SOURCES_PY,
        "calls = next((key for key in TOOL_CALL_KEYS if turn.get(key)), None)",
        "calls = None",
        ("tests/test_data.py", "-k", "tool"),
        "an OpenAI tool call (content null beside tool_calls) is counted as null content, not a tool turn",
    ),
]

# issue 35's losses (D-PACE, LK) as formulas on per-position tensors
LOSS_FORMULAS_TESTS = ("tests/test_loss_formulas.py",)
LOSS_FORMULAS: List[Mutation] = [
    Mutation(
        "losses/dpace-no-suffix-sum",
        OBJECTIVES_PY,
        "return (prefix * m).flip(-1).cumsum(-1).flip(-1) * m",
        "return prefix * m",
        LOSS_FORMULAS_TESTS,
        "D-PACE weighs a slot by its own survival, not by the expected length still riding on it",
    ),
    Mutation(
        "losses/dpace-unsmoothed-confidence",
        OBJECTIVES_PY,
        "(1.0 - alpha) * torch.exp(-ce.float()) + alpha",
        "torch.exp(-ce.float())",
        LOSS_FORMULAS_TESTS,
        "D-PACE without its smoothing constant alpha",
    ),
    Mutation(
        "losses/lk-lambda-not-detached",
        LK_PY,
        "lam = kl_scale * torch.exp(-kl_decay * mean_alpha.detach())",
        "lam = kl_scale * torch.exp(-kl_decay * mean_alpha)",
        LOSS_FORMULAS_TESTS,
        "LK's KL weight differentiated through",
    ),
    Mutation(
        "losses/lk-acceptance-renormalised",
        LK_PY,
        "alpha = acceptance_rate(target_probs_on_draft, draft_logits, temperature)",
        "alpha = acceptance_rate(target_probs, draft_logits, temperature)",
        LOSS_FORMULAS_TESTS,
        "acceptance counts target mass outside the draft vocab",
    ),
    Mutation(
        "losses/lk-trained-acceptance-renormalised",
        LK_PY,
        "p_accept = p if teacher_lse is None else torch.exp(teacher_logits - teacher_lse[:, None])",
        "p_accept = p",
        ("tests/test_loss_formulas.py",),
        "the trained LK acceptance reads the target renormalised over the draft vocab",
    ),
    Mutation(
        "losses/lk-trained-lambda-of-this-rank",
        OBJECTIVES_PY,
        'accept, kept = reduce(sums[at["accept"]].clone()), reduce(sums[at["kept"]].clone())',
        'accept, kept = sums[at["accept"]].clone(), sums[at["kept"]].clone()',
        ("tests/test_loss_formulas.py",),
        "lk_lambda's lambda from one sequence-parallel rank's rows, not the whole sequence's",
    ),
    Mutation(
        "losses/lk-lambda-of-one-rank",
        EAGLE3_TRAIN_PY,
        '                None if lse is None else lse[teacher_at],\n                sum_over_ranks,',
        '                None if lse is None else lse[teacher_at],\n                None,',
        ("tests/test_sequence_parallel.py::test_every_family_at_sp2_equals_one_rank_loss_and_gradients",),
        "EAGLE-3's lk_lambda takes lam from one rank's share of the rows",
    ),
    Mutation(
        "losses/lk-trained-alpha-gradient-sign",
        LK_PY,
        "scale = keep(torch.where(positive, -1.0 / alpha.clamp_min(1e-30), 0.0))",
        "scale = keep(torch.where(positive, 1.0 / alpha.clamp_min(1e-30), 0.0))",
        ("tests/test_loss_formulas.py", "tests/test_lk_train.py"),
        "lk_alpha climbs -log alpha instead of descending it",
    ),
    Mutation(
        "losses/dpace-weighting-ignored",
        DFLASH_TRAIN_PY,
        'if self.dims.loss_weighting == "dpace" else None',
        "if False else None",
        ("tests/test_dpace_train.py::test_dflash_dpace_loss_and_grads_equal_the_formula_over_its_blocks",),
        "draft.loss_weighting: dpace trains with the exp(-j / gamma) decay",
    ),
    Mutation(
        "losses/dpace-weights-on-the-decay",
        DFLASH_TRAIN_PY,
        "total = total + out.loss + weights[j] * extra",
        "total = total + weights[j] * (out.loss + extra)",
        ("tests/test_dpace_train.py::test_dflash_dpace_loss_and_grads_equal_the_formula_over_its_blocks",),
        "D-PACE's weights multiplied by the decay too",
    ),
]

# The teacher costs only what the loss reads (issue 43): the whole-vocab pass of a draft-vocab teacher
TEACHER_ROWS = ("tests/test_teacher_rows.py",)
TEACHER: List[Mutation] = [
    Mutation(
        "teacher/pass-at-every-row",
        EAGLE3_TRAIN_PY,
        "lse, top1 = teacher_vocab_pass(\n                    final,\n                    lm_head_weight,\n                    read.flatten().nonzero().flatten(),\n                    chunk_size,",
        "lse, top1 = teacher_vocab_pass(\n                    final,\n                    lm_head_weight,torch.arange(final.shape[0]),\n                    chunk_size,",
        TEACHER_ROWS,
        "the whole lm_head multiplied by rows no teacher reads",
    ),
    Mutation(
        "teacher/pass-misses-later-steps-rows",
        EAGLE3_TRAIN_PY,
        "for k, (counted, _, _) in enumerate(steps):",
        "for k, (counted, _, _) in enumerate(steps[:1]):",
        ("tests/test_sequence_parallel.py::test_every_family_at_sp2_equals_one_rank_loss_and_gradients",),
        "SP: the next rank's rows a later TTT step reads get no log-sum-exp / top-1",
    ),
    Mutation(
        "teacher/pass-in-whole-chunks",
        "specdraft/drafts/loss.py",
        "max(1, chunk * draft_vocab // V)",
        "chunk",
        TEACHER_ROWS,
        "(chunk, V) blocks: the pass holds V / Vd times what one loss chunk holds",
    ),
    Mutation(
        "teacher/top1-when-the-draft-vocab-is-whole",
        EAGLE3_TRAIN_PY,
        'self.teacher_rows == "in_vocab" and smaller',
        'self.teacher_rows == "in_vocab"',
        TEACHER_ROWS,
        "a whole-vocab pass whose every top-1 is a draft token",
    ),
    Mutation(
        "memory/zero-chunk-sized-from-one-vocab",
        "specdraft/drafts/base.py",
        "chunk = self.chunk if self.chunk > 0 else default_chunk_size(vocab)",
        "chunk = self.chunk if self.chunk > 0 else default_chunk_size(151936)",
        TEACHER_ROWS,
        "the memory model sizes a draft-vocab loss's chunk from another vocab than the loss does",
    ),
]

MATRIX = "tests/test_target_matrix.py"
TARGETS = [
    Mutation(
        "targets/tree-pass-without-the-window",
        "specdraft/decode/cache.py",
        "windowed = visible & (queries[:, None] - keys[None, :] < window)",
        "windowed = visible",
        (f"{MATRIX}::test_plain_greedy_decoding_is_the_targets_own_generate",),
        "a tree pass lets a windowed layer attend past its window",
    ),
    Mutation(
        "targets/windowed-layers-cached-by-their-window",
        "specdraft/decode/cache.py",
        "cache.layers = [DynamicLayer() if getattr(layer, \"is_sliding\", False) else layer for layer in cache.layers]",
        "pass",
        (f"{MATRIX}::test_plain_greedy_decoding_is_the_targets_own_generate",),
        "transformers' sliding-window cache: a rejected token's entry cannot be dropped",
    ),
    Mutation(
        "targets/glide-partial-rope-over-the-whole-head",
        "specdraft/drafts/glide/model.py",
        "    if rotated == x.shape[-1]:\n        return apply_rope(x, cos, sin)",
        "    if True:\n        return apply_rope(x, cos, sin)",
        (f"{MATRIX}::test_a_cell_trains_resumes_exports_and_evaluates_losslessly[glm4_moe-glide]",),
        "GLIDE rotates whole heads with a partial-rotary target's narrow table",
    ),
    Mutation(
        "targets/mtp-dense-block",
        "specdraft/drafts/mtp/layer.py",
        "layer_config.first_k_dense_replace = 0",
        "pass",
        ("tests/test_mtp_layouts.py",),
        "DeepSeek-V3's MTP block built with a dense MLP (its index 0 is dense)",
    ),
    Mutation(
        "targets/moe-routed-activations-ignored",
        "specdraft/train/memory.py",
        "    return sparse if len(moe.sparse_layers) == text.num_hidden_layers else max(sparse, dense)",
        "    return dense",
        ("tests/test_memory.py::test_a_moe_targets_capture_holds_its_routed_activations_a_hand_count",),
        "the memory model counts a MoE layer as a dense one",
    ),
    Mutation(
        "targets/window-tile-ignored",
        "specdraft/train/memory.py",
        "        tiles.append(window * min(T, 2 * window - 1))",
        "        pass",
        ("tests/test_memory.py::test_a_windowed_layers_attention_is_bounded_by_its_window",),
        "the memory model forgets a windowed layer's attention tile",
    ),
]


# Crash-safe checkpoints (issue 55, item 7): the manifest, its verification, the commit, pruning
# and the resume's choice of slot; then what a resume loads back into the engine.
SLOTS_PY = "specdraft/checkpoint/slots.py"
DRAFT_PARTS_PY = "specdraft/checkpoint/draft_parts.py"
LAYOUT_PY = "specdraft/rundir/layout.py"
CKPT_TESTS = "tests/test_checkpoint.py"
RESUME_TESTS = "tests/test_resume.py"
SLOTS_UNIT = "tests/test_slots.py"
RESUME_EXACT = f"{CKPT_TESTS}::test_a_resume_brings_back_the_weights_the_optimizer_and_the_schedule"
SLOT_FILES: List[Mutation] = [
    Mutation(
        "slots/manifest-lists-deepspeeds-files-only",
        SLOTS_PY,
        "        if name not in files:\n            fsync_file(path)\n            files[name] = file_entry(path)",
        "        if name not in files:\n            pass",
        (f"{RESUME_TESTS}::test_auto_resume_moves_a_trapped_slot_aside_and_resumes_the_one_before",),
        "the frozen state and zero_to_fp32.py are committed unhashed (and every resume refuses them)",
    ),
    Mutation(
        "slots/commit-before-the-files-are-durable",
        SLOTS_PY,
        "            fsync_file(path)\n            written[str(Path(path).relative_to(slot_dir))]",
        "            written[str(Path(path).relative_to(slot_dir))]",
        ("tests/test_distributed.py::test_every_rank_fsyncs_its_own_files_before_the_commit",),
        "a rank's checkpoint file is committed before it is fsynced (a power loss keeps a committed, empty file)",
    ),
    Mutation(
        "slots/commit-marker-before-the-directory-sync",
        SLOTS_PY,
        "    fsync_dir(slot_dir)\n    pause()\n    write_atomic(slot_dir / COMMITTED",
        "    pause()\n    write_atomic(slot_dir / COMMITTED",
        (f"{SLOTS_UNIT}::test_commit_syncs_the_slot_before_its_marker_and_the_marker_before_latest",),
        "COMMITTED is written before the slot's directory entries are durable",
    ),
    Mutation(
        "slots/verify-skips-the-sha256",
        SLOTS_PY,
        'if file_sha256(path) != entry["sha256"]:',
        "if False:",
        (f"{CKPT_TESTS}::test_manifest_mismatch_is_refused",),
        "a file modified at its size resumes",
    ),
    Mutation(
        "slots/verify-skips-the-size",
        SLOTS_PY,
        'if path.stat().st_size != entry["bytes"]:',
        "if False:",
        (f"{CKPT_TESTS}::test_truncated_optimizer_file_is_refused_before_unpickling",),
        "a truncated file is hashed whole before it is refused, and reported as modified",
    ),
    Mutation(
        "slots/verify-skips-the-pickle-check",
        SLOTS_PY,
        "            safe_load.check(path)",
        "            pass",
        (f"{RESUME_TESTS}::test_a_booby_trapped_optimizer_state_is_refused_without_running_it",),
        "a pickle with a valid manifest is unpickled without checking what it calls",
    ),
    Mutation(
        "slots/verify-accepts-files-outside-the-manifest",
        SLOTS_PY,
        "for name in sorted(present - set(expected)):",
        "for name in sorted(present - present):",
        (f"{SLOTS_UNIT}::test_verification_refuses_a_file_no_commit_listed",),
        "a file planted in a slot is loaded (the consolidation reads the whole slot) though no commit listed it",
    ),
    Mutation(
        "slots/verify-missing-file-is-not-a-refusal",
        SLOTS_PY,
        "        if not path.is_file():\n            raise",
        "        if False:\n            raise",
        (f"{SLOTS_UNIT}::test_verification_refuses_a_listed_file_that_is_gone_in_one_line",),
        "a listed file that is gone fails with a traceback (FileNotFoundError), and resume=auto stops there",
    ),
    Mutation(
        "slots/prune-keeps-the-oldest",
        SLOTS_PY,
        "keep = committed_slots(ckpt_dir)[-keep_last:]",
        "keep = committed_slots(ckpt_dir)[:keep_last]",
        (f"{CKPT_TESTS}::test_keep_last_prunes_old_slots",),
        "pruning keeps the oldest slots (and so deletes nothing, or the newest)",
    ),
    Mutation(
        "slots/prune-keeps-one-too-many",
        SLOTS_PY,
        "keep = committed_slots(ckpt_dir)[-keep_last:]",
        "keep = committed_slots(ckpt_dir)[-keep_last - 1 :]",
        (f"{CKPT_TESTS}::test_keep_last_prunes_old_slots",),
    ),
    Mutation(
        "slots/remove-deletes-while-committed",
        SLOTS_PY,
        "    if marker.exists():\n        marker.unlink()\n        fsync_dir(path)\n    shutil.rmtree(path)",
        "    shutil.rmtree(path)",
        (f"{CKPT_TESTS}::test_a_committed_slot_is_uncommitted_before_it_is_deleted",),
        "a slot is deleted with its COMMITTED in place: a crash midway leaves a committed half-slot",
    ),
    Mutation(
        "slots/newest-slot-by-name",
        LAYOUT_PY,
        "(p / COMMITTED).is_file()),\n        key=slot_step,",
        "(p / COMMITTED).is_file()),\n        key=lambda p: p.name,",
        (f"{CKPT_TESTS}::test_resume_auto_continues_an_interrupted_run",),
        "step_10 sorts before step_9: the newest slot is the wrong one",
    ),
    Mutation(
        "slots/auto-resume-takes-the-oldest",
        CHECKPOINT_PY,
        "[[str(p) for p in reversed(slots.committed_slots(self.ckpt_dir))]]",
        "[[str(p) for p in slots.committed_slots(self.ckpt_dir)]]",
        (f"{RESUME_TESTS}::test_auto_resume_moves_a_trapped_slot_aside_and_resumes_the_one_before",),
        "resume=auto continues from the oldest committed slot",
    ),
    Mutation(
        "slots/auto-resume-stops-at-a-damaged-slot",
        CHECKPOINT_PY,
        "                if not auto:\n                    raise",
        "                if True:\n                    raise",
        (f"{RESUME_TESTS}::test_auto_resume_moves_a_trapped_slot_aside_and_resumes_the_one_before",),
        "resume=auto refuses to start where the slot before the damaged one would do",
    ),
    Mutation(
        "slots/a-rank-verifies-only-the-frozen-state",
        CHECKPOINT_PY,
        "        return files_rank_loads(record, self.rank)",
        "        return frozen_files(record)",
        (f"{CKPT_TESTS}::test_manifest_mismatch_is_refused",),
        "the DeepSpeed files a rank loads are not checked against the manifest",
    ),
    Mutation(
        "slots/resume-skips-the-compatibility-check",
        CHECKPOINT_PY,
        "            check_compatible(slot, record, self.cfg, self.target_identity)",
        "            pass",
        ("tests/test_user_files.py::test_a_resume_refused_for_a_changed_config_names_each_key_and_both_values",),
        "a slot resumes under another draft config, target, precision or seed",
    ),
    Mutation(
        "slots/rollback-keeps-the-later-slots",
        SLOTS_PY,
        "for later in (p for p in committed_slots(ckpt) if slot_step(p) > step):",
        "for later in (p for p in committed_slots(ckpt) if False):",
        ("tests/test_user_files.py::test_a_rollback_to_an_older_slot_sets_the_later_ones_aside_and_continues_exactly",),
        "after a rollback resume=auto continues the abandoned trajectory (and the new saves collide with it)",
    ),
]

# What a resume loads into the engine: DeepSpeed's load_checkpoint with each part turned off.
# custom_load_fn is what DeepSpeed calls instead of module.load_state_dict: a no-op leaves the
# fresh build's weights (at ZeRO-0; ZeRO 1-3 restore the module from the optimizer's fp32 copy).
RESUME_LOADS = (
    f"{RESUME_TESTS}::test_sigterm_stops_at_a_step_boundary_commits_it_and_the_resume_continues_exactly",
    RESUME_EXACT,
    "tests/test_target_matrix.py",
    "tests/test_multinode.py",
    "tests/test_sequence_parallel.py",
    "tests/test_several_drafts.py",
)
LOADING: List[Mutation] = [
    Mutation(
        "loading/resume-without-the-weights",
        DRAFT_PARTS_PY,
        "        load_module_strict=False,\n",
        "        load_module_strict=False,\n        custom_load_fn=lambda src, dst: None,\n",
        (f"{RESUME_TESTS}::test_a_slot_resumes_at_another_thread_count_zero_stage_and_world_size",) + RESUME_LOADS[1:],
        "a resume keeps the fresh draft's weights (refused by the fingerprint check)",
    ),
    Mutation(
        "loading/resume-without-the-optimizer-state",
        DRAFT_PARTS_PY,
        "load_optimizer_states=True,",
        "load_optimizer_states=False,",
        RESUME_LOADS,
        "a resume restarts Adam's moments and step count",
    ),
    Mutation(
        "loading/resume-without-the-scheduler-state",
        DRAFT_PARTS_PY,
        "load_lr_scheduler_states=True,",
        "load_lr_scheduler_states=False,",
        RESUME_LOADS,
        "a resume restarts the learning-rate schedule at its warmup",
    ),
]

# Where a command may write (specdraft/rundir/): ownership markers, refusals, atomic writes.
OWNERSHIP_PY = "specdraft/rundir/ownership.py"
ATOMIC_PY = "specdraft/rundir/atomic.py"
USER_FILES = "tests/test_user_files.py"
RUNDIR_UNIT = "tests/test_rundir.py"
RUNDIR: List[Mutation] = [
    Mutation(
        "rundir/a-users-folder-taken-as-output-dir",
        OWNERSHIP_PY,
        "        if not is_run_dir(run_dir):\n",
        "        if False:\n",
        (f"{USER_FILES}::test_train_refuses_a_users_folder_before_loading_anything",),
        "`train` writes into a non-empty folder that is not a run",
    ),
    Mutation(
        "rundir/a-users-marker-taken-for-ours",
        LAYOUT_PY,
        '        or "specdraft_version" not in marker\n',
        "",
        (f"{USER_FILES}::test_a_users_specdraft_jsonl_or_own_specdraft_json_is_never_taken_for_our_marker",),
        "a user's own specdraft.json with a kind field makes their folder ours",
    ),
    Mutation(
        "rundir/any-marker-is-an-export",
        LAYOUT_PY,
        "return Path(path).is_dir() and marker_kind(path) == EXPORT",
        "return Path(path).is_dir() and marker_kind(path) is not None",
        (f"{RUNDIR_UNIT}::test_export_out_is_never_a_folder_of_our_other_kinds",),
        "`export --out` replaces a regenerate output (or any folder with our marker)",
    ),
    Mutation(
        "rundir/export-into-a-run",
        OWNERSHIP_PY,
        "if run is not None and out.resolve() != Path(default).resolve():",
        "if False:",
        (f"{USER_FILES}::test_export_refuses_a_users_folder_a_file_and_any_run",),
        "`export --out` replaces a run or a folder inside one",
    ),
    Mutation(
        "rundir/resume-no-mixes-into-committed-slots",
        OWNERSHIP_PY,
        'if slots and resume == "no":',
        "if False:",
        (f"{USER_FILES}::test_resume_no_into_committed_checkpoints_is_refused_naming_the_newest",),
        "resume=no starts a new run in a folder of committed slots",
    ),
    Mutation(
        "rundir/a-run-inside-a-run",
        OWNERSHIP_PY,
        "outer = enclosing_run(run_dir.resolve().parent)",
        "outer = None",
        (f"{USER_FILES}::test_output_dir_dot_inside_a_run_is_that_run_and_a_link_into_another_run_is_refused",),
        "output_dir inside another run is taken",
    ),
    Mutation(
        "rundir/a-users-folder-taken-by-regenerate",
        OWNERSHIP_PY,
        "if _non_empty(out) and not is_regenerate_dir(out):",
        "if False:",
        (f"{USER_FILES}::test_regenerate_refuses_a_users_folder_and_a_file",),
        "`regenerate --out` writes into a user's folder",
    ),
    Mutation(
        "rundir/a-users-png-replaced-by-a-plot",
        OWNERSHIP_PY,
        "if path.exists() and not is_our_plot(path):",
        "if False:",
        (f"{USER_FILES}::test_eval_plot_refuses_a_users_file_and_a_directory",),
        "`eval --plot` overwrites a file it did not write",
    ),
    Mutation(
        "rundir/any-hidden-tmp-is-ours",
        ATOMIC_PY,
        "    return name.startswith(prefix) and name.endswith(TEMP_SUFFIX) and len(name) == len(prefix) + 8 + len(TEMP_SUFFIX)",
        "    return name.startswith(prefix) and name.endswith(TEMP_SUFFIX)",
        (f"{USER_FILES}::test_a_restarted_run_clears_the_half_written_export_a_crash_left_and_nothing_else",),
        "a restarted run deletes a user's `.step_2.notes.tmp` as a crashed export",
    ),
    Mutation(
        "rundir/write-in-place",
        ATOMIC_PY,
        "        os.replace(tmp, path)\n",
        "        shutil.copyfile(tmp, path)\n        tmp.unlink()\n",
        (f"{RUNDIR_UNIT}::test_write_atomic_replaces_the_file_and_never_writes_into_the_old_one",),
        "write_atomic rewrites the file in place: a crash midway leaves it half-written",
    ),
    Mutation(
        "rundir/rename-before-fsync",
        ATOMIC_PY,
        "        fsync_file(tmp)\n        os.replace(tmp, path)",
        "        os.replace(tmp, path)",
        (f"{RUNDIR_UNIT}::test_write_atomic_makes_the_data_durable_before_the_rename_and_the_rename_after",),
        "the rename lands before the data: a power loss leaves an empty file under the final name",
    ),
    Mutation(
        "rundir/rename-not-made-durable",
        ATOMIC_PY,
        "        raise\n    fsync_dir(path.parent)",
        "        raise",
        (f"{RUNDIR_UNIT}::test_write_atomic_makes_the_data_durable_before_the_rename_and_the_rename_after",),
        "the rename is not fsynced into its directory: a power loss brings the old file back",
    ),
    Mutation(
        "rundir/publish-deletes-the-old-first",
        ATOMIC_PY,
        "        old = fresh_name(final_dir, ASIDE_SUFFIX)\n        os.replace(final_dir, old)",
        "        shutil.rmtree(final_dir)",
        (f"{RUNDIR_UNIT}::test_a_publish_that_fails_at_the_rename_keeps_the_old_export",),
        "an export is deleted before its replacement is in place: a failure between leaves neither",
    ),
    Mutation(
        "rundir/publish-unsynced-files",
        ATOMIC_PY,
        "    fsync_tree(tmp_dir)\n",
        "",
        (f"{RUNDIR_UNIT}::test_publish_dir_syncs_every_file_before_the_rename_and_deletes_the_old_one_last",),
        "an export directory is renamed into place before its files are durable",
    ),
]

# The sampler's position: a resume continues at the next unseen sequence.
SAMPLER_PY = "specdraft/data/sampler.py"
SAMPLER_TESTS = "tests/test_data.py"
SAMPLER_RESUME = f"{SAMPLER_TESTS}::test_sampler_shards_are_disjoint_and_resume_exactly"
SAMPLER: List[Mutation] = [
    Mutation(
        "sampler/resume-one-batch-late",
        SAMPLER_PY,
        '        self.position = state["position"]',
        '        self.position = state["position"] + self.global_batch',
        (SAMPLER_RESUME,),
        "a resume skips a global batch",
    ),
    Mutation(
        "sampler/resume-one-batch-early",
        SAMPLER_PY,
        '            "position": self.position,',
        '            "position": max(0, self.position - self.global_batch),',
        (SAMPLER_RESUME,),
        "a resume repeats the last global batch",
    ),
    Mutation(
        "sampler/resume-in-epoch-zero",
        SAMPLER_PY,
        '        self.epoch = state["epoch"]',
        "        self.epoch = 0",
        (f"{SAMPLER_TESTS}::test_a_resume_in_a_later_epoch_continues_that_epochs_order",),
        "a resume after the first epoch replays the first epoch's order",
    ),
    Mutation(
        "sampler/ranks-share-a-micro-batch",
        SAMPLER_PY,
        "start = self.position + self.rank * self.batch_size",
        "start = self.position",
        (SAMPLER_RESUME,),
        "every rank trains on the same sequences",
    ),
    Mutation(
        "sampler/one-order-for-every-epoch",
        SAMPLER_PY,
        "np.random.default_rng([self.seed, self.epoch])",
        "np.random.default_rng([self.seed, 0])",
        (f"{SAMPLER_TESTS}::test_a_resume_in_a_later_epoch_continues_that_epochs_order",),
        "every epoch repeats the first one's order",
    ),
]

# The target's own attention in the capture (target/capture.py's tiles, drafts/documents.py's
# flex path and the per-document split): sliding windows, attention sinks, soft-capping, MLA.
ARCH_TESTS = "tests/test_capture_architectures.py"
CORE = f"{ARCH_TESTS}::test_the_core_applies_window_sinks_and_softcap_inside_documents"
CAPTURED = f"{ARCH_TESTS}::test_the_capture_equals_transformers_on_packed_documents"
TARGET_ATTENTION: List[Mutation] = [
    Mutation(
        "target-attention/tile-window-plus-1",
        ATTENTION_PY,
        "visible = visible & (t - s < window)",
        "visible = visible & (t - s <= window)",
        (f"{CORE}[24-None-None-slices]", CORE),
        "CPU: a windowed layer's query sees one key beyond its window",
    ),
    Mutation(
        "target-attention/tile-misses-its-oldest-key",
        ATTENTION_PY,
        "first = 0 if window is None else max(0, start - window + 1)",
        "first = 0 if window is None else max(0, start - window + 2)",
        (f"{CORE}[24-None-None-slices]", CORE),
        "CPU: the first query of each tile loses the oldest key of its window",
    ),
    Mutation(
        "target-attention/tile-sinks-dropped",
        ATTENTION_PY,
        "        if sink is not None:\n            logits",
        "        if False:\n            logits",
        (f"{CORE}[None-True-None-slices]", CORE),
        "CPU: gpt-oss's sinks leave the softmax's denominator",
    ),
    Mutation(
        "target-attention/tile-softcap-skipped",
        ATTENTION_PY,
        "            scores = torch.tanh(scores / softcap) * softcap",
        "            scores = scores",
        (f"{CORE}[24-True-3.0-slices]", CORE),
        "CPU: the layer's logit soft-cap is not applied",
    ),
    Mutation(
        "target-attention/tile-softcap-applied-twice",
        ATTENTION_PY,
        "            scores = torch.tanh(scores / softcap) * softcap",
        "            scores = torch.tanh(torch.tanh(scores / softcap)) * softcap",
        (f"{CORE}[24-True-3.0-slices]", CORE),
        "CPU: the soft-cap is applied to already capped scores",
    ),
    Mutation(
        "target-attention/window-not-handed-to-the-core",
        CAPTURE_PY,
        '("window", sliding_window)',
        '("window", None)',
        (f"{CAPTURED}[qwen2-slices]", CAPTURED),
        "the capture ignores each layer's sliding window",
    ),
    Mutation(
        "target-attention/sinks-not-handed-to-the-core",
        CAPTURE_PY,
        "    sinks = s_aux\n",
        "    sinks = None\n",
        (f"{CAPTURED}[gpt_oss-slices]", CAPTURED),
        "the capture drops gpt-oss's attention sinks",
    ),
    Mutation(
        "target-attention/softcap-not-handed-to-the-core",
        CAPTURE_PY,
        '("softcap", softcap)',
        '("softcap", None)',
        (f"{CAPTURED}[gemma2-slices]", CAPTURED),
        "the capture drops Gemma 2's soft-cap",
    ),
    Mutation(
        "target-attention/layer-scaling-ignored",
        CAPTURE_PY,
        "out = shard.attention(specdraft_core, query, key, value, scaling, **extras)",
        "out = shard.attention(specdraft_core, query, key, value, None, **extras)",
        (f"{CAPTURED}[gemma3_text-slices]", CAPTURED),
        "Gemma's query_pre_attn_scalar (and DeepSeek's mscale) replaced by head_dim ** -0.5",
    ),
    Mutation(
        "target-attention/sp-rank-takes-the-first-heads-sinks",
        CAPTURE_PY,
        "sinks = sinks.view(shard.size, -1)[shard.rank]",
        "sinks = sinks.view(shard.size, -1)[0]",
        (f"{ARCH_TESTS}::test_sequence_parallel_ranks_capture_their_shard_of_the_same_features[gpt_oss]",),
        "under SP every rank attends with the sinks of rank 0's heads",
    ),
    Mutation(
        "target-attention/flex-window-plus-1",
        ATTENTION_PY,
        "(q - kv < window) & (documents[b, q] == documents[b, kv])",
        "(q - kv <= window) & (documents[b, q] == documents[b, kv])",
        (f"{CORE}[24-None-None-flex]", CORE),
        "CUDA: a packed query of a windowed layer sees one key beyond its window",
    ),
    Mutation(
        "target-attention/flex-window-ignores-documents",
        ATTENTION_PY,
        "(q - kv < window) & (documents[b, q] == documents[b, kv])",
        "(q - kv < window)",
        (f"{CORE}[24-None-None-flex]", CORE),
        "CUDA: a windowed layer attends across the border into the previous conversation",
    ),
    Mutation(
        "target-attention/flex-one-row-window-plus-1",
        ATTENTION_PY,
        "                return (q >= kv) & (q - kv < window)\n",
        "                return (q >= kv) & (q - kv <= window)\n",
        (f"{CORE}[24-None-None-flex]", CORE),
        "CUDA, one conversation per row: a query sees one key beyond its window",
    ),
    Mutation(
        "target-attention/flex-sinks-dropped",
        ATTENTION_PY,
        "        if sinks is None:\n            return flex_attention(",
        "        if True:\n            return flex_attention(",
        (f"{CORE}[None-True-None-flex]", CORE),
        "CUDA: gpt-oss's sinks leave the softmax's denominator",
    ),
    Mutation(
        "target-attention/flex-sinks-sign",
        ATTENTION_PY,
        "torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])",
        "torch.sigmoid(sinks.to(lse.dtype)[None, :, None] - lse)",
        (f"{CORE}[None-True-None-flex]", CORE),
        "CUDA: the sink's share of the softmax is taken for the keys'",
    ),
    Mutation(
        "target-attention/flex-softcap-skipped",
        ATTENTION_PY,
        "            return torch.tanh(score / softcap) * softcap",
        "            return score",
        (f"{CORE}[24-True-3.0-flex]", CORE),
        "CUDA: the layer's logit soft-cap is not applied",
    ),
    Mutation(
        "target-attention/slices-window-dropped",
        ATTENTION_PY,
        "        return tiled_attention(q, k, v, scale, window, sinks, softcap, ids)",
        "        return tiled_attention(q, k, v, scale, None, sinks, softcap, ids)",
        (f"{CORE}[24-None-None-slices]", CORE),
        "CPU: packed documents are attended without the layer's window",
    ),
    Mutation(
        "target-attention/dense-ignores-documents",
        ATTENTION_PY,
        "    return attend(q, k, v, documents.ids)",
        "    return attend(q, k, v)",
        (f"{CORE}[None-True-None-dense]", CORE),
        "other devices: a windowed layer attends across conversations",
    ),
    # MLA (DeepSeek-V3): keys of qk_nope + qk_rope dims, RoPE on the last qk_rope, values of v_head_dim
    Mutation(
        "target-attention/mla-values-as-wide-as-the-keys",
        ATTENTION_PY,
        "v[:, :, None, first:end]).reshape(B, H, end - start, -1)",
        "v[:, :, None, first:end]).reshape(B, H, end - start, D)",
        (f"{CORE}[None-True-None-slices]", CORE),
        "the tiles take MLA's values (v_head_dim) to be as wide as its keys (qk_nope + qk_rope)",
    ),
    Mutation(
        "target-attention/mla-rope-table-over-the-whole-head",
        CAPTURE_PY,
        'if config.model_type == "gpt_oss":',
        'if config.model_type in ("gpt_oss", "deepseek_v3"):',
        (f"{ARCH_TESTS}::test_the_rotary_tables_are_the_ones_the_last_layer_applies",),
        "MLA's decoupled RoPE table (qk_rope dims) is stretched over the no-RoPE dims too",
    ),
]


# DFlash2 (specdraft/drafts/dflash2/): its convolutions, its selector and the selector's training
DFLASH2_CONV_PY = "specdraft/drafts/dflash2/conv.py"
DFLASH2_SELECTOR_PY = "specdraft/drafts/dflash2/selector.py"
DFLASH2_TRAIN_PY = "specdraft/drafts/dflash2/train.py"
DFLASH2_DECODE_PY = "specdraft/drafts/dflash2/decode.py"
DFLASH2_BLOCKS = "tests/test_dflash2_blocks.py"
DFLASH2_EXPORT = "tests/test_dflash2_export.py"
DFLASH2: List[Mutation] = [
    Mutation(
        "dflash2/tap-crosses-the-block-border",
        DFLASH2_CONV_PY,
        "valid = (slot >= tap).to(x.dtype)",
        "valid = (slot >= 0).to(x.dtype)",
        (DFLASH2_BLOCKS, DFLASH2_EXPORT),
        "a slot's convolution reads the block before it (servers zero those taps)",
    ),
    Mutation(
        "dflash2/output-side-kernel-is-the-input-sides",
        DFLASH2_CONV_PY,
        "return convolved, kernels[..., 1, :, :]",
        "return convolved, kernels[..., 0, :, :]",
        (DFLASH2_EXPORT, DFLASH2_BLOCKS),
        "the sublayer's output is convolved with the input side's dynamic kernel",
    ),
    Mutation(
        "dflash2/label-injected-first",
        DFLASH2_SELECTOR_PY,
        "trained[..., -1] = torch.where(contains, trained[..., -1], target_ids)",
        "trained[..., 0] = torch.where(contains, trained[..., 0], target_ids)",
        (DFLASH2_BLOCKS,),
        "a label outside the top-K replaces the best candidate instead of the weakest",
    ),
    Mutation(
        "dflash2/path-ignores-its-own-picks",
        DFLASH2_DECODE_PY,
        "            previous = torch.tensor([token], device=self.device)\n",
        "",
        ("tests/test_dflash2_train.py::test_the_greedy_chain_is_the_selectors_path_from_the_anchor",),
        "every slot of a chain is scored with the anchor as its predecessor",
    ),
    Mutation(
        "dflash2/selector-loss-unweighted",
        DFLASH2_TRAIN_PY,
        "return self.dims.selector_loss_alpha * ce, metrics",
        "return ce, metrics",
        ("tests/test_dflash2_train.py",),
        "draft.selector_loss_alpha changes nothing",
    ),
]


MUTATIONS: Dict[str, List[Mutation]] = {
    "data-spans": DATA_SPANS,
    "glide": GLIDE,
    "glide-drafter": GLIDE_DRAFTER,
    "decoding": DECODING,
    "eagle3": EAGLE3,
    "dflash": DFLASH,
    "dspark": DSPARK,
    "dflash2": DFLASH2,
    "mtp": MTP,
    "peagle": PEAGLE,
    "distill": DISTILL_TOKENS,
    "conventions": CONVENTIONS,
    "checkpoint": CHECKPOINT,
    "memory": MEMORY,
    "imports": IMPORTS,
    "documents": DOCUMENTS,
    "losses": LOSS_FORMULAS,
    "teacher": TEACHER,
    "targets": TARGETS,
    "slots": SLOT_FILES,
    "loading": LOADING,
    "rundir": RUNDIR,
    "sampler": SAMPLER,
    "target-attention": TARGET_ATTENTION,
}


def all_mutations() -> List[Mutation]:
    return [m for group in MUTATIONS.values() for m in group]
