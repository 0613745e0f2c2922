"""The teacher costs only what the loss reads (issue 43). EAGLE-3 and P-EAGLE teach over a draft
vocab: the target's distribution comes from the lm_head rows of that vocab (one copy per step, a
(chunk, Vd) matmul per chunk). The target's whole vocab is read only for what needs it (EAGLE-3's
in_vocab top-1, LK's whole-vocab log-sum-exp): one pass, at the rows some step's teacher reads, in
blocks of at most one loss chunk's elements, none when the draft vocab is the whole one
(loss.teacher_vocab_pass). Pinned here: the same values as the straightforward whole-vocab formula,
which matrices are multiplied, and the loss's peak against its term of the memory model."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers import loss_step_peak_against_model, random_llama
from specdraft.config import DraftConfig, TrainConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts import loss as loss_module
from specdraft.drafts.base import LossBatch, MemoryShape
from specdraft.drafts.eagle3 import train as eagle3_module
from specdraft.drafts.loss import teacher_vocab_pass
from specdraft.drafts.objective_options import TEACHER_OBJECTIVES
from specdraft.drafts.peagle import train as peagle_module
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.target.capture import capture

torch.set_num_threads(1)

V, VD, T = 96, 40, 24
MODULES = {"eagle3": eagle3_module, "peagle": peagle_module}
OPTIONS = {"eagle3": dict(ttt_steps=3), "peagle": dict(num_depths=3, mask_token_id=5)}


def draft_for(target, family, vocab=VD, **options):
    cfg = OmegaConf.structured(DraftConfig(type=family, draft_vocab_size=vocab, **OPTIONS[family], **options))
    draft = build_draft(cfg, target.config)
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=generator).numpy()
    draft.set_vocab_maps(*vocab_maps(counts, vocab))
    with torch.no_grad():  # weights of a realistic scale (tests/test_eagle3.py, test_peagle.py)
        for name, p in draft.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=generator) * 0.15
                if p.dim() >= 2 or "mask" in name
                else torch.rand(p.shape, generator=generator) + 0.5
            )
    return draft.to(target.dtype)


def batch():
    """Two packed rows; answers (the loss mask) leave prompt tokens no teacher reads."""
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids)
    mask[0, 10:] = 1
    mask[1, 5:11] = 1
    mask[1, 17:] = 1
    documents = torch.zeros_like(ids)
    documents[1, 14:] = 1
    return ids, mask, documents


def rows_read(mask, documents):
    """final's rows a teacher reads, by hand: position s, 1 <= s <= T-2, whose next token x_{s+1}
    is taught in its conversation (EAGLE-3's step 0 and P-EAGLE's depth 0 read every one of them,
    the other steps and depths a subset)."""
    s = torch.arange(1, T - 1)
    return int((mask[:, s + 1].bool() & (documents[:, s + 1] == documents[:, s - 1])).sum())


@pytest.fixture(scope="module")
def target64():
    return random_llama(vocab=V, hidden=32, layers=2).double()


def step(draft, target, chunk=5):
    """One training_loss and its backward -> (loss, grads by name, metrics as floats)."""
    ids, mask, documents = batch()
    feats = capture(target.model, ids, torch.arange(T)[None].expand_as(ids), draft.capture_request())
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), T)
    draft.zero_grad(set_to_none=True)
    out = draft.training_loss(
        LossBatch(feats, target.lm_head.weight, ids, mask, chunk, documents=documents, options=options)
    )
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, {k: (float(v), float(n)) for k, (v, n) in out.metrics.items()}


def straightforward(final, weight, rows, chunk_size, draft_vocab, logsumexp, argmax):
    """Today's formula before issue 43: every row of final through the whole lm_head at once."""
    logits = final.to(weight.dtype) @ weight.t()
    return (torch.logsumexp(logits.float(), dim=-1) if logsumexp else None), (logits.argmax(dim=-1) if argmax else None)


CASES = [("eagle3", loss, rows) for loss in TEACHER_OBJECTIVES for rows in ("in_vocab", "all")] + [
    ("peagle", loss, None) for loss in TEACHER_OBJECTIVES
]


@pytest.mark.parametrize("family,loss,teacher_rows", CASES)
def test_every_teacher_objective_equals_the_straightforward_whole_vocab_teacher(
    target64, monkeypatch, family, loss, teacher_rows
):
    """fp64 models, a draft vocab of 40 of 96, packed rows with prompts: loss, every gradient and
    every metric equal those of the whole-vocab formula (every row through the whole lm_head at
    once, torch.logsumexp, argmax), to 1e-12. The objective computes in fp32 whatever its inputs:
    equal to 1e-12 is equal. The pass reads fewer rows than final has."""
    options = {} if teacher_rows is None else {"teacher_rows": teacher_rows}
    draft = draft_for(target64, family, loss=loss, **options)
    module = MODULES[family]
    seen = []

    def spy(final, weight, rows, *args, **kwargs):
        seen.append((rows.numel(), final.shape[0]))
        return teacher_vocab_pass(final, weight, rows, *args, **kwargs)

    monkeypatch.setattr(module, "teacher_vocab_pass", spy)
    new = step(draft, target64)
    monkeypatch.setattr(module, "teacher_vocab_pass", straightforward)
    old = step(draft, target64)
    assert abs(float(new[0]) - float(old[0])) <= 1e-12 * max(1.0, abs(float(old[0])))
    assert new[1].keys() == old[1].keys() and new[2].keys() == old[2].keys()
    for name in old[1]:
        assert (new[1][name] - old[1][name]).abs().max() <= 1e-12, name
    for name in old[2]:
        assert new[2][name] == pytest.approx(old[2][name], rel=1e-12, abs=1e-12), name
    reads_whole_vocab = (family == "eagle3" and teacher_rows == "in_vocab") or loss.startswith("lk_")
    assert len(seen) == int(reads_whole_vocab)  # once per step, or never
    ids, mask, documents = batch()
    if seen:
        assert seen[0] == (rows_read(mask, documents), 2 * T) and seen[0][0] < 2 * T


def test_the_pass_keeps_the_first_top1_and_the_whole_normaliser_exactly():
    """Integer logits (exact in any summation order) with exact ties: a row's top-1 is the first of
    its maxima over the whole vocab, as argmax has it (a draft token tied with a lower outside one
    is not the top-1), its log-sum-exp torch.logsumexp's; rows not asked are 0; any block size."""
    g = torch.Generator().manual_seed(1)
    final = torch.randint(-2, 3, (30, 6), generator=g).double()
    weight = torch.randint(-2, 3, (50, 6), generator=g).double()
    weight[30:] = weight[:20]  # ids 30..49 repeat 0..19: ties at the top
    logits = final @ weight.t()
    top = logits.amax(dim=-1, keepdim=True)
    assert ((logits == top).sum(dim=-1) > 1).sum() >= 10  # many rows have tied maxima
    rows = torch.tensor([0, 2, 3, 7, 8, 9, 15, 16, 22, 29])
    for chunk, draft_vocab in [(0, 20), (3, 20), (64, 50), (1, 5)]:
        lse, top1 = teacher_vocab_pass(final, weight, rows, chunk, draft_vocab, logsumexp=True, argmax=True)
        assert torch.equal(top1[rows], logits.argmax(dim=-1)[rows])
        assert (lse[rows] - torch.logsumexp(logits.float(), dim=-1)[rows]).abs().max() <= 1e-12
        unread = torch.ones(30, dtype=torch.bool)
        unread[rows] = False
        assert not lse[unread].any() and not top1[unread].any()
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[30:] = True  # the draft vocab: the repeats; their equal lower twins outside are the top-1
    assert not t2d[top1[rows]].any() and (logits[rows][:, 30:].amax(-1) == logits[rows].amax(-1)).any()


# -- which matrices the teacher multiplies -------------------------------------------------------


class HeadReads(TorchDispatchMode):
    """The matmuls that read the target's whole lm_head (its storage) and those that read a copy of
    its rows (index_select: the teacher's draft-vocab rows); the rows of every tensor made whose
    last dim is V."""

    def __init__(self, weight):
        super().__init__()
        self.head, self.vocab = weight.untyped_storage().data_ptr(), weight.shape[0]
        self.copies, self.whole, self.teacher, self.vocab_rows = [], [], [], []
        self.held = []  # the copies themselves: while held, no other tensor can take their address

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "matmul", "linear"):
            if self.head in inputs:
                self.whole.append(tuple(outputs[0].shape))
            if inputs & set(self.copies):
                self.teacher.append(tuple(outputs[0].shape))
        elif name == "index_select" and self.head in inputs and outputs[0].dim() == 2:
            self.copies.append(outputs[0].untyped_storage().data_ptr())
            self.held.append(outputs[0])
        self.vocab_rows += [
            t.shape[:-1].numel()
            for t in outputs
            if t.dim() >= 2 and t.shape[-1] == self.vocab and t.untyped_storage().data_ptr() not in inputs
        ]  # made, not a view (weight.t())
        return out


@pytest.mark.parametrize(
    "family,options,chunk",
    [
        ("eagle3", dict(loss="soft_ce"), 8),
        ("eagle3", dict(loss="soft_ce"), 0),
        ("eagle3", dict(loss="lk_lambda", teacher_rows="all"), 8),
        ("peagle", dict(loss="lk_alpha"), 8),
    ],
)
def test_the_whole_lm_head_is_multiplied_only_at_the_rows_a_teacher_reads_one_chunk_at_a_time(family, options, chunk):
    """A draft vocab of 200 of 400: the teacher's distribution is a (rows <= chunk, 200) matmul
    with a copy of the lm_head's draft rows, made once; the whole lm_head is multiplied only by
    the rows some step's teacher reads, each exactly once, in blocks of at most chunk x 200 / 400
    rows; no tensor with the whole vocab as its last dim has more rows than a block."""
    target = random_llama(vocab=400, hidden=32, layers=2)
    draft = draft_for(target, family, vocab=200, **options)
    ids, mask, documents = batch()
    ids = ids * 4  # ids across the whole vocab
    feats = capture(target.model, ids, torch.arange(T)[None].expand_as(ids), draft.capture_request())
    weight = target.lm_head.weight
    with HeadReads(weight) as reads:
        out = draft.training_loss(
            LossBatch(
                feats,
                weight,
                ids,
                mask,
                chunk,
                documents=documents,
                options=draft.sample_batch_options(torch.Generator().manual_seed(0), T),
            )
        )
        out.loss.backward()
    chunk_rows = chunk if chunk > 0 else loss_module.default_chunk_size(200)
    block = max(1, min(chunk_rows, rows_read(mask, documents)) * 200 // 400)
    assert len(reads.copies) == 1
    assert reads.teacher and all(rows <= chunk_rows and vocab == 200 for rows, vocab in reads.teacher)
    assert sum(rows for rows, _ in reads.whole) == rows_read(mask, documents) < 2 * T
    assert all(rows <= block and vocab == 400 for rows, vocab in reads.whole)
    assert max(reads.vocab_rows) <= block


@pytest.mark.parametrize("options", [dict(loss="soft_ce"), dict(loss="tv", teacher_rows="all")])
def test_the_whole_lm_head_is_never_multiplied_when_nothing_needs_it(target64, options):
    """in_vocab with the whole vocab as the draft vocab (every top-1 is a draft token), or a
    teacher over all rows without LK: the lm_head is read only for the copy of its rows."""
    draft = draft_for(target64, "eagle3", vocab=V if options["loss"] == "soft_ce" else VD, **options)
    ids, mask, documents = batch()
    feats = capture(target64.model, ids, torch.arange(T)[None].expand_as(ids), draft.capture_request())
    with HeadReads(target64.lm_head.weight) as reads:
        draft.training_loss(
            LossBatch(feats, target64.lm_head.weight, ids, mask, 5, documents=documents)
        ).loss.backward()
    assert reads.whole == [] and len(reads.copies) == 1 and reads.teacher


def test_in_vocab_over_the_whole_vocab_is_every_row(target64):
    """The draft vocab is the whole one: in_vocab (no pass) trains what `all` trains."""
    losses = [
        step(draft_for(target64, "eagle3", vocab=V, teacher_rows=rows), target64)[0] for rows in ("in_vocab", "all")
    ]
    assert float(losses[0]) == float(losses[1])


@pytest.mark.parametrize("family", ["glide", "dflash", "dspark"])
@pytest.mark.parametrize("loss", ["kl", "0.9*tv + 0.1*ce"])
def test_a_full_vocab_teacher_holds_one_chunk_of_rows_at_a_time(family, loss):
    """The families whose draft predicts over the whole vocab (GLIDE, DFlash, DSpark) read the
    teacher through that same lm_head: no tensor made in a step, forward or backward, with the
    vocab as its last dim has more rows than one chunk (8 here)."""
    from specdraft.train.model import TargetWithDraft

    target = random_llama(vocab=400, hidden=32, layers=2)
    cfg = OmegaConf.merge(
        OmegaConf.structured(DraftConfig),
        {"type": family, "loss": loss},
        {} if family == "glide" else {"block_size": 4},
    )
    draft = build_draft(cfg, target.config)
    ids = torch.randint(0, 400, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :10] = 0
    with HeadReads(target.lm_head.weight) as reads:
        TargetWithDraft(target, draft, 8)(
            ids, mask, **draft.sample_batch_options(torch.Generator().manual_seed(0), 64)
        ).loss.backward()
    assert reads.vocab_rows and max(reads.vocab_rows) <= 8


# -- the loss's peak against its term of the memory model ------------------------------------------

MEMORY_FIXED = ("target weights", "draft weights", "draft grads", "optimizer (fp32 master + Adam m, v)")


@pytest.mark.parametrize(
    "family,loss,chunk",
    [
        ("eagle3", "soft_ce", 0),
        ("eagle3", "lk_lambda", 0),
        ("eagle3", "soft_ce", 256),
        ("peagle", "kl", 0),
        ("peagle", "lk_alpha", 256),
    ],
)
def test_the_teachers_peak_is_its_term_of_the_memory_model(monkeypatch, family, loss, chunk):
    """A step of EAGLE-3 / P-EAGLE with a draft vocab of 400 of 4750 (the ratio of 32k to Qwen3's
    152k, tripled), fp32, T = 256: the peak of live tensor bytes is within 10% of what the memory
    model adds above weights, gradients and optimizer state. loss_chunk_size 0 sizes the loss's
    chunk from the draft vocab (256 rows here, the default chunk shrunk to fit a CPU test), not the
    target's (64); the whole-vocab pass of in_vocab / LK stays within the loss chunk's term."""
    from specdraft.train.model import TargetWithDraft

    vocab, draft_vocab, seq = 4750, 400, 256
    monkeypatch.setattr(loss_module, "LOGITS_CHUNK_BYTES", 4 * vocab * 64)  # 64 rows of 4750, 704 of 400
    cfg = OmegaConf.structured(TrainConfig)
    cfg.draft.type, cfg.max_seq_length, cfg.precision, cfg.per_device_batch_size = family, seq, "fp32", 1
    cfg.loss_chunk_size, cfg.draft.loss, cfg.draft.draft_vocab_size = chunk, loss, draft_vocab
    for key, value in {"eagle3": dict(ttt_steps=2), "peagle": dict(num_depths=3)}[family].items():
        cfg.draft[key] = value
    target = random_llama(vocab=vocab, init=0.02, tie_word_embeddings=False)
    config = target.config
    draft = build_draft(cfg.draft, config)
    draft.set_vocab_maps(
        *vocab_maps(torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(0)).numpy(), draft_vocab)
    )
    model = TargetWithDraft(target, draft, cfg.loss_chunk_size)
    peak, predicted, parts = loss_step_peak_against_model(model, config, cfg, MEMORY_FIXED, seq)
    assert peak == pytest.approx(predicted, rel=0.10), {k: f"{v / 2**20:.2f} MiB" for k, v in parts.items()}


def test_a_zero_chunk_is_sized_from_the_losss_own_vocab_by_hand():
    """MemoryShape.loss_chunk with loss_chunk_size 0: as the loss sizes it (default_chunk_size of
    its logits' vocab). EAGLE-3 on a Qwen3-0.6B-shaped target at 2048 tokens, bf16, soft CE over
    32,000 draft tokens: 7 steps' hidden gradients + the head's fp32 gradient + the counted rows'
    hidden states and gradients + 2048 rows x 32,000 x (7 fp32 buffers + the bf16 matmul output)."""
    from transformers import Qwen3Config

    from specdraft.train import memory

    shape = MemoryShape(B=1, T=2048, dtype_bytes=2, chunk=0, documents=False, target=None)
    assert shape.loss_chunk(2048, 32000, 1024, teacher=True) == 2048 * 2 * 1024 * 2 + 2048 * 32000 * 30
    assert shape.loss_chunk(2048, 151936, 1024) == 2048 * 2 * 1024 * 2 + 384 * 151936 * 6  # CE over 152k
    qwen = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    cfg = OmegaConf.structured(TrainConfig)
    cfg.draft.type, cfg.max_seq_length, cfg.precision, cfg.per_device_batch_size = "eagle3", 2048, "bf16", 1
    term = memory.estimate_peak(qwen, cfg, world_size=1).parts["loss chunk + hidden grads"]
    assert term == 7 * 2048 * 1024 * 2 + 32000 * 1024 * 4 + 2048 * 2 * 1024 * 2 + 2048 * 32000 * 30
