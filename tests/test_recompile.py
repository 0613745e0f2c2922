"""The GPU path compiles once (issue 43): after the first batch, no recompilation, never eager flex.

The CUDA path ("flex": compiled create_block_mask and flex_attention, target/attention.py) runs
here on the CPU under documents.forced_attention_path, every family through TargetWithDraft over
batches of one max_seq_length whose packed-document layouts, lags and anchors differ. Compiled with
AOTAutograd, as inductor compiles, and compilers that record each forward and backward graph and
run it as traced (inductor has no flex backward, no log-sum-exp and a ~30 s compile on this CPU):
guards, recompiles and automatic dynamic shapes are dynamo's, whatever the backend. Each family
runs twice: forwards under no_grad (evaluation), and forward + backward with grad on (training:
torch refuses flex_attention's backward on the CPU, a refusal the fixture lifts; traced, the
backward runs flex's math reference). Asserted each batch: the eager flex_attention /
create_block_mask (a (T, T) scores or mask tensor) never run, a compiled flex_attention does (and
its backward, training), and after the warm-up batch dynamo compiles nothing (error_on_recompile
raises with the failing guard) and no new forward or backward graph appears; at the end, every
graph has static shapes. Each check has a test that breaks what it guards and sees it fail.

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
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

from helpers import random_target_for
from specdraft.config import DraftConfig
from specdraft.target import attention as documents
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
# P-EAGLE under SP: its slots attend the gathered keys through a dense mask (GatheredCODSlots),
# so its training backward runs no flex_attention (the target's flex runs under no_grad)
DENSE_DRAFT_ATTENTION = {("peagle", 2)}
CASES = [(family, sp) for family in sorted(FAMILIES) for sp in (1, 2) if sp == 1 or FAMILIES[family].sequence_parallel]


class Graphs:
    """torch.compile's backend: AOTAutograd with compilers that record each forward and backward
    graph and run it as traced; counts the runs of graphs that call flex_attention."""

    def __init__(self):
        self.graphs, self.backward_graphs, self.flex_runs, self.flex_backward_runs = [], [], 0, 0
        self._aot = aot_autograd(fw_compiler=boxed_nop, bw_compiler=self._recorded_backward)

    def _recorded_backward(self, gm, example_inputs):
        self.backward_graphs.append(gm)  # compiled at a graph's first backward
        compiled = boxed_nop(gm, example_inputs)
        if not calls_flex(gm):
            return compiled

        def run(args):  # AOTAutograd's boxed convention: one list of arguments
            self.flex_backward_runs += 1
            return compiled(args)

        run._boxed_call = True
        return run

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        compiled = self._aot(gm, example_inputs)
        if not calls_flex(gm):
            return compiled

        def run(*args):
            self.flex_runs += 1
            return compiled(*args)

        return run


def calls_flex(gm) -> bool:
    """Whether a graph calls flex_attention (forward graphs) or its backward (backward graphs)."""
    return any("flex_attention" in str(node.target) for node in gm.graph.nodes)


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
        patch.setattr(flex_module, "_validate_device", with_cpu_backward(flex_module._validate_device))
        saved = dict(documents._compiled_functions)
        documents._compiled_functions.clear()
        torch._dynamo.reset()
        try:
            yield backend, eager
        finally:
            documents._compiled_functions.clear()
            documents._compiled_functions.update(saved)
            torch._dynamo.reset()


def with_cpu_backward(validate_device):
    """flex_attention's device check without its refusal of a CPU backward (torch 2.13 has no CPU
    kernel for it): traced, the backward runs flex's math reference, so a training call compiles."""

    def validate(query, key, value):
        return validate_device(query.detach(), key.detach(), value.detach())

    return validate


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


def compiles_once(family, sp, target, compiled, monkeypatch, training=False, between_batches=lambda i: None):
    """Runs BATCHES batches, forwards under no_grad or (training) forward + backward with grad on;
    returns the options each batch drew. Fails on an eager flex_attention / create_block_mask, a
    batch without a compiled flex_attention, any recompilation or new graph after the first batch,
    or a graph with symbolic shapes. between_batches(i): called after batch i (the checks' tests)."""
    backend, eager = compiled
    eager.update(dict.fromkeys(eager, 0))
    draft = build_draft(OmegaConf.structured(DraftConfig(type=family, **SMALL.get(family, {}))), target.config)
    parallel = one_rank_of_two(monkeypatch) if sp == 2 else SequenceParallel()
    model = TargetWithDraft(target, draft, sequence_parallel=parallel)
    drawn, first_graph = [], len(backend.graphs)
    with documents.forced_attention_path("flex", backend=backend), torch.set_grad_enabled(training):
        for i in range(BATCHES):
            ids, loss_mask, positions, document_ids = packed_batch(seed=10 * sp + i)
            options = draft.sample_batch_options(torch.Generator().manual_seed(i), T)
            drawn.append({k: v for k, v in options.items() if k != "position_ids"})
            graphs, backward_graphs = len(backend.graphs), len(backend.backward_graphs)
            flex_runs, flex_backward_runs = backend.flex_runs, backend.flex_backward_runs
            with torch._dynamo.config.patch(error_on_recompile=i > 0):  # raises with the failing guard
                out = model(
                    ids, loss_mask, positions, document_ids, host=HostBatch(ids, loss_mask, document_ids), **options
                )
                if training:
                    out.loss.backward()
            assert eager == {"flex_attention": 0, "create_block_mask": 0}, (
                f"batch {i}: the eager flex path ran: {eager}"
            )
            assert backend.flex_runs > flex_runs, f"batch {i}: no compiled flex_attention ran"
            if training:  # the draft's attention trains through the compiled flex backward
                expected = (family, sp) not in DENSE_DRAFT_ATTENTION
                ran = backend.flex_backward_runs > flex_backward_runs
                assert ran == expected, f"batch {i}: {'no' if expected else 'a'} compiled flex_attention backward ran"
            new = (len(backend.graphs) - graphs, len(backend.backward_graphs) - backward_graphs)
            assert i == 0 or new == (0, 0), f"batch {i}: new graphs, {new[0]} forward and {new[1]} backward"
            between_batches(i)
    dynamic = {i: symbolic_inputs(gm) for i, gm in enumerate(backend.graphs[first_graph:]) if symbolic_inputs(gm)}
    assert not dynamic, f"graphs with symbolic shapes (automatic dynamic after a recompile): {dynamic}"
    return drawn


@pytest.mark.parametrize("training", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("family, sp", CASES)
def test_the_gpu_path_compiles_in_the_first_batch_only(family, sp, training, targets, compiled, monkeypatch):
    """Evaluation's forwards and training's forward + backward: each compiles in its first batch."""
    target = targets["mtp" if family == "mtp" else "glide"]
    drawn = compiles_once(family, sp, target, compiled, monkeypatch, training)
    if family == "glide":  # the batches did differ in what a shape or a mask_mod constant could read
        assert len({d["lag"] for d in drawn}) >= 3
    if family in ("dflash", "dspark", "peagle"):
        assert len({tuple(d.items()) for d in drawn}) == BATCHES


GUARD_ON_DOCUMENTS_IN_BATCH = r'cell_contents == \d+ .*guard on "documents_in_batch"'  # dynamo's failing guard


def test_a_python_int_a_mask_mod_captures_fails_the_check(targets, compiled, monkeypatch):
    """The recompile check can fail: a mask_mod closing over the batch's document count (a Python
    int dynamo guards on) recompiles on the second batch."""

    def document_block_mask(ids, key_documents=None):
        documents_in_batch = int(ids.max()) + 1  # differs from batch to batch

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv]) & (kv < documents_in_batch * T)

        return documents.make_block_mask(same_document_causal, *ids.shape, T, ids.device)

    monkeypatch.setattr(documents, "document_block_mask", document_block_mask)
    with pytest.raises(torch._dynamo.exc.RecompileError, match=GUARD_ON_DOCUMENTS_IN_BATCH):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)


def test_a_recompile_in_training_only_fails_the_training_check(targets, compiled, monkeypatch):
    """The training check sees what the forwards cannot: the same int, captured only by a block
    mask built with grad on (the draft's own; the target builds its masks under no_grad)."""
    original = documents.document_block_mask

    def document_block_mask(ids, key_documents=None):
        if not torch.is_grad_enabled():
            return original(ids, key_documents)
        documents_in_batch = int(ids.max()) + 1

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv]) & (kv < documents_in_batch * T)

        return documents.make_block_mask(same_document_causal, *ids.shape, T, ids.device)

    monkeypatch.setattr(documents, "document_block_mask", document_block_mask)
    compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)  # forwards: nothing to see
    with pytest.raises(torch._dynamo.exc.RecompileError, match=GUARD_ON_DOCUMENTS_IN_BATCH):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch, training=True)


def uncompiled(name, monkeypatch):
    """documents._compiled hands back None (run eagerly) for the flex function `name`."""
    compiled_fn = documents._compiled
    monkeypatch.setattr(
        documents, "_compiled", lambda fn, device: None if fn.__name__ == name else compiled_fn(fn, device)
    )


def test_an_eager_flex_attention_fails_the_check(targets, compiled, monkeypatch):
    """The eager counter sees flex_attention called uncompiled (it materialises the scores)."""
    uncompiled("flex_attention", monkeypatch)
    ran = r"batch 0: the eager flex path ran: \{'flex_attention': [1-9]\d*, 'create_block_mask': 0\}"
    with pytest.raises(AssertionError, match=ran):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)


def test_an_eager_create_block_mask_fails_the_check(targets, compiled, monkeypatch):
    """The eager counter sees create_block_mask called uncompiled (a (B, 1, T, T) mask first)."""
    uncompiled("create_block_mask", monkeypatch)
    ran = r"batch 0: the eager flex path ran: \{'flex_attention': 0, 'create_block_mask': [1-9]\d*\}"
    with pytest.raises(AssertionError, match=ran):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)


def test_a_batch_off_the_flex_path_fails_the_check(targets, compiled, monkeypatch):
    """The compiled-run counter sees a batch that never reaches flex_attention (the CPU's own
    slices path in its place), which the eager counter cannot."""
    forced = documents.forced_attention_path
    monkeypatch.setattr(documents, "forced_attention_path", lambda path, **kwargs: forced("slices", **kwargs))
    with pytest.raises(AssertionError, match="batch 0: no compiled flex_attention ran"):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)


def test_a_flex_attention_outside_autograd_fails_the_training_check(targets, compiled, monkeypatch):
    """The backward counter sees a training batch whose flex_attention is left out of the
    backward (its inputs detached): the loss still trains the rest of the draft."""
    compiled_fn = documents._compiled

    def detached(flex):
        return lambda q, k, v, **kwargs: flex(q.detach(), k.detach(), v.detach(), **kwargs)

    def compiled_detached(fn, device):
        flex = compiled_fn(fn, device)
        return detached(flex) if fn.__name__ == "flex_attention" else flex

    monkeypatch.setattr(documents, "_compiled", compiled_detached)
    with pytest.raises(AssertionError, match="batch 0: no compiled flex_attention backward ran"):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch, training=True)


def flex_compiled_apart(*args, **kwargs):
    """flex_attention under a code object of its own: dynamo caches its compilations apart from
    the flex path's (a test that compiles it differently leaves the others' alone)."""
    from torch.nn.attention import flex_attention as flex_module

    return flex_module.flex_attention(*args, **kwargs)


def flex_compiled_apart_when(chosen, compiled, monkeypatch, **compile_options):
    """The flex_attention calls chosen(q, kwargs) picks go through flex_compiled_apart, compiled
    with the test backend and `compile_options`."""
    backend, _ = compiled
    apart = torch.compile(flex_compiled_apart, backend=backend, **compile_options)
    compiled_fn = documents._compiled

    def routed(fn, device):
        flex = compiled_fn(fn, device)
        if fn.__name__ != "flex_attention":
            return flex
        return lambda q, *args, **kwargs: (apart if chosen(q, kwargs) else flex)(q, *args, **kwargs)

    monkeypatch.setattr(documents, "_compiled", routed)


def test_a_graph_first_compiled_after_the_first_batch_fails_the_check(targets, compiled, monkeypatch):
    """The graph counts see a call site compiled for the first time after the warm-up batch, which
    no guard fails: from batch 1 on, the draft's flex_attention with a log-sum-exp (EAGLE-3's
    step-0 attention, grad on) goes through another function."""
    torch._dynamo.reset_code(flex_compiled_apart.__code__)
    done = []

    def from_batch_1(q, kwargs):
        return bool(done) and q.requires_grad and "return_aux" in kwargs

    flex_compiled_apart_when(from_batch_1, compiled, monkeypatch, dynamic=False)
    with pytest.raises(AssertionError, match=r"batch 1: new graphs, 1 forward and 1 backward"):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch, training=True, between_batches=done.append)


def test_graphs_with_symbolic_shapes_fail_the_check(targets, compiled, monkeypatch):
    """The symbolic-shape check sees flex_attention compiled with dynamic shapes."""
    torch._dynamo.reset_code(flex_compiled_apart.__code__)
    flex_compiled_apart_when(lambda q, kwargs: True, compiled, monkeypatch, dynamic=True)
    with pytest.raises(AssertionError, match=r"graphs with symbolic shapes .*\{\d+: \['"):
        compiles_once("eagle3", 1, targets["glide"], compiled, monkeypatch)
