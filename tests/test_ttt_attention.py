"""EAGLE-3's TTT attention without the (T, (k+1) T) mask equals the dense-mask reference."""

import warnings

import pytest
import torch

from specdraft.drafts.eagle3.model import ttt_visibility
from specdraft.drafts.layers import attend
from specdraft.drafts.eagle3.ttt_attention import ttt_attention


def dense_reference(q, keys, values, documents):
    step = len(keys) - 1
    visible = ttt_visibility(q.shape[2], step, q.device, documents)
    return attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), visible)


def inputs(step, heads, kv_heads, documents, seed=0, T=11, D=8, B=2):
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(B, heads, T, D, generator=g, dtype=torch.float64)).requires_grad_()
    keys = [
        (3 * torch.randn(B, kv_heads, T, D, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(step + 1)
    ]
    values = [
        torch.randn(B, kv_heads, T, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(step + 1)
    ]
    docs = None
    if documents:
        docs = torch.tensor([[0] * 4 + [1] * 5 + [2] * 2, [0] * T])
    return q, keys, values, docs


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_equals_the_dense_mask_with_every_gradient(step, heads, kv_heads, documents):
    q, keys, values, docs = inputs(step, heads, kv_heads, documents)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [q, *keys, *values]

    expected = dense_reference(q, keys, values, docs)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    got = ttt_attention(q, keys, values, docs)
    got_grads = torch.autograd.grad(got, leaves, grad)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(
        ["q"] + [f"k{i}" for i in range(step + 1)] + [f"v{i}" for i in range(step + 1)], got_grads, expected_grads
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_a_query_sees_the_diagonal_of_later_steps_and_no_other_position():
    """Pin the visibility itself: changing a step-1 key at position s moves query t's output only
    when s == t; changing a step-0 key at s moves it only when s <= t."""
    step, T = 2, 7
    q, keys, values, _ = inputs(step, 2, 2, False, T=T)
    q, keys, values = q.detach(), [k.detach() for k in keys], [v.detach() for v in values]
    base = ttt_attention(q, keys, values)
    for which, rule in ((0, lambda s, t: s <= t), (1, lambda s, t: s == t), (2, lambda s, t: s == t)):
        for s in range(T):
            moved = [v.clone() for v in values]
            moved[which][:, :, s] += 10.0
            changed = (ttt_attention(q, keys, moved) - base).abs().amax(dim=(0, 1, 3)) > 1e-9  # (T,)
            assert changed.tolist() == [rule(s, t) for t in range(T)], (which, s)


def test_float32_large_scores_stay_exact():
    q, keys, values, _ = inputs(3, 4, 2, False, seed=3)
    q32 = (q.detach() * 4).float()
    k32 = [k.detach().float() * 4 for k in keys]
    v32 = [v.detach().float() for v in values]
    torch.testing.assert_close(ttt_attention(q32, k32, v32), dense_reference(q32, k32, v32, None), rtol=1e-5, atol=1e-5)


def test_packed_rows_attend_per_conversation_on_cpu_without_a_square_mask(monkeypatch):
    """CPU runs one causal SDPA per conversation: no call gets a mask, and the borders are the
    documents' (a slice across a border would change the result, caught by the equality test)."""
    import torch.nn.functional as F

    from specdraft.target.attention import PackedDocuments

    q, keys, values, docs = inputs(3, 4, 2, True)
    packed = PackedDocuments.of(docs)
    assert packed.segments == [[(0, 4), (4, 9), (9, 11)], [(0, 11)]]
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    expected = dense_reference(q, keys, values, docs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.testing.assert_close(ttt_attention(q, keys, values, packed), expected)
    assert len(masks) == 4 and masks == [None] * 4  # 3 conversations in row 0, 1 in row 1


@pytest.mark.parametrize("step", [0, 2])
def test_the_dense_path_of_other_devices_equals_the_reference(step):
    """Meta (the device tests' stand-in) has no borders to read: the dense mask, same result."""
    from specdraft.target.attention import PackedDocuments

    q, keys, values, docs = inputs(step, 4, 2, True)
    got = ttt_attention(q, keys, values, PackedDocuments(docs))  # neither segments nor a block mask
    torch.testing.assert_close(got, dense_reference(q, keys, values, docs))


@pytest.mark.parametrize("step", [0, 1, 3])
def test_the_flex_path_of_cuda_equals_the_reference_forward(step):
    """flex_attention has no backward on CPU (torch 2.13): its forward is checked here, in eager
    mode; the gradients run on a GPU only (the log-sum-exp merge is differentiable there)."""
    from specdraft.target.attention import PackedDocuments, document_block_mask

    q, keys, values, _ = inputs(step, 4, 2, False, T=160)  # > one 128-token block
    docs = torch.tensor([[0] * 50 + [1] * 100 + [2] * 10, [0] * 160])
    q, keys, values = q.detach().float(), [k.detach().float() for k in keys], [v.detach().float() for v in values]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is not compiled
        got = ttt_attention(q, keys, values, PackedDocuments(docs, block_mask=document_block_mask(docs)))
    torch.testing.assert_close(got, dense_reference(q, keys, values, docs), rtol=1e-4, atol=1e-4)
