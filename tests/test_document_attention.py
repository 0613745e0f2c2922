"""GLIDE's and DFlash's attention over packed documents, one path per device (target/attention.py):
CPU per-conversation slices equal the visibility rule spelled out here, with every gradient; the
CUDA flex_attention path equals it in the forward (flex has no backward on CPU in torch 2.13, so
its forward runs here in eager mode); other devices use the dense mask. Neither the slices nor the
flex path builds a (T, T) or blocks x row mask."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import random_llama
from specdraft.drafts import DraftConfig, layers
from specdraft.drafts.registry import build_draft
from specdraft.drafts.dflash import blocks as dflash_blocks
from specdraft.drafts.base import LossBatch, document_starts
from specdraft.drafts.dflash.blocks import BlockVisibility, block_attention
from specdraft.target.attention import attention_path
from specdraft.drafts.layers import lagged_cross_attention, sliding_window_attention
from specdraft.target.capture import capture

torch.set_num_threads(1)


def documents_of(rows):
    """[[conversation lengths] per row] -> (B, T) document ids."""
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])


SHORT = documents_of([[9, 1, 13, 7], [30]])  # T = 30: a one-token conversation, a row without borders
LONG = documents_of([[100, 1, 150, 49], [300]])  # T = 300: conversations across flex's 128-token tiles


def qkv(T, K=None, B=2, heads=4, kv_heads=2, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = T if K is None else K
    q = 3 * torch.randn(B, heads, T, D, generator=g, dtype=dtype)
    k = 3 * torch.randn(B, kv_heads, K, D, generator=g, dtype=dtype)
    v = torch.randn(B, kv_heads, K, D, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def masked_reference(q, k, v, visible):
    """SDPA under an explicit (B, 1, Q, K) mask; a row without a visible key is zero."""
    seen = visible.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | ~seen, enable_gqa=q.shape[1] != k.shape[1])
    return out * seen


def glide_rule(documents, window=None, lag=None):
    """(B, 1, T, T): query t sees key s of its own conversation with t - window < s <= t (self-
    attention) or s <= t - lag (cross-attention over the target's K/V)."""
    T = documents.shape[1]
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    rule = ((s <= t) & (t - s < window)) if window is not None else (s <= t - lag)
    return (rule & (documents[:, :, None] == documents[:, None, :]))[:, None]


def glide_attention(kind, value, documents):
    if kind == "window":
        return lambda q, k, v: sliding_window_attention(q, k, v, value, documents)
    return lambda q, k, v: lagged_cross_attention(q, k, v, value, documents)


def force_path(monkeypatch, path):
    for module in (layers, dflash_blocks):
        monkeypatch.setattr(module, "attention_path", lambda device: path)


def refuse_dense_masks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dense document mask was built")

    monkeypatch.setattr(layers, "same_document", refuse)
    monkeypatch.setattr(BlockVisibility, "dense", refuse)


def mask_spy(monkeypatch):
    masks, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return masks


def flex_spy(monkeypatch, module):
    calls, flex = [], module.flex_attention

    def spy(*args, **kwargs):
        calls.append(args[3].shape)  # the BlockMask's (B, H, Q, KV)
        return flex(*args, **kwargs)

    monkeypatch.setattr(module, "flex_attention", spy)
    return calls


def test_each_device_takes_its_path():
    assert attention_path(torch.device("cpu")) == "slices"  # flex_attention has no backward there
    assert attention_path(torch.device("cuda")) == "flex"
    assert attention_path(torch.device("cuda:3")) == "flex"
    assert attention_path(torch.device("meta")) == "dense"


def test_cuda_builds_block_masks_compiled(monkeypatch):
    """Eager create_block_mask evaluates the mask over the whole (B, 1, Q, KV) grid (a T^2 tensor:
    640 MiB at T = 8k, bench/long_context.py --mask-peak); compiled it does not. CUDA compiles it."""
    from specdraft.target import attention as documents

    built = []
    monkeypatch.setattr(documents, "_compiled_functions", {})
    monkeypatch.setattr(
        torch, "compile", lambda fn, **options: lambda *args, **kwargs: built.append((fn.__name__, options, kwargs))
    )
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):  # the flex path raises it
        documents.make_block_mask(lambda b, h, q, kv: q >= kv, 1, 8, 8, torch.device("cuda"))
    assert built == [("create_block_mask", {"backend": "inductor", "dynamic": False}, {"device": torch.device("cuda")})]
    assert documents.make_block_mask(lambda b, h, q, kv: q >= kv, 1, 8, 8, "cpu").shape == (1, 1, 8, 8)  # eager


# -- GLIDE: sliding window and lagged cross-attention -----------------------------------------------

GLIDE_CASES = [("window", w) for w in (1, 4, 7, 20, 64)] + [("lag", p) for p in (1, 2, 3, 5, 10)]


@pytest.mark.parametrize("kind, value", GLIDE_CASES)
def test_glide_slices_equal_the_rule_with_every_gradient(kind, value):
    """Windows shorter and longer than a conversation, lags up to past a whole one (its rows: zero)."""
    q, k, v = qkv(SHORT.shape[1])
    visible = glide_rule(SHORT, **{kind if kind == "window" else "lag": value})
    expected = masked_reference(q, k, v, visible)
    got = glide_attention(kind, value, SHORT)(q, k, v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind, value", [("window", 4), ("window", 20), ("lag", 2), ("lag", 10)])
def test_glide_dense_path_of_other_devices_equals_the_rule(monkeypatch, kind, value):
    force_path(monkeypatch, "dense")
    q, k, v = qkv(SHORT.shape[1])
    expected = masked_reference(q, k, v, glide_rule(SHORT, **{kind if kind == "window" else "lag": value}))
    torch.testing.assert_close(glide_attention(kind, value, SHORT)(q, k, v), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, value", [("window", 16), ("window", 200), ("lag", 1), ("lag", 3)])
def test_glide_flex_path_equals_the_rule_forward_without_a_dense_mask(monkeypatch, kind, value):
    q, k, v = (x.detach().float() for x in qkv(LONG.shape[1]))
    expected = masked_reference(q, k, v, glide_rule(LONG, **{kind if kind == "window" else "lag": value}))
    force_path(monkeypatch, "flex")  # what a CUDA device selects
    refuse_dense_masks(monkeypatch)
    calls = flex_spy(monkeypatch, layers)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        got = glide_attention(kind, value, LONG)(q, k, v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    T = LONG.shape[1]
    assert calls == [torch.Size([2, 1, T, T])]  # every lag at the same shapes (one compilation)


@pytest.mark.parametrize("kind, value", [("window", 4), ("lag", 2)])
def test_glide_slices_attend_each_conversation_alone(monkeypatch, kind, value):
    """One attention per conversation, none of them with a document mask or a (T, T) one."""
    refuse_dense_masks(monkeypatch)
    masks = mask_spy(monkeypatch)
    q, k, v = qkv(SHORT.shape[1])
    glide_attention(kind, value, SHORT)(q, k, v)
    if kind == "lag":  # is_causal per conversation longer than the lag (the 1-token one has no keys)
        assert masks == [None] * 4
    else:  # the window inside each: is_causal when it covers it, band / blocks when not
        assert len(masks) == 5 and all(m is None or m.shape[-1] < 2 * value + 1 for m in masks)


# -- DFlash: blocks over their conversation's context ----------------------------------------------

S = 4


def dflash_case(documents, anchors):
    anchors = torch.tensor(anchors)
    return BlockVisibility(anchors, documents.shape[1], S, document_starts(documents).gather(1, anchors))


# anchors sorted (as sampled): padding at 1, right after a border, at a conversation's last token
# (its block runs past the end), the one-token conversation (no context at all), a row without borders
SHORT_BLOCKS = [[1, 1, 2, 8, 9, 10, 22, 25], [1, 5, 6, 17, 20, 26, 27, 29]]
LONG_BLOCKS = [[1, 2, 50, 99, 100, 102, 130, 249, 251, 290], [1, 3, 64, 127, 128, 129, 200, 255, 256, 299]]


def dflash_rule(vis):
    """(B, 1, A S, T + A S): a slot of block j sees context start_j <= t < anchor_j and its own block."""
    B, A = vis.anchors.shape
    T = vis.context_len
    visible = torch.zeros(B, 1, A * S, T + A * S, dtype=torch.bool)
    for b in range(B):
        for j in range(A):
            rows = slice(j * S, (j + 1) * S)
            visible[b, 0, rows, int(vis.context_start[b, j]) : int(vis.anchors[b, j])] = True
            visible[b, 0, rows, T + j * S : T + (j + 1) * S] = True
    return visible


@pytest.mark.parametrize("anchors", [SHORT_BLOCKS, [[8, 1, 2, 1, 25, 9, 22, 10], [29, 5, 1, 6, 17, 20, 27, 26]]])
def test_dflash_slices_equal_the_rule_with_every_gradient(anchors):
    """Sampled anchors are sorted; unsorted ones (a conversation's blocks in several runs) too."""
    vis = dflash_case(SHORT, anchors)
    q, k, v = qkv(vis.query_len, SHORT.shape[1] + vis.query_len)
    expected = masked_reference(q, k, v, dflash_rule(vis))
    got = block_attention(q, k, v, vis)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_dflash_slices_mask_each_conversations_blocks_over_its_own_context(monkeypatch):
    """(its blocks) x (its context up to its last anchor + its blocks), never blocks x the row."""
    masks = mask_spy(monkeypatch)
    vis = dflash_case(SHORT, SHORT_BLOCKS)
    block_attention(*qkv(vis.query_len, SHORT.shape[1] + vis.query_len), vis)
    # row 0: conversation 0 (blocks at 1, 1, 2, 8), 1 (at 9: no context), 2 (10, 22), 3 (25, from 23)
    # row 1: one conversation, context up to its last anchor 29
    shapes = [tuple(m.shape[-2:]) for m in masks]
    assert shapes == [(16, 8 + 16), (4, 0 + 4), (8, 12 + 8), (4, 2 + 4), (32, 29 + 32)]


def test_dflash_dense_path_of_other_devices_equals_the_rule(monkeypatch):
    force_path(monkeypatch, "dense")
    vis = dflash_case(SHORT, SHORT_BLOCKS)
    q, k, v = qkv(vis.query_len, SHORT.shape[1] + vis.query_len)
    torch.testing.assert_close(block_attention(q, k, v, vis), masked_reference(q, k, v, dflash_rule(vis)))


def test_dflash_flex_path_equals_the_rule_forward_without_a_dense_mask(monkeypatch):
    vis = dflash_case(LONG, LONG_BLOCKS)
    q, k, v = (x.detach().float() for x in qkv(vis.query_len, LONG.shape[1] + vis.query_len))
    expected = masked_reference(q, k, v, dflash_rule(vis))
    force_path(monkeypatch, "flex")  # what a CUDA device selects
    refuse_dense_masks(monkeypatch)
    calls = flex_spy(monkeypatch, dflash_blocks)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = block_attention(q, k, v, vis)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([2, 1, vis.query_len, LONG.shape[1] + vis.query_len])]


# -- whole drafts: the slices path trains exactly as the dense one ---------------------------------


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=128, layers=4, max_positions=256, init=0.02)


@pytest.mark.parametrize(
    "family, keys, options",
    [
        ("glide", dict(sliding_window=4), dict(lag=2)),
        ("dflash", dict(num_layers=2, block_size=4, max_anchors=12), dict(anchor_seed=3)),
        ("dspark", dict(num_layers=2, block_size=4, max_anchors=12, markov_rank=8), dict(anchor_seed=3)),
    ],
)
def test_packed_training_on_cpu_equals_the_dense_path_with_every_gradient(monkeypatch, target, family, keys, options):
    draft = build_draft(OmegaConf.structured(DraftConfig(type=family, **keys)), target.config).double()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    ids = torch.randint(0, 128, SHORT.shape, generator=torch.Generator().manual_seed(5))
    feats = capture(target.model.double(), ids, torch.arange(ids.shape[1]).expand_as(ids), draft.capture_request())
    target.model.float()
    params = [p for p in draft.parameters() if p.requires_grad]

    def run():
        out = draft.training_loss(
            LossBatch(
                feats,
                target.lm_head.weight.double(),
                ids,
                torch.ones_like(ids),
                chunk_size=16,
                documents=SHORT,
                options=options,
            )
        )
        return out.loss, torch.autograd.grad(out.loss, params)

    loss, grads = run()
    force_path(monkeypatch, "dense")
    dense_loss, dense_grads = run()
    assert loss.item() > 0
    torch.testing.assert_close(loss, dense_loss, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip([(n, p) for n, p in draft.named_parameters() if p.requires_grad], grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
