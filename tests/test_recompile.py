"""The GPU path compiles once (issue 43): after the first batch, no recompilation, never eager flex.

The CUDA path ("flex": compiled create_block_mask and flex_attention, drafts/documents.py) runs
here on the CPU under documents.forced_attention_path, every family through TargetWithDraft over
batches of one max_seq_length whose packed-document layouts, lags and anchors differ. Compiled with
a backend that records dynamo's graphs and runs them as traced (inductor has no flex backward, no
log-sum-exp and a ~30 s compile on this CPU): guards, recompiles and automatic dynamic shapes are
dynamo's, whatever the backend. Forwards only (flex_attention has no backward on the CPU), under
no_grad. Asserted: after the warm-up batch dynamo compiles nothing (error_on_recompile raises with
the failing guard), every graph has static shapes, and the eager flex_attention / create_block_mask
(a (T, T) scores or mask tensor) never run.

SP = 2 runs one rank's shard in this process (rank 1 of 2, collectives faked to keep every shape
a real exchange gives): the target's heads exchange, GLIDE/EAGLE-3/P-EAGLE over the whole sequence
with half the heads, DFlash/DSpark on the blocks anchored in the rank's half. MTP does not train on
sequence shards (its targets' linear attention), so it runs at SP = 1 only.
"""

import functools
import types

import pytest
import torch
import torch._dynamo
from omegaconf import OmegaConf

from helpers import random_target_for
from specdraft.config import DraftConfig
from specdraft.drafts import documents
from specdraft.drafts.base import HostBatch
from specdraft.drafts.registry import FAMILIES, build_draft
from specdraft.parallel import sequence
from specdraft.parallel.sequence import SequenceParallel
from specdraft.train.model import TargetWithDraft

T, B, BATCHES, VOCAB = 256, 2, 5, 96  # T: two of flex's 128-token tiles
SMALL = {
    "glide": dict(anchor_offset=True, max_position_offset=100),
    "eagle3": dict(draft_vocab_size=64, ttt_steps=3),
    "dflash": dict(num_layers=1, block_size=4, max_anchors=16),
    "dspark": dict(num_layers=1, block_size=4, max_anchors=16, markov_rank=8, markov_head_type="rnn"),
    "peagle": dict(draft_vocab_size=64, num_depths=3, mask_token_id=1),
}
CASES = [(family, sp) for family in sorted(FAMILIES) for sp in (1, 2) if sp == 1 or FAMILIES[family].sequence_parallel]


class Graphs:
    """torch.compile's backend: records each graph dynamo hands over and runs it as traced."""

    def __init__(self):
        self.graphs, self.flex_runs = [], 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        if not any("flex_attention" in str(node.target) for node in gm.graph.nodes):
            return gm.forward

        def run(*args):
            self.flex_runs += 1
            return gm.forward(*args)

        return run


def symbolic_inputs(gm) -> list:
    """The placeholders of a graph with a symbolic size or stride (automatic dynamic shapes)."""

    def symbolic(value):
        if isinstance(value, torch.SymInt):
            return True
        sizes = (*value.shape, *value.stride()) if isinstance(value, torch.Tensor) else ()
        return any(isinstance(s, torch.SymInt) for s in sizes)

    return [node.name for node in gm.graph.find_nodes(op="placeholder") if symbolic(node.meta.get("example_value"))]


@pytest.fixture(scope="module")
def compiled():
    """One backend for the module, so every test shares the compiled functions (a call site that
    another family compiled is not compiled again), and the eager flex functions counted: the
    compiled ones trace through these wrappers (is_compiling: True), a fallback runs them."""
    from torch.nn.attention import flex_attention as flex_module

    backend, eager = Graphs(), {"flex_attention": 0, "create_block_mask": 0}
    flex, create_block_mask = flex_module.flex_attention, flex_module.create_block_mask

    # two functions, as in torch: dynamo keeps the compiled entries (and their limit) per code object
    @functools.wraps(flex)
    def counted_flex(*args, **kwargs):
        if not torch.compiler.is_compiling():
            eager["flex_attention"] += 1
        return flex(*args, **kwargs)

    @functools.wraps(create_block_mask)
    def counted_block_mask(*args, **kwargs):
        if not torch.compiler.is_compiling():
            eager["create_block_mask"] += 1
        return create_block_mask(*args, **kwargs)

    # never eager past the limit; torch's own limit, which the flex path raises
    with (
        pytest.MonkeyPatch.context() as patch,
        torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8),
    ):
        patch.setattr(flex_module, "flex_attention", counted_flex)
        patch.setattr(flex_module, "create_block_mask", counted_block_mask)
        saved = dict(documents._compiled_functions)
        documents._compiled_functions.clear()
        torch._dynamo.reset()
        try:
            yield backend, eager
        finally:
            documents._compiled_functions.clear()
            documents._compiled_functions.update(saved)
            torch._dynamo.reset()


@pytest.fixture(scope="module")
def targets():
    return {
        family: random_target_for(family, vocab=VOCAB, hidden=64, heads=4, kv_heads=2, max_positions=1024)
        for family in ("glide", "mtp")
    }  # a llama target, and MTP's qwen3_next


def packed_batch(seed: int):
    """(ids, loss mask, document positions, document ids) of B rows of T tokens, each row 1 to 7
    conversations with borders drawn from the seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) < 0.8).long()
    document_ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        count = int(torch.randint(1, 8, (1,), generator=g))
        borders = [0, *sorted(set(torch.randint(1, T, (count - 1,), generator=g).tolist())), T]
        for d, (start, end) in enumerate(zip(borders[:-1], borders[1:])):
            document_ids[b, start:end] = d
            positions[b, start:end] = torch.arange(end - start)
    return ids, loss_mask, positions, document_ids


def one_rank_of_two(patch):
    """SP = 2 as rank 1 sees it, in one process: each exchange returns what a real one of this
    rank's tensors would in shape (all_to_all: the same shape; all_gather: both ranks' parts)."""

    def all_gather(parts, x, group=None):
        for part in parts:
            part.copy_(x)

    patch.setattr(sequence, "_all_to_all", lambda x, group: x.clone())
    patch.setattr(sequence._AllGather, "apply", staticmethod(lambda x, group, rank, size: torch.stack([x] * size)))
    patch.setattr(sequence, "dist", types.SimpleNamespace(all_gather=all_gather, all_reduce=lambda x, group=None: x))
    return SequenceParallel(size=2, rank=1)


def compiles_once(family, sp, target, compiled, monkeypatch):
    """Runs BATCHES batches; returns the options each batch drew. Fails on any recompilation after
    the first batch, a graph with symbolic shapes, or an eager flex_attention / create_block_mask."""
    backend, eager = compiled
    eager.update(dict.fromkeys(eager, 0))
    draft = build_draft(OmegaConf.structured(DraftConfig(type=family, **SMALL.get(family, {}))), target.config)
    parallel = one_rank_of_two(monkeypatch) if sp == 2 else SequenceParallel()
    model = TargetWithDraft(target, draft, sequence_parallel=parallel)
    drawn, first_graph = [], len(backend.graphs)
    with documents.forced_attention_path("flex", backend=backend), torch.no_grad():
        for i in range(BATCHES):
            ids, loss_mask, positions, document_ids = packed_batch(seed=10 * sp + i)
            options = draft.sample_batch_options(torch.Generator().manual_seed(i), T)
            drawn.append({k: v for k, v in options.items() if k != "position_ids"})
            graphs, flex_runs = len(backend.graphs), backend.flex_runs
            with torch._dynamo.config.patch(error_on_recompile=i > 0):  # raises with the failing guard
                model(ids, loss_mask, positions, document_ids, host=HostBatch(ids, loss_mask, document_ids), **options)
            assert i == 0 or len(backend.graphs) == graphs, f"batch {i}: {len(backend.graphs) - graphs} new graphs"
            assert backend.flex_runs > flex_runs, f"batch {i}: no compiled flex_attention ran"
    assert eager == {"flex_attention": 0, "create_block_mask": 0}, f"the eager flex path ran: {eager}"
    dynamic = {i: symbolic_inputs(gm) for i, gm in enumerate(backend.graphs[first_graph:]) if symbolic_inputs(gm)}
    assert not dynamic, f"graphs with symbolic shapes (automatic dynamic after a recompile): {dynamic}"
    return drawn


@pytest.mark.parametrize("family, sp", CASES)
def test_the_gpu_path_compiles_in_the_first_batch_only(family, sp, targets, compiled, monkeypatch):
    target = targets["mtp" if family == "mtp" else "glide"]
    drawn = compiles_once(family, sp, target, compiled, monkeypatch)
    if family == "glide":  # the batches did differ in what a shape or a mask_mod constant could read
        assert len({d["lag"] for d in drawn}) >= 3
    if family in ("dflash", "dspark", "peagle"):
        assert len({tuple(d.items()) for d in drawn}) == BATCHES


def test_a_python_int_a_mask_mod_captures_fails_the_check(targets, compiled, monkeypatch):
    """The check can fail: a mask_mod closing over the batch's document count (a Python int dynamo
    guards on) recompiles on the second batch."""

    def document_block_mask(ids, key_documents=None):
        count = int(ids.max()) + 1  # differs from batch to batch

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv]) & (kv < count * T)

        return documents.make_block_mask(same_document_causal, *ids.shape, T, ids.device)

    monkeypatch.setattr(documents, "document_block_mask", document_block_mask)
    with pytest.raises(torch._dynamo.exc.RecompileError, match="cell_contents =="):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)


def test_an_eager_flex_attention_fails_the_check(targets, compiled, monkeypatch):
    """The check can fail: flex_attention called uncompiled (it materialises the scores)."""
    compiled_fn = documents._compiled
    monkeypatch.setattr(
        documents, "_compiled", lambda fn, device: None if fn.__name__ == "flex_attention" else compiled_fn(fn, device)
    )
    with pytest.raises(AssertionError, match="no compiled flex_attention ran|the eager flex path ran"):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)
