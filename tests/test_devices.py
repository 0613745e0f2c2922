"""Device discipline, proven without a GPU.

The meta device stands in for a second device: a non-scalar CPU tensor that meets a meta tensor
raises, so a tensor made without `device=` on the training or decoding path fails these tests.
Meta cannot catch 0-dim CPU tensors or count host syncs: those have targeted tests below, the
syncs counted on the CPU (HostSyncCounter: every way a device value reaches the host, direct or
through torch / DeepSpeed code) in the model, the loop's micro-steps, a real DeepSpeed engine's
step and the loss window's log.

Every family in the registry (specdraft.drafts.FAMILIES) runs through the harness.
"""

import collections
import contextlib
import json
import math
import re
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

import specdraft
from specdraft.config import DraftConfig
from specdraft.decode.drafters import ModelDrafter, PromptLookupDrafter
from specdraft.drafts.glide.decode import GlideDrafter
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.drafts import family_keys
from specdraft.drafts.base import HostBatch
from specdraft.drafts.registry import FAMILIES, build_draft
from specdraft.drafts.glide.model import GlideDraft
from specdraft.drafts.loss import chunked_cross_entropy
from specdraft.target.capture import CaptureRequest, capture
from specdraft.target.model import load_frozen_target
from specdraft.parallel import collectives
from specdraft.train.metrics import LossWindow
from specdraft.train.model import TargetWithDraft

META = torch.device("meta")
SPECDRAFT_DIR = str(Path(specdraft.__file__).resolve().parent)


# Sizes kept small for speed; a family not listed here runs at its defaults.
SMALL = {
    # anchor_offset on: its per-batch position ids are the one tensor option GLIDE draws on the CPU
    "glide": dict(anchor_offset=True, max_position_offset=100),
    "eagle3": dict(draft_vocab_size=64, ttt_steps=2),
    "dflash": dict(num_layers=1, block_size=4, max_anchors=4),
    "dspark": dict(num_layers=1, block_size=4, max_anchors=4, markov_rank=8, markov_head_type="rnn"),
    "dflash2": dict(num_layers=1, block_size=4, max_anchors=4, selector_rank=8, selector_top_k=4),
    "peagle": dict(draft_vocab_size=64, num_depths=3, mask_token_id=1),
}


def build_family(family, target_config, **keys):
    """A fresh draft of `family` for a target config (every registered family takes part)."""
    keys = {**SMALL.get(family, {}), **keys}
    return build_draft(OmegaConf.structured(DraftConfig(type=family, **keys)), target_config)


FAMILY_NAMES = sorted(FAMILIES)
# each family once more with a distillation objective (the teacher's final hidden state on the
# device too), on answer tokens and on every token (CE labels masked on the device); a family
# without draft.loss (MTP: speculators' CE only) at its own objective
OBJECTIVE_CASES = [
    (family, loss, tokens)
    for family in FAMILY_NAMES
    for loss, tokens in ((None, "answers"), ("0.5*tv + 0.5*ce", "answers"), ("0.5*tv + 0.5*ce", "all"))
    if loss is None or "loss" in family_keys(FAMILIES[family])
]


def prompt_then_answer(B: int, T: int, prompt: int = 6) -> torch.Tensor:
    """A host loss mask: `prompt` tokens that are not labels, then answer tokens."""
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :prompt] = 0
    return mask


@pytest.fixture(autouse=True)
def keep_transformers_masks(monkeypatch):
    """transformers asks on the host whether our all-ones padding mask may be skipped (a read it
    makes on a GPU too, not ours); meta cannot answer it, so the mask is kept: same attention."""
    from transformers import masking_utils
    from transformers.models.qwen3_next import modeling_qwen3_next

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    # qwen3_next asks the same of the padding mask of its linear-attention layers; ours is all ones,
    # which it answers with None
    monkeypatch.setattr(modeling_qwen3_next, "create_recurrent_attention_mask", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def cpu_target(tiny_target_dir):
    return load_frozen_target(str(tiny_target_dir))


@pytest.fixture(scope="module")
def meta_target(tiny_target_dir):
    return load_frozen_target(str(tiny_target_dir)).to(META)


@pytest.fixture(scope="module")
def meta_targets(meta_target, mtp_target_dir):
    """{model_type: target on meta}: the tiny Llama, and the tiny qwen3_next with an MTP layer for a
    family that drafts only for such targets."""
    return {"llama": meta_target, "qwen3_next": load_frozen_target(str(mtp_target_dir)).to(META)}


def target_for(family, meta_targets):
    types = FAMILIES[family].target_model_types
    return meta_targets["llama" if types is None or "llama" in types else "qwen3_next"]


@pytest.fixture(autouse=True)
def dense_experts(monkeypatch):
    """transformers' MoE experts (an MoE target's layers, and MTP's own layer, which is one of them)
    route tokens with data-dependent shapes (nonzero, a loop over the experts hit), which meta
    cannot size. Here every expert runs on every token, weighted by its routing weight (0 where
    not routed): the same sum, with every tensor still made on the device, so the family's code
    stays checked."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    def forward(self, hidden_states, top_k_index, top_k_weights):
        weights = torch.zeros(
            *hidden_states.shape[:-1], self.num_experts, dtype=top_k_weights.dtype, device=hidden_states.device
        ).scatter_add(-1, top_k_index, top_k_weights)
        gate, up = torch.einsum("th,eih->tei", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
        return (out * weights[..., None].to(out.dtype)).sum(dim=1)

    monkeypatch.setattr(modeling_qwen3_next.Qwen3NextExperts, "forward", forward)


def test_the_dense_experts_double_sums_what_transformers_experts_do(monkeypatch):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next

    dense = modeling_qwen3_next.Qwen3NextExperts.forward
    monkeypatch.undo()  # transformers' own forward back
    config = Qwen3NextConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(0)  # unseeded, one draw in five runs went past assert_close's float32 atol (1.1e-5)
    experts = modeling_qwen3_next.Qwen3NextExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(10, 16)
    index = torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(0))
    weights = torch.rand(10, 2)
    torch.testing.assert_close(dense(experts, x, index, weights), experts(x, index, weights))


@contextlib.contextmanager
def meta_nonzero():
    """Boolean-mask selection on meta (data-dependent size) as if every entry were True."""
    import torch.fx.experimental._config as fx_config

    saved = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = saved


@contextlib.contextmanager
def meta_host_reads(monkeypatch):
    """Decoding picks tokens on the host: a meta value read there answers 0 (True for a
    condition), so the loop's control flow runs while every tensor op stays on meta."""

    def patch(name, fake):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            return fake(self) if self.is_meta else original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    patch("item", lambda t: 0)
    patch("__bool__", lambda t: True)
    patch("__int__", lambda t: 0)
    patch("__float__", lambda t: 0.0)
    patch("tolist", lambda t: torch.zeros(t.shape, dtype=torch.long).tolist())
    with meta_nonzero():
        yield


# -- the harness: training, capture, decoding on meta ------------------------------------------


@pytest.mark.parametrize("family,loss,tokens", OBJECTIVE_CASES)
def test_training_loss_through_target_with_draft_runs_on_meta(family, loss, tokens, meta_targets):
    """No boolean-mask selection on the device either: meta cannot size a nonzero (it raises), so
    the counted rows must come from the host batch, as the training loop hands it over."""
    meta_target = target_for(family, meta_targets)
    draft = build_family(family, meta_target.config, loss=loss, distill_tokens=tokens).to(META)
    model = TargetWithDraft(meta_target, draft, loss_chunk_size=16)
    B, T = 2, 24
    input_ids = torch.zeros(B, T, dtype=torch.long, device=META)
    loss_mask = torch.ones(B, T, dtype=torch.long, device=META)
    host = HostBatch(torch.zeros(B, T, dtype=torch.long), prompt_then_answer(B, T))
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), T)  # drawn on the CPU
    out = model(input_ids, loss_mask, host=host, **options)  # a meta value read on the host raises
    out.loss.backward()
    assert out.loss.device == META and out.tokens.device == META and out.correct.device == META
    assert out.tokens.dim() == 0 and out.correct.dim() == 0 and out.tokens.dtype == torch.long
    assert all(num.device == META and den.device == META for num, den in out.metrics.values())
    assert all(p.grad is not None and p.grad.device == META for p in draft.parameters() if p.requires_grad)
    if loss is not None:
        assert {"objective/tv", "objective/ce"} <= set(out.metrics)


class PageableCopyCounter:
    """Counts host-to-device copies from pageable (unpinned) host memory made from specdraft's
    code: a tensor built from host data (a list, or an unpinned host tensor) straight onto a
    device, a host tensor's .to/.copy_ onto one, and a device tensor indexed (read or written)
    with host index tensors, which torch copies to the device first (meta lets that pass, CUDA
    does it silently). On CUDA each is synchronous: the host waits for the GPU. Pinning is
    simulated (a CPU-only torch cannot pin): pin_memory() marks a copy, is_pinned() reads the mark."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr("specdraft.transfer.can_pin", lambda: True)

        def pin_memory(tensor, *args, **kwargs):
            pinned = tensor.clone()
            pinned._test_pinned = True
            return pinned

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a, **k: getattr(t, "_test_pinned", False))
        for name in ("tensor", "as_tensor"):
            self._wrap_factory(monkeypatch, name)
        self._wrap_method(monkeypatch, "to", lambda t, *a, **k: torch._C._nn._parse_to(*a, **k)[0])
        self._wrap_method(monkeypatch, "copy_", lambda t, src, *a, **k: t.device, source=lambda t, src, *a, **k: src)
        for name in ("__getitem__", "__setitem__", "index_put_"):
            self._wrap_indexing(monkeypatch, name)

    def _record(self, what):
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(SPECDRAFT_DIR):
            self.calls.append(f"{what} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")

    def _wrap_factory(self, monkeypatch, name):
        original = getattr(torch, name)

        def factory(data, *args, **kwargs):
            device = kwargs.get("device")
            pageable = not isinstance(data, torch.Tensor) or (data.device.type == "cpu" and not data.is_pinned())
            if device is not None and torch.device(device).type != "cpu" and pageable:
                self._record(f"torch.{name}")
            return original(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, factory)

    def _wrap_method(self, monkeypatch, name, destination, source=lambda t, *a, **k: t):
        original = getattr(torch.Tensor, name)

        def method(tensor, *args, **kwargs):
            src, dst = source(tensor, *args, **kwargs), destination(tensor, *args, **kwargs)
            if (
                isinstance(src, torch.Tensor)
                and src.device.type == "cpu"
                and dst is not None
                and torch.device(dst).type != "cpu"
                and not src.is_pinned()
            ):
                self._record(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, method)

    def _wrap_indexing(self, monkeypatch, name):
        original = getattr(torch.Tensor, name)

        def host_indices(index):
            items = index if isinstance(index, (tuple, list)) else (index,)
            return any(
                isinstance(i, torch.Tensor) and i.device.type == "cpu" and i.dim() > 0 and not i.is_pinned()
                for i in items
            )

        def method(tensor, index, *args, **kwargs):
            if tensor.device.type != "cpu" and host_indices(index):
                self._record(f"Tensor.{name}")
            return original(tensor, index, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, method)


class MetaEngine:
    """What forward_step and forward_drafts ask of a DeepSpeed engine, for a module on meta."""

    device = META

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **inputs):
        return self.module(*args, **inputs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


@pytest.mark.parametrize("family,loss,tokens", OBJECTIVE_CASES)
def test_a_training_step_makes_no_pageable_host_to_device_copy(family, loss, tokens, meta_targets, monkeypatch):
    """The whole micro-batch as the loop runs it (batch copy, capture, loss), on a device: every
    host tensor it sends there is pinned and copied asynchronously."""
    meta_target = target_for(family, meta_targets)
    from specdraft.train.loop import forward_step

    draft = build_family(family, meta_target.config, loss=loss, distill_tokens=tokens).to(META)
    engine = MetaEngine(TargetWithDraft(meta_target, draft, loss_chunk_size=16))
    batch = packed_batch(24)
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), 24)
    counter = PageableCopyCounter(monkeypatch)
    out = forward_step(engine, batch, options)
    assert out.loss.device == META
    assert counter.calls == []


def packed_batch(T: int, seed: int = 0) -> dict:
    """Two rows of T tokens as the loop hands them over (model_inputs), the first with a border
    in its middle (the document path too), the second one conversation."""
    from specdraft.train.loop import model_inputs

    return model_inputs(packed_rows(T, seed), document_mask=True)


def packed_rows(T: int, seed: int = 0) -> dict:
    """packed_batch's rows as the data gives them (data.batch), before model_inputs."""
    half = T // 2
    documents = torch.tensor([[0] * half + [1] * (T - half), [0] * T])
    starts = torch.tensor([[0] * half + [half] * (T - half), [0] * T])
    return {
        "input_ids": torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(seed)),
        "loss_mask": prompt_then_answer(2, T),
        "document_ids": documents,
        "document_positions": torch.arange(T).expand(2, T) - starts,
    }


def test_the_pageable_copy_counter_sees_an_unpinned_copy(monkeypatch):
    counter = PageableCopyCounter(monkeypatch)
    host = torch.zeros(3)
    host.to(META)  # specdraft's frames only: made through a function defined in the package
    assert counter.calls == []
    from specdraft import transfer

    transfer.to_device(host, META)  # pinned first: not counted
    assert counter.calls == []
    monkeypatch.setattr("specdraft.transfer.can_pin", lambda: False)
    transfer.to_device(host, META)
    assert counter.calls == ["Tensor.to at transfer.py:27"]


def test_the_pageable_copy_counter_sees_host_indices_and_unpinned_host_tensors(monkeypatch):
    """Indexing a device tensor with a host index tensor copies the index to the device from
    pageable memory (CUDA does it silently), and so does torch.as_tensor of an unpinned host
    tensor; an integer or a device index copies nothing. Run as if from specdraft's code."""
    from specdraft.drafts import base

    counter = PageableCopyCounter(monkeypatch)
    code = (
        "device_tensor[rows]; device_tensor[rows] = 1.0; torch.as_tensor(rows, device=META); "
        "device_tensor[1]; device_tensor[rows.to(META)]; device_tensor[rows.pin_memory()]"
    )
    exec(
        compile(code, base.__file__, "exec"),
        {"device_tensor": torch.zeros(5, 3, device=META), "rows": torch.tensor([1, 3]), "torch": torch, "META": META},
    )
    assert [call.split(" at ")[0] for call in counter.calls] == [
        "Tensor.__getitem__",
        "Tensor.__setitem__",
        "torch.as_tensor",
        "Tensor.to",
    ]


def test_a_device_boolean_selection_would_fail_the_meta_harness(meta_target):
    """The harness catches what it claims: without the host batch the loss copies the device
    tensors to the host, which meta refuses."""
    draft = build_family("glide", meta_target.config).to(META)
    ids = torch.zeros(1, 8, dtype=torch.long, device=META)
    with pytest.raises(NotImplementedError):
        TargetWithDraft(meta_target, draft)(ids, torch.ones_like(ids), lag=1)
    with pytest.raises(Exception):
        ids[ids.bool()]


# -- the work a step launches does not grow with the batch's rows or documents -------------------


class OpCounter(TorchDispatchMode):
    """Counts every aten operator a region runs (forward and backward, on any device: the host's
    own work on the host batch too), by name; not the views (slice, expand, alias ...), which
    launch nothing and follow the layout (a slice of a whole dimension is an alias)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step_operators(family, target, B: int, conversations: int, T: int, sequence_parallel=None):
    """The operators of one training step (capture, the draft's forward and loss, backward) of a
    (B, T) batch whose rows each pack `conversations` conversations, on the device of `target`.
    On meta, attention_path "dense" stands in for "flex" (neither slices a row per conversation);
    on the CPU under forced_attention_path("flex") it is the GPU's own (forward only there)."""
    device = target.lm_head.weight.device
    # one loss chunk: the chunked losses loop over chunks of counted rows (a bound on memory, not a
    # loop per row or conversation), as many as the batch's counted rows fill; so does a teacher's
    # pass over the target's whole vocab beside a draft vocab (none: the draft vocab is the whole one)
    keys = family_keys(FAMILIES[family])
    draft = build_family(
        family, target.config, **({"draft_vocab_size": target.config.vocab_size} if "draft_vocab_size" in keys else {})
    ).to(device)
    model = TargetWithDraft(
        target,
        draft,
        loss_chunk_size=1 << 20,
        **({} if sequence_parallel is None else {"sequence_parallel": sequence_parallel}),
    )
    length = T // conversations
    documents = torch.arange(T).clamp(max=conversations * length - 1) // length  # (T,): the last one longer
    starts = torch.searchsorted(documents, documents)  # each token's conversation's first index
    mask = torch.ones(T, dtype=torch.long)
    mask[torch.arange(T) - starts < 2] = 0  # two prompt tokens per conversation, then its answer
    ids = torch.randint(0, target.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(B))
    host = HostBatch(ids, mask.expand(B, T).clone(), documents.expand(B, T).clone())
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), T)
    inputs = dict(
        input_ids=ids,
        loss_mask=host.loss_mask,
        document_positions=torch.arange(T) - starts,
        document_ids=host.documents,
    )
    inputs = {key: value.expand(B, T).to(device) for key, value in inputs.items()}
    if device == META:
        with OpCounter() as counter:
            model(**inputs, host=host, **options).loss.backward()
        return counter.ops
    # the CPU's flex_attention runs through torch.compile, which no dispatch mode may watch: the
    # profiler's count of the aten operators called from Python instead (not those an operator's
    # CPU kernel calls inside, which depend on sizes), of a second run (the first one compiles)
    from torch.profiler import ProfilerActivity, profile

    def counted(event):  # an outermost aten operator but a view (as OpCounter), or a flex_attention call
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return event.name.startswith("aten::") and parent is None and not is_view(event.name) or event.name == FLEX

    for _ in range(2):
        with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():  # no flex backward on the CPU
            model(**inputs, host=host, **options)
    return collections.Counter(event.name for event in prof.events() if counted(event))


FLEX = "FlexAttentionAutogradOp"  # the profiler's name of a flex_attention call


def is_view(name: str) -> bool:
    """An aten operator every overload of which is a view (launches nothing): view, slice, expand ..."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    return packet is not None and all(getattr(packet, o).is_view for o in packet.overloads())


def without_layout_copies(ops: collections.Counter) -> collections.Counter:
    """Without the copies a layout asks for (reshape's clone and _unsafe_view, contiguous's clone):
    a (B, ...) tensor permuted or sliced is often contiguous already at B = 1, not at B > 1."""
    return collections.Counter({op: n for op, n in ops.items() if op not in LAYOUT_COPIES})


LAYOUT_COPIES = ("aten.clone.default", "aten._unsafe_view.default")


def assert_same_operators(family, counts):
    """counts {(B, conversations): operators}: the same for every conversation count at a B and for
    every B >= 2; B = 1 against B = 2 but for the copies its layouts skip."""

    def check(a, b, normal=lambda ops: ops):
        (shape, ops), (other_shape, other) = a, b
        diff = sorted((op, ops[op], other[op]) for op in ops.keys() | other.keys() if ops[op] != other[op])[:12]
        assert normal(ops) == normal(other), (
            f"{family}: {sum(ops.values())} operators for {shape[0]} rows of {shape[1]} conversations, "
            f"{sum(other.values())} for {other_shape[0]} rows of {other_shape[1]}: {diff}"
        )

    by_rows = {}
    for shape, ops in counts.items():
        by_rows.setdefault(shape[0], []).append((shape, ops))
    for group in by_rows.values():
        for other in group[1:]:
            check(group[0], other)
    firsts = [group[0] for B, group in sorted(by_rows.items()) if B >= 2]
    for other in firsts[1:]:
        check(firsts[0], other)
    if 1 in by_rows and firsts:
        check(by_rows[1][0], firsts[0], without_layout_copies)


SHAPES = ((1, 1), (1, 40), (2, 1), (4, 1), (4, 40))  # (rows, conversations per row)


@pytest.mark.parametrize(
    "family,sp",
    [(family, 1) for family in FAMILY_NAMES]
    + [(family, 2) for family in FAMILY_NAMES if FAMILIES[family].sequence_parallel],
)
def test_a_steps_operators_do_not_grow_with_rows_or_conversations(family, sp, meta_targets, one_rank_of_two):
    """The same operators, as many of each, for 1 conversation and for 40 packed in a row, and for
    1, 2 and 4 rows, forward and backward, on the meta device's stand-in for the GPU path: no
    Python loop over rows or conversations (P-EAGLE's slots included), so a step launches the same
    work whatever the batch packs. Document ids are given for 1 conversation too (the loop drops
    them for a batch without a border: the plain causal path, another one). SP = 2: rank 0 of two,
    collectives stood in."""
    target = target_for(family, meta_targets)
    layout = one_rank_of_two(0) if sp == 2 else None
    assert_same_operators(family, {shape: step_operators(family, target, *shape, 320, layout) for shape in SHAPES})


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_steps_forward_on_the_flex_path_runs_the_same_operators_for_any_rows_or_conversations(
    family, cpu_target, mtp_target_dir
):
    """The same on the CPU along the GPU's own attention (flex_attention over block masks, eager:
    the CPU has no flex backward, so the forward only)."""
    from specdraft.target.attention import forced_attention_path

    if "llama" not in (FAMILIES[family].target_model_types or ("llama",)):  # MTP: a target with its layer
        cpu_target = load_frozen_target(str(mtp_target_dir))
    with forced_attention_path("flex", compile=False):
        counts = {shape: step_operators(family, cpu_target, *shape, 256) for shape in SHAPES}
    assert counts[SHAPES[0]][FLEX] > 0, "not the flex path"
    assert_same_operators(family, counts)


def test_target_capture_runs_on_meta(meta_target):
    T = 12
    ids = torch.zeros(1, T, dtype=torch.long, device=META)
    features = capture(meta_target.model, ids, torch.arange(T, device=META)[None], CaptureRequest(last_layer_kv=True))
    heads, head_dim = meta_target.config.num_key_value_heads, meta_target.config.head_dim
    for tensor in (features.input_embeds, features.cos, features.sin, features.last_keys, features.last_values):
        assert tensor.device == META
    assert features.last_keys.shape == (1, heads, T, head_dim)


def drafter_of(kind, meta_targets):
    """A drafter of `kind` (a family, self, prompt_lookup) and its target, on meta."""
    if kind in FAMILIES:
        target = target_for(kind, meta_targets)
        return build_family(kind, target.config).to(META).eval().make_drafter(target), target
    target = meta_targets["llama"]
    return (ModelDrafter(target, name="self") if kind == "self" else PromptLookupDrafter()), target


@pytest.mark.parametrize("shape", [dict(gamma=3), dict(tree=[2, 3])], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", [*FAMILY_NAMES, "self", "prompt_lookup"])
def test_a_decoding_round_runs_on_meta(kind, shape, meta_targets, monkeypatch):
    drafter, meta_target = drafter_of(kind, meta_targets)
    rounds = []
    original = drafter.propose_tree if "tree" in shape else drafter.propose_chain

    def counted(*args, **kwargs):
        tree = original(*args, **kwargs)
        rounds.append(tree)
        return tree

    monkeypatch.setattr(drafter, "propose_tree" if "tree" in shape else "propose_chain", counted)
    with meta_host_reads(monkeypatch):
        result = speculative_generate(meta_target, drafter, [1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=2, **shape)
        generate_plain(meta_target, [1, 2, 3], max_new_tokens=2)
    assert rounds and result.target_forwards >= 1  # a full round: draft, verify, accept, keep
    if kind != "prompt_lookup":  # model drafters keep their distributions on the model's device
        assert rounds[0].q is None or rounds[0].q.device == META


# -- what meta cannot catch: 0-dim tensors and host syncs ----------------------------------------


def test_cross_entropy_counts_its_hits_on_the_device_of_its_inputs():
    # a 0-dim CPU accumulator meeting a meta value passes silently; on CUDA it raises
    hidden = torch.zeros(6, 8, device=META, requires_grad=True)
    weight, labels = torch.zeros(16, 8, device=META), torch.zeros(6, dtype=torch.long, device=META)
    total, correct = chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert total.device == META and correct.device == META
    _, correct = chunked_cross_entropy(hidden[:0], weight, labels[:0])  # an all-masked batch
    assert correct.device == META


class HostSyncCounter:
    """Counts what makes the host wait for the device (each a device->host sync on a GPU) while
    `with counter:` runs, reached from specdraft's code: its own lines, or torch's, DeepSpeed's or
    transformers' code it calls. Every way a device value reaches Python or forces a sync:
    - a read in Python: item, tolist, bool / int / float / index / complex, a format (an f-string,
      repr, str), `in`, numpy, __array__, .cpu() / .to(the host);
    - an operator whose output size or value the host needs (DATA_DEPENDENT_OPS: nonzero and what
      calls it, boolean-mask indexing and assignment, masked_select, unique, repeat_interleave
      without output_size, bincount, equal, allclose, ...), and a copy into a host tensor;
    - an explicit synchronize (torch's, or DeepSpeed's accelerator's).

    Host and device are one CPU here, told apart by name: the host is `cpu`, the device DEVICE
    (`cpu:0`); a device tensor's .device read in specdraft's code, and DeepSpeed's accelerator's
    device name, are DEVICE. On the host: what host() marks (the batch and options the loop hands
    over), what torch makes without a device (FACTORIES called from Python) or on a `cpu` that
    specdraft names, what is moved to `cpu`, and what is made from host tensors only. Everything
    else stands for the device: the model's and the engine's tensors, to_device's copies, what is
    made on DEVICE, and what any of those make."""

    PYTHON_READS = (
        *("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__"),
        *("__format__", "__repr__", "__contains__", "numpy", "__array__"),
    )
    FACTORIES = ("zeros", "ones", "empty", "full", "arange", "linspace", "eye", "tensor", "as_tensor")
    FACTORIES += ("rand", "randn", "randint", "randperm")

    def __init__(self, monkeypatch):
        self.calls, self.active, self._reading = [], False, 0
        self._mode = _DeviceTracking(self)
        for name in self.PYTHON_READS:
            self._wrap_read(monkeypatch, name, lambda tensor, *args, **kwargs: True)
        self._wrap_read(monkeypatch, "cpu", lambda tensor, *args, **kwargs: True, onto_host=True)
        self._wrap_read(monkeypatch, "to", _to_host, onto_host=True)
        for name in self.FACTORIES:
            self._place_factory(monkeypatch, name)
        self._name_the_device(monkeypatch)
        self._name_the_accelerator(monkeypatch)
        self._wrap_synchronize(monkeypatch)
        self._copy_to_device(monkeypatch)

    def __enter__(self):
        self.active = True
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.active = False
        return self._mode.__exit__(*exc)

    @staticmethod
    def host(*trees):
        """Marks every tensor in `trees` (tensors, dicts, lists) as on the host; returns them."""
        _mark(trees, host=True)
        return trees[0] if len(trees) == 1 else trees

    def counts(self, tensor) -> bool:
        """A read of `tensor` now is a sync: counting, not inside another read, a device tensor."""
        return self.active and self._reading == 0 and not _on_host(tensor)

    def record(self, what: str) -> None:
        site = _specdraft_site(sys._getframe(2))
        if site is not None:
            self.calls.append(f"{what} at {site}")

    @contextlib.contextmanager
    def reading(self):
        """Inside a counted read: the reads and operators it makes itself are not counted again."""
        self._reading += 1
        try:
            yield
        finally:
            self._reading -= 1

    def _wrap_read(self, monkeypatch, name, syncs, onto_host=False):
        """Tensor.`name`: a read when syncs(...) on a device tensor; onto_host: its result is a
        host tensor (an alias here when torch hands back the tensor itself, as on the CPU)."""
        original = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            sync = self.counts(tensor) and syncs(tensor, *args, **kwargs)
            if sync:
                self.record(name)
            with self.reading():
                out = original(tensor, *args, **kwargs)
                if sync and onto_host:
                    out = out.view_as(out) if out is tensor else out
                    out._on_host = True
            return out

        monkeypatch.setattr(torch.Tensor, name, read)

    def _place_factory(self, monkeypatch, name):
        """torch.`name` called from Python: on the device it names (_named_side), else as made."""
        original = getattr(torch, name)

        def factory(*args, **kwargs):
            out = original(*args, **kwargs)
            side = _named_side(args, kwargs) if self.active else None
            if side is not None:
                _mark(out, host=side == "host")
            return out

        monkeypatch.setattr(torch, name, factory)

    def _name_the_device(self, monkeypatch):
        """A device tensor's .device read in specdraft's code is DEVICE, so that what it makes
        there lands on the side it names (torch's and the libraries' own code read `cpu`)."""
        original = torch.Tensor.device

        def device(tensor):
            where = original.__get__(tensor)
            if self.active and not _on_host(tensor) and where.type == "cpu":
                if sys._getframe(1).f_code.co_filename.startswith(SPECDRAFT_DIR):
                    return DEVICE
            return where

        monkeypatch.setattr(torch.Tensor, "device", property(device))

    def _name_the_accelerator(self, monkeypatch):
        """DeepSpeed's accelerator names its device DEVICE while counting (the CPU's says `cpu`,
        which would read here as the host): what DeepSpeed puts there stays on the device."""
        from deepspeed.accelerator import get_accelerator

        accelerator = type(get_accelerator())
        for name in ("device_name", "current_device_name"):
            original = getattr(accelerator, name)

            def named(*args, original=original, **kwargs):
                where = original(*args, **kwargs)
                return str(DEVICE) if self.active and where == "cpu" else where

            monkeypatch.setattr(accelerator, name, named)

    def _wrap_synchronize(self, monkeypatch):
        from deepspeed.accelerator import get_accelerator

        for owner, name in ((torch.accelerator, "synchronize"), (torch.cuda, "synchronize")):
            self._wrap_function(monkeypatch, owner, name, f"torch.{owner.__name__.split('.')[-1]}.synchronize")
        self._wrap_function(monkeypatch, type(get_accelerator()), "synchronize", "accelerator.synchronize")

    def _wrap_function(self, monkeypatch, owner, name, what):
        original = getattr(owner, name)

        def synchronize(*args, **kwargs):
            if self.active and self._reading == 0:
                self.record(what)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, synchronize)

    def _copy_to_device(self, monkeypatch):
        """to_device goes to DEVICE whatever device it is handed (a real engine's is `cpu`)."""
        import specdraft.train.loop  # noqa: F401  every module of the training step imported
        import specdraft.transfer

        original = specdraft.transfer.to_device
        for module in [m for name, m in sys.modules.items() if name.startswith("specdraft")]:
            if getattr(module, "to_device", None) is original:
                monkeypatch.setattr(module, "to_device", lambda x, device: original(x, DEVICE))


DEVICE = torch.device("cpu", 0)  # the device's stand-in: the CPU under a name of its own


def _on_host(tensor) -> bool:
    return getattr(tensor, "_on_host", False)


def _mark(tree, host: bool) -> None:
    for tensor in torch.utils._pytree.tree_leaves(tree):
        if isinstance(tensor, torch.Tensor):
            tensor._on_host = host


def _host_device(device) -> bool:
    return device is not None and torch.device(device) == torch.device("cpu")  # not DEVICE


def _named_side(args, kwargs):
    """Where a factory called from Python puts its tensor: "device" on DEVICE, "host" without a
    device (torch's default) or on a `cpu` that specdraft's code names; None: as the operator
    made it (made from a tensor, or on a library's `cpu`, which may be its read of a device
    tensor's .device: ambiguous here)."""
    device = kwargs.get("device")
    if device is None:
        return None if any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves(args)) else "host"
    if torch.device(device) == DEVICE:
        return "device"
    return "host" if _host_device(device) and _named_by_specdraft() else None


def _to_host(tensor, *args, **kwargs) -> bool:
    """Whether tensor.to(*args, **kwargs) goes to the host: "cpu", a host tensor's device, or a
    `cpu` device that specdraft's code names (see _named_side)."""
    where = kwargs.get("device", args[0] if args else None)
    if isinstance(where, torch.Tensor):
        return _on_host(where)
    if isinstance(where, str):
        return _host_device(where)
    kwargs = {key: value for key, value in kwargs.items() if key != "copy"}  # not _parse_to's
    return _host_device(torch._C._nn._parse_to(*args, **kwargs)[0]) and _named_by_specdraft()


def _named_by_specdraft() -> bool:
    """Whether the innermost frame outside torch, Python and this file is specdraft's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((TORCH_DIR, STDLIB_DIR, __file__)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(SPECDRAFT_DIR)


def _specdraft_site(frame):
    """`file:line` of the innermost specdraft frame from `frame` out, and in parentheses the
    innermost frame of other code outside torch's and Python's (DeepSpeed's, transformers') that
    it called; None when no specdraft frame is on the stack (a test's own reads)."""
    other = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(SPECDRAFT_DIR):
            site = f"{Path(name).name}:{frame.f_lineno}"
            return site if other is None else f"{site} ({other})"
        if other is None and name != __file__ and not name.startswith((TORCH_DIR, STDLIB_DIR)):
            other = f"{Path(name).parent.name}/{Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


TORCH_DIR = str(Path(torch.__file__).resolve().parent)
STDLIB_DIR = sysconfig.get_paths()["stdlib"]
aten = torch.ops.aten
# operators whose output size or value is data the host must wait for
DATA_DEPENDENT_OPS = {
    *(aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.allclose),
    *(aten.nonzero, aten.nonzero_numpy, aten.masked_select, aten.bincount),
    *(aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive),
}
INDEXING_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
CONSTANTS = {aten.lift_fresh, aten.lift_fresh_copy, aten.scalar_tensor}  # a Python number or list made a tensor


class _DeviceTracking(TorchDispatchMode):
    """Every operator: counted when it syncs on a device input (forces_sync). Its outputs: on
    the host when all its tensor inputs are; with none, on the device (a buffer torch's C++ makes
    on a tensor's device: a factory called from Python is placed by _place_factory), but a
    constant; on DEVICE when it names it."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if not _on_host(t)]
        if on_device and self.counter.counts(on_device[0]) and forces_sync(func, args, kwargs):
            self.counter.record(func.overloadpacket._qualified_op_name.replace("::", "."))
        out = func(*args, **kwargs)
        host = func.overloadpacket in CONSTANTS or (bool(tensors) and not on_device)
        _mark(out, host=host and kwargs.get("device") != DEVICE)
        return out


def forces_sync(func, args, kwargs) -> bool:
    """Whether this operator call, with a device tensor among its inputs, waits for the device."""
    packet = func.overloadpacket
    if packet in DATA_DEPENDENT_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:  # its output's length is the repeats' sum
        return kwargs.get("output_size") is None
    if packet in INDEXING_OPS:  # a boolean mask selects nonzero()'s positions
        masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
        return any(not _on_host(mask) for mask in masks)
    if packet is aten.copy_:  # into a host tensor
        return _on_host(args[0]) and not _on_host(args[1])
    return False


# every way a device value reaches the host: (code run as if from specdraft's, what it counts);
# v (4,) float, x a 0-dim float, n a 0-dim long, r (4,) long repeats, all on the device
HOST_READS = [
    ("x.item()", "item"),
    ("v.tolist()", "tolist"),
    ("bool(x)", "__bool__"),
    ("if torch.any(v > 0): pass", "__bool__"),
    ("assert x", "__bool__"),
    ("int(x)", "__int__"),
    ("float(x)", "__float__"),
    ("range(n)", "__index__"),
    ("complex(x)", "__complex__"),
    ("f'{x}'", "__format__"),
    ("f'{x:.3f}'", "__format__"),
    ("f'{v}'", "__format__"),
    ("repr(v)", "__repr__"),
    ("'%s' % v", "__repr__"),
    ("1.0 in v", "__contains__"),
    ("v.numpy()", "numpy"),
    ("numpy.asarray(v)", "__array__"),
    ("v.cpu()", "cpu"),
    ("v.to('cpu')", "to"),
    ("v.to(device='cpu', dtype=torch.float64)", "to"),
    ("v.to(host)", "to"),
    ("v.to(torch.device('cpu'))", "to"),
    ("v.to(host.device)", "to"),
    ("v.to('cpu', copy=True)", "to"),
    ("host.copy_(v)", "aten.copy_"),
    ("torch.equal(v, v)", "aten.equal"),
    ("torch.allclose(v, v)", "aten.allclose"),
    ("v[v > 0]", "aten.index"),
    ("v[v > 0] = 0.0", "aten.index_put_"),
    ("v.nonzero()", "aten.nonzero"),
    ("torch.zeros(4, device=v.device).nonzero()", "aten.nonzero"),
    ("torch.tensor([0.0, 1.0], device=x.device).nonzero()", "aten.nonzero"),
    ("torch.argwhere(v)", "aten.nonzero"),
    ("torch.where(v > 0)", "aten.nonzero"),
    ("v.masked_select(v > 0)", "aten.masked_select"),
    ("torch.unique(v)", "aten._unique2"),
    ("v.unique_consecutive()", "aten.unique_consecutive"),
    ("torch.repeat_interleave(r)", "aten.repeat_interleave"),
    ("v.repeat_interleave(r)", "aten.repeat_interleave"),
    ("torch.bincount(r)", "aten.bincount"),
    ("get_accelerator().synchronize()", "accelerator.synchronize"),
    ("try: torch.accelerator.synchronize()\nexcept RuntimeError: pass", "torch.accelerator.synchronize"),
    ("try: torch.cuda.synchronize()\nexcept (AssertionError, RuntimeError): pass", "torch.cuda.synchronize"),
]
# what stays on the device (or copies host data onto it: PageableCopyCounter's), no read
NO_HOST_READS = [
    "v.sum(); v.max(); torch.where(v > 0, v, 0.0); v.masked_fill(v > 0, 0.0); v.cumsum(0)",
    "v.repeat_interleave(r, output_size=10); torch.repeat_interleave(r, output_size=10)",
    "v.to(torch.float64); v.double(); v.to(v); v.to(v.device); v.to(DEVICE); host.to(v.device); v.clone()",
    "torch.zeros(4, device=host.device).nonzero(); torch.tensor([0, 1]).nonzero(); torch.arange(4)[torch.arange(4) > 1]",
    "v[host > 0]; v[0]; v[1:3]; v.index_select(0, r - 1); v.nonzero_static(size=4); (v > 0).count_nonzero()",
    "v.new_zeros(4).copy_(v); v.shape[0] + len(v); [t for t in v]",
    "v.to(get_accelerator().current_device_name()); v.to(get_accelerator().device_name(0))",  # DeepSpeed's device
]


def run_as_specdraft(code: str, tensors: dict, filename: str = f"{SPECDRAFT_DIR}/a_read.py"):
    """Runs `code` in a frame of specdraft's (by its file name) with `tensors` as its names."""
    import numpy
    from deepspeed.accelerator import get_accelerator

    names = dict(torch=torch, numpy=numpy, get_accelerator=get_accelerator, DEVICE=DEVICE, **tensors)
    exec(compile(code, filename, "exec"), names)


def read_tensors(counter) -> dict:
    """v, x, n, r on the device; host (4,) on the host (the CPU stands for both)."""
    device = dict(v=[1.0, -2.0, 3.0, 4.0], x=2.5, n=3, r=[1, 2, 3, 4])
    tensors = {name: torch.tensor(value, device=DEVICE) for name, value in device.items()}
    return dict(tensors, host=counter.host(torch.zeros(4)))


@pytest.mark.parametrize("code,what", HOST_READS, ids=[code.split("\n")[0] for code, _ in HOST_READS])
def test_the_host_sync_counter_sees_each_way_a_device_value_reaches_the_host(code, what, monkeypatch):
    counter = HostSyncCounter(monkeypatch)
    with counter:
        run_as_specdraft(code, read_tensors(counter))
    assert counter.calls == [f"{what} at a_read.py:1"]
    counter.calls.clear()
    with counter:  # on host tensors no sync, but a synchronize, which waits whatever it is handed
        run_as_specdraft(code, counter.host(read_tensors(counter)))
    assert len(counter.calls) == what.endswith("synchronize")
    counter.calls.clear()
    with counter:  # not from specdraft's code: a test's own read
        run_as_specdraft(code, read_tensors(counter), filename=__file__)
    assert counter.calls == []


@pytest.mark.parametrize("code", NO_HOST_READS)
def test_the_host_sync_counter_counts_no_device_work(code, monkeypatch):
    counter = HostSyncCounter(monkeypatch)
    with counter:
        run_as_specdraft(code, read_tensors(counter))
    assert counter.calls == []


def test_the_host_sync_counter_names_the_library_code_that_read_for_specdraft(monkeypatch):
    """A read DeepSpeed (or transformers) makes in a call of specdraft's counts at specdraft's line,
    the library's in parentheses."""
    from deepspeed.runtime import utils as deepspeed_utils

    counter = HostSyncCounter(monkeypatch)
    with counter:
        run_as_specdraft(
            "deepspeed_utils.is_invalid_grad_norm(x)", dict(deepspeed_utils=deepspeed_utils, **read_tensors(counter))
        )
    assert len(counter.calls) == 1 and counter.calls[0].startswith("__bool__ at a_read.py:1 (runtime/utils.py:")


class CPUEngine(MetaEngine):
    device = DEVICE  # HostSyncCounter's name of the device


def loop_batches(family, target_config, count: int = 4, T: int = 24) -> list:
    """Host batches as the loop hands them over (model_inputs): packed rows with a border, but
    for a target that refuses document_mask (a hybrid Qwen3-Next: MTP's), one conversation each."""
    batches = [packed_batch(T, seed=i) for i in range(count)]
    if "llama" in (FAMILIES[family].target_model_types or ("llama",)):
        return batches
    return [{key: batch[key] for key in ("input_ids", "loss_mask")} for batch in batches]


def reads(counter) -> list:
    """The counted reads without line numbers: `what at file` or `what at file (library file)`."""
    return [re.sub(r":\d+", "", call) for call in counter.calls]


@pytest.mark.parametrize("family,loss,tokens", OBJECTIVE_CASES)
def test_micro_batches_make_no_host_sync_and_a_log_interval_makes_one(
    family, loss, tokens, cpu_target, mtp_target_dir, monkeypatch
):
    """The loop's micro-step (forward_step: the batch onto the device, forward, backward, step)
    and the loss window, 2 optimizer steps of 2 micro-batches: no sync in a micro-batch, one
    (the window's) at the log. Packed documents attend along the device's path (dense here:
    the CPU's own slices read the borders on the host, which costs it nothing)."""
    from specdraft.target.attention import forced_attention_path
    from specdraft.train.loop import forward_step

    if "llama" not in (FAMILIES[family].target_model_types or ("llama",)):  # MTP: a target with its layer
        cpu_target = load_frozen_target(str(mtp_target_dir))
    torch.manual_seed(0)
    draft = build_family(family, cpu_target.config, loss=loss, distill_tokens=tokens)
    engine = CPUEngine(TargetWithDraft(cpu_target, draft, loss_chunk_size=16))
    window = LossWindow()
    monkeypatch.setattr("specdraft.train.metrics.all_reduce", lambda t: t.clone())  # a world of one
    counter = HostSyncCounter(monkeypatch)
    batches = counter.host(loop_batches(family, cpu_target.config))
    options = counter.host([draft.sample_batch_options(torch.Generator().manual_seed(i), 24) for i in range(4)])
    outs = []
    with forced_attention_path("dense"):
        for i, (batch, opts) in enumerate(zip(batches, options)):
            with counter:
                outs.append(forward_step(engine, batch, opts))
                window.add(outs[-1])
                if i % 2:
                    window.end_step()
            assert counter.calls == [], f"micro-batch {i}"
            assert not any(_on_host(t) for t in (outs[-1].loss, outs[-1].tokens))  # the counter's device tensors
    with counter:
        losses, values = window.reduce()
    assert reads(counter) == ["tolist at metrics.py"]  # the one read of the whole window
    # and what it read is what the micro-batches computed, token-weighted per step
    sums = [(o.loss.item() * o.tokens.item(), o.tokens.item(), o.correct.item()) for o in outs]
    step = [
        (sums[0][0] + sums[1][0]) / (sums[0][1] + sums[1][1]),
        (sums[2][0] + sums[3][0]) / (sums[2][1] + sums[3][1]),
    ]
    assert losses == pytest.approx(step, rel=1e-12)
    tokens = sum(s[1] for s in sums)
    assert values["loss"] == pytest.approx(sum(s[0] for s in sums) / tokens, rel=1e-12)
    assert values["accuracy"] == pytest.approx(sum(s[2] for s in sums) / tokens, rel=1e-12)


@pytest.fixture(scope="module")
def deepspeed_engine(tiny_target_dir, data_dir, tmp_path_factory):
    """(config, engine): a real DeepSpeed engine on the CPU, as build_trainee makes one for a
    GLIDE draft at the run's defaults (ZeRO-2, fp32, gradient clipping), 2 micro-batches a step."""
    from helpers import run_overrides
    from specdraft.config import load_config
    from specdraft.train.engine import build_engine, init_distributed

    init_distributed()
    work = tmp_path_factory.mktemp("engine")
    overrides = dict(gradient_accumulation_steps=2, per_device_batch_size=2, max_seq_length=24, loss_chunk_size=16)
    cfg = load_config(None, run_overrides(tiny_target_dir, data_dir, work / "run", work / "cache", **overrides))
    target = load_frozen_target(cfg.target)
    torch.manual_seed(0)
    model = TargetWithDraft(target, build_draft(cfg.draft, target.config), cfg.loss_chunk_size)
    return cfg, build_engine(cfg, model, total_steps=4, target_placement="replicated")


def test_the_loop_on_a_deepspeed_engine_syncs_at_the_optimizer_step_and_the_log_only(deepspeed_engine, monkeypatch):
    """train()'s loop body (model_inputs, the options drawn, forward_step on a real DeepSpeed
    engine, the loss window; at the log the window's reduce and the learning rate), 2 optimizer
    steps of 2 packed micro-batches: no sync in a micro-batch but DeepSpeed's own at the
    gradient-accumulation boundary (DEEPSPEED_STEP_READS), one (the window's) at the log."""
    from specdraft.target.attention import forced_attention_path

    cfg, engine = deepspeed_engine
    monkeypatch.setattr("specdraft.parallel.collectives.collective_device", lambda: DEVICE)  # NCCL's: the device
    counter, window = HostSyncCounter(monkeypatch), LossWindow()
    with forced_attention_path("dense"):  # the device's: the CPU's slices read document borders
        micro_batches = loop_steps(cfg, engine, counter, window, steps=2)
    with counter:
        losses, _ = window.reduce()
        engine.get_lr()
    assert micro_batches == [[], DEEPSPEED_STEP_READS] * 2
    assert reads(counter) == ["tolist at metrics.py"]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def loop_steps(cfg, engine, counter, window, steps: int) -> list:
    """`steps` optimizer steps of train()'s loop body, each micro-batch under the counter; the
    reads each micro-batch made."""
    from specdraft.train.loop import batch_generator, forward_step, model_inputs

    draft, made = engine.module.draft_model, []
    for step in range(steps):
        for micro in range(cfg.gradient_accumulation_steps):
            rows = counter.host(packed_rows(cfg.max_seq_length, seed=10 * step + micro))
            with counter:
                batch = model_inputs(rows, cfg.document_mask)
                options = draft.sample_batch_options(batch_generator(cfg.seed, step, micro), cfg.max_seq_length)
                window.add(forward_step(engine, batch, options))
            made.append(reads(counter))
            counter.calls.clear()
        window.end_step()
    return made


# DeepSpeed ZeRO-2's own syncs at each optimizer step (fp32, gradient clipping on): a bool() of
# whether the grad norm is valid (runtime/utils.py: is_invalid_grad_norm) in its step()'s overflow
# check (zero/stage_1_and_2.py: step), and in unscale_and_clip_grads once per parameter group
# (engine.optimizer_groups: decay and no decay). Not specdraft's to remove.
DEEPSPEED_STEP_READS = ["__bool__ at loop.py (runtime/utils.py)"] * 3


# sequence parallelism and several drafts: the loop's other two ways through a micro-batch

SP_CASES = [case for case in OBJECTIVE_CASES if FAMILIES[case[0]].sequence_parallel]
# the drafts one run may train together on one target pass (GLIDE without anchor_offset: moved
# positions keep a draft alone in its run)
SHARED = [
    family
    for family in FAMILY_NAMES
    if FAMILIES[family].target_model_types is None or "llama" in FAMILIES[family].target_model_types
]


def shared_drafts(target_config, device):
    return [
        build_family(family, target_config, **({"anchor_offset": False} if family == "glide" else {})).to(device)
        for family in SHARED
    ]


@pytest.fixture
def one_rank_of_two(monkeypatch):
    """Rank r of an SP group of 2, run alone: each collective hands back a tensor of the right
    shape (this rank's own where another rank's would come; the values are not what 2 ranks
    compute, what the step reads on the host is the point)."""
    from specdraft.parallel import sequence
    from specdraft.parallel.sequence import SequenceParallel

    calls = []

    class OneRank:
        @staticmethod
        def all_gather(parts, x, group=None):
            calls.append("all_gather")
            for part in parts:
                part.copy_(x)

        @staticmethod
        def all_reduce(x, *args, **kwargs):
            calls.append("all_reduce")

    def all_to_all(x, group):
        calls.append("all_to_all")
        return x.clone()

    monkeypatch.setattr(sequence, "dist", OneRank)
    monkeypatch.setattr(sequence, "_all_to_all", all_to_all)
    layout = lambda rank: SequenceParallel(size=2, rank=rank)  # noqa: E731
    layout.calls = calls
    return layout


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family,loss,tokens", SP_CASES)
def test_a_sequence_parallel_micro_batch_reads_no_device_value_and_copies_nothing_pageable(
    family, loss, tokens, rank, meta_targets, one_rank_of_two, monkeypatch
):
    """Each rank of SP = 2 (its local computation in one process, collectives stood in) through
    forward_step on meta: a host read of a device value raises there (a meta tensor has none),
    what a rank counts on the host comes from the host batch (SequenceShard.host_count, DFlash's
    and P-EAGLE's own slots), and every host tensor it sends is pinned."""
    from specdraft.train.loop import forward_step

    meta_target = target_for(family, meta_targets)
    draft = build_family(family, meta_target.config, loss=loss, distill_tokens=tokens).to(META)
    model = TargetWithDraft(meta_target, draft, loss_chunk_size=16, sequence_parallel=one_rank_of_two(rank))
    engine = MetaEngine(model)
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), 32)
    counter = PageableCopyCounter(monkeypatch)
    out = forward_step(engine, packed_batch(32), options)  # the border at 16: the shard boundary
    assert out.loss.device == META and out.tokens.device == META
    assert "all_to_all" in one_rank_of_two.calls  # the sharded path ran (the capture's head exchange)
    assert counter.calls == []


@pytest.mark.parametrize("sp", [1, 2])
def test_several_drafts_read_no_device_value_and_copy_nothing_pageable(sp, meta_target, one_rank_of_two, monkeypatch):
    """forward_drafts (one target pass, then each draft's loss, backward and step) with every
    draft that can share a run, on meta, packed, at SP = 1 and as rank 1 of SP = 2."""
    from specdraft.parallel.sequence import SequenceParallel
    from specdraft.train.loop import forward_drafts
    from specdraft.train.model import DraftWithLoss

    drafts = shared_drafts(meta_target.config, META)
    engines = [MetaEngine(DraftWithLoss(draft, loss_chunk_size=16)) for draft in drafts]
    options = [draft.sample_batch_options(torch.Generator().manual_seed(0), 32) for draft in drafts]
    counter = PageableCopyCounter(monkeypatch)
    outs = forward_drafts(
        meta_target, engines, packed_batch(32), options, one_rank_of_two(1) if sp == 2 else SequenceParallel()
    )
    assert len(outs) == len(drafts) >= 4 and all(out.loss.device == META for out in outs)
    assert ("all_to_all" in one_rank_of_two.calls) == (sp == 2)
    assert counter.calls == []


def test_several_drafts_make_no_host_sync_per_micro_batch_and_one_per_draft_and_log_interval(cpu_target, monkeypatch):
    """The CPU count of specdraft's host reads, as for one draft above: none in 2 optimizer steps
    of 2 packed micro-batches of every draft that can share a run (forward_drafts: one target
    pass, each draft's forward, backward, step), one per draft at the log."""
    from specdraft.target.attention import forced_attention_path
    from specdraft.train.loop import forward_drafts
    from specdraft.train.model import DraftWithLoss

    torch.manual_seed(0)
    drafts = shared_drafts(cpu_target.config, "cpu")
    engines = [CPUEngine(DraftWithLoss(draft, loss_chunk_size=16)) for draft in drafts]
    windows = [LossWindow() for _ in drafts]
    monkeypatch.setattr("specdraft.train.metrics.all_reduce", lambda t: t.clone())  # a world of one
    counter = HostSyncCounter(monkeypatch)
    batches = counter.host(loop_batches("glide", cpu_target.config))
    options = counter.host(
        [[draft.sample_batch_options(torch.Generator().manual_seed(i), 24) for draft in drafts] for i in range(4)]
    )
    with forced_attention_path("dense"):
        for i, (batch, own) in enumerate(zip(batches, options)):
            with counter:
                outs = forward_drafts(cpu_target, engines, batch, own)
                for window, out in zip(windows, outs):
                    window.add(out)
                    if i % 2:
                        window.end_step()
            assert counter.calls == [], f"micro-batch {i}"
            assert not any(_on_host(out.loss) for out in outs)  # the counter's device tensors
    with counter:
        for window in windows:
            window.reduce()
    assert reads(counter) == ["tolist at metrics.py"] * len(drafts) and len(drafts) >= 4


# -- collectives go where the backend needs them ------------------------------------------------


class FakeAccelerator:
    def __init__(self, device_name="meta", count=0):
        self.device = device_name
        self.count = count
        self.saved, self.restored = [], []

    def device_name(self, index=None):
        return self.device

    def current_device_name(self):
        return self.device

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def get_rng_state(self, index=None):
        self.saved.append(index)
        return torch.tensor([index, 7], dtype=torch.uint8)

    def set_rng_state(self, state, index=None):
        self.restored.append((index, state.tolist()))


class _Reduced(Exception):
    pass


@pytest.fixture
def nccl_on_meta(monkeypatch):
    """A backend like NCCL whose collectives need tensors on the accelerator (here: meta); the
    fake all_reduce records the device each collective was handed."""
    import deepspeed.accelerator
    import torch.distributed as dist

    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise _Reduced  # a meta tensor has no value to hand back

    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: FakeAccelerator("meta"))
    return seen


def test_collective_device_follows_the_backend(nccl_on_meta, monkeypatch):
    import torch.distributed as dist

    assert collectives.collective_device() == META
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    assert collectives.collective_device() == torch.device("cpu")


def test_any_rank_and_the_loss_window_reduce_on_the_backends_device(nccl_on_meta):
    with pytest.raises(_Reduced):
        collectives.any_rank(True)
    assert nccl_on_meta == [META]
    window = LossWindow()
    window.add(
        type("Out", (), dict(loss=torch.tensor(2.0), tokens=torch.tensor(3), correct=torch.tensor(1), metrics={}))()
    )
    window.end_step()
    with pytest.raises(_Reduced):
        window.reduce()
    assert nccl_on_meta == [META, META]


# -- device RNGs in the checkpoint ----------------------------------------------------------------


def test_rng_state_carries_every_device_generator_through_the_accelerator(monkeypatch):
    import deepspeed.accelerator

    from specdraft.checkpoint.rng import rng_state, set_rng_state

    accelerator = FakeAccelerator("cuda", count=2)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: accelerator)
    state = rng_state()
    assert accelerator.saved == [0, 1]
    assert [t.tolist() for t in state["devices"]] == [[0, 7], [1, 7]]
    before = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), before)  # the CPU generator still comes back too
    assert accelerator.restored == [(0, [0, 7]), (1, [1, 7])]
    # the state goes through torch.save / torch.load(weights_only=True) as the checkpoint does
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert [t.tolist() for t in torch.load(buffer, weights_only=True)["devices"]] == [[0, 7], [1, 7]]


def test_rng_state_on_the_cpu_accelerator_holds_no_device_generators():
    from specdraft.checkpoint.rng import rng_state

    assert rng_state()["devices"] == []  # the CPU accelerator's "device" RNG is torch's CPU one


# -- eval on a device and dtype ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tiny_target_dir, tmp_path_factory):
    from safetensors.torch import save_file

    target = load_frozen_target(str(tiny_target_dir))
    cfg = OmegaConf.structured(DraftConfig(max_lag=3))
    draft = GlideDraft.from_target_config(target.config, cfg)
    export = tmp_path_factory.mktemp("export")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(export / "model.safetensors"))
    (export / "config.json").write_text(json.dumps(dict(draft.export_config(), target={"path": str(tiny_target_dir)})))
    return export


def test_eval_in_bf16_on_cpu_is_token_identical_to_the_bf16_targets_greedy(
    tiny_target_dir, tiny_data, tiny_export, capsys
):
    from specdraft.cli import main
    from specdraft.decode.prompts import read_prompts
    from specdraft.commands.evaluate import load_tokenizer
    from specdraft.export.files import load_exported_draft

    assert (
        main(
            [
                "eval",
                str(tiny_export),
                "--prompts",
                str(tiny_data.prompts_file),
                "--dtype",
                "bf16",
                "--device",
                "cpu",
                "--max-new-tokens",
                "16",
                "--max-prompts",
                "3",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["dtype"], report["device"], report["gamma"]) == ("bfloat16", "cpu", 3)  # gamma: max_lag
    assert report["matches_target"] is True
    # the same decoding, held against transformers' own greedy generate of the bf16 target
    target = load_frozen_target(str(tiny_target_dir), "bf16")
    draft, _ = load_exported_draft(tiny_export, torch.bfloat16)
    drafter = GlideDrafter(draft, target)
    assert drafter.lm_head.dtype == torch.bfloat16
    prompts = read_prompts(tiny_data.prompts_file, load_tokenizer(None, Path(tiny_target_dir)), max_prompts=3)
    for prompt in prompts:
        ours = speculative_generate(target, drafter, prompt, max_new_tokens=16).tokens
        ids = torch.tensor([prompt])
        reference = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            min_new_tokens=16,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :]
        assert ours == reference.tolist()


def test_eval_dtype_auto_is_fp32_on_the_cpu_and_a_missing_gpu_is_one_line(
    tiny_target_dir, tiny_data, tiny_export, tmp_path, capsys
):
    import shutil

    from specdraft.cli import main

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16")))
    assert (
        main(
            [
                "eval",
                str(target),
                "--method",
                "prompt_lookup",
                "--prompts",
                str(tiny_data.prompts_file),
                "--max-new-tokens",
                "4",
                "--max-prompts",
                "1",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["gamma"] == 5  # no draft: the untrained default
    # auto: the checkpoint's bf16 on a GPU; fp32 on the CPU (bf16 only when asked: --dtype bf16)
    assert report["dtype"] == ("bfloat16" if torch.cuda.is_available() else "float32")
    if not torch.cuda.is_available():
        assert report["device"] == "cpu"
        assert main(["eval", str(tiny_export), "--prompts", str(tiny_data.prompts_file), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert "device 'cuda'" in err and len(err.splitlines()) == 1


def test_eval_warns_once_when_asked_deeper_than_the_draft_was_trained(tiny_data, tiny_export, capsys, caplog):
    from specdraft.commands.evaluate import evaluate

    with caplog.at_level("WARNING"):
        evaluate(tiny_export, tiny_data.prompts_file, gamma=3, max_new_tokens=4, max_prompts=1, device="cpu")
    assert not caplog.records
    with caplog.at_level("WARNING"):
        report = evaluate(
            tiny_export, tiny_data.prompts_file, tree=[2, 2, 2, 2], max_new_tokens=4, max_prompts=1, device="cpu"
        )
    assert report["tree"] == [2, 2, 2, 2]
    [record] = caplog.records
    assert "tree depth 4" in record.getMessage() and "3 tokens ahead" in record.getMessage()
