"""P-EAGLE's slot attention without its (N, N) mask (drafts/peagle/cod_attention.py) equals SDPA under
cod_visibility's dense mask: values and gradients, with packed conversations whose borders cut
through the rollouts, GQA, and slot sets that are not in COD's order (the dense path serves)."""

import pytest
import torch
import torch.nn.functional as F

from specdraft.drafts.peagle.cod_attention import CODSlots, cod_attention
from specdraft.drafts.peagle.cod import cod_anchors, cod_sample_batch, cod_visibility, slot_order


def slots_of(T, seed, documents=None):
    valid = torch.rand(T, generator=torch.Generator().manual_seed(seed)) > 0.2
    valid[-2:] = False
    if documents is not None:  # a slot predicts a token of its own conversation
        valid[:-2] &= documents[2:] == documents[:-2]
    return cod_anchors(valid, 6, 0.7, 0.2, torch.Generator().manual_seed(seed))


def dense(q, k, v, anchor, depth, documents):
    visible = cod_visibility(anchor, depth, documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("packed", [False, True])
def test_slot_attention_equals_the_dense_mask_values_and_gradients(packed):
    T, Hq, Hkv, D = 96, 4, 2, 8
    documents = torch.repeat_interleave(torch.arange(4), torch.tensor([17, 30, 1, 48])) if packed else None
    by_depth = slots_of(T, 3, documents)
    anchor, depth = slot_order(by_depth)
    assert int(depth.max()) == 5 and anchor.numel() > 2 * T  # every depth drawn, the slots outnumber T
    slots = CODSlots.of(by_depth, "cpu", documents)
    assert slots.positions == T and slots.depth_rows[0] == (T, T + by_depth[1].numel())
    generator = torch.Generator().manual_seed(0)
    N = anchor.numel()
    q, k, v = (
        torch.randn(1, h, N, D, generator=generator, dtype=torch.float64).requires_grad_() for h in (Hq, Hkv, Hkv)
    )
    ours = cod_attention(q, k, v, slots)
    theirs = dense(q, k, v, anchor, depth, documents)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    weights = torch.randn(ours.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((ours * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((theirs * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_batch_of_slots_with_padding_equals_each_rows_dense_mask_values_and_gradients():
    """Training's layout (cod_sample_batch: B rows, each depth in places fixed by T, padding
    anchored at T): each row's drawn slots get what SDPA under that row's own dense mask gives,
    and the padding neither reaches a drawn slot nor receives a gradient."""
    B, T, Hq, Hkv, D = 3, 48, 4, 2, 8
    documents = torch.tensor([[0] * 48, [0] * 20 + [1] * 28, [0] * 3 + [1] * 40 + [2] * 5])
    valid = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) > 0.2
    valid[:, -2:] = False
    valid[:, :-2] &= documents[:, 2:] == documents[:, :-2]
    slots = cod_sample_batch(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(2))
    assert (~slots.drawn).any(dim=1).all()  # every row has padding
    generator = torch.Generator().manual_seed(0)
    N = slots.anchor.shape[1]
    q, k, v = (
        torch.randn(B, h, N, D, generator=generator, dtype=torch.float64).requires_grad_() for h in (Hq, Hkv, Hkv)
    )
    ours = cod_attention(q, k, v, CODSlots.of_batch(slots.anchor, slots.sizes, documents))
    weights = torch.randn(ours.shape, generator=generator, dtype=torch.float64) * slots.drawn[:, None, :, None]
    grads = torch.autograd.grad((ours * weights).sum(), (q, k, v))
    for b in range(B):
        drawn = slots.drawn[b]
        rows = [x[b : b + 1, :, drawn].detach().requires_grad_() for x in (q, k, v)]
        theirs = dense(*rows, slots.anchor[b, drawn], slots.depth[drawn], documents[b])
        torch.testing.assert_close(ours[b : b + 1, :, drawn], theirs, rtol=1e-9, atol=1e-9)
        expected = torch.autograd.grad((theirs * weights[b : b + 1, :, drawn]).sum(), rows)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got[b : b + 1, :, drawn], want, rtol=1e-9, atol=1e-9)
            assert not got[b, :, ~drawn].any()


def test_cods_anchors_are_sorted_subsets_depth_by_depth():
    """What cod_attention relies on: depth 0 is every position; each later depth's anchors are
    sorted, distinct, and a subset of the depth before's (its rollout's keys exist)."""
    for seed in range(5):
        by_depth = slots_of(120, seed)
        assert torch.equal(by_depth[0], torch.arange(120)) and len(by_depth) == 6
        for shallower, deeper in zip(by_depth, by_depth[1:]):
            assert torch.equal(deeper, deeper.unique(sorted=True)) and torch.isin(deeper, shallower).all()


def test_the_peagle_training_step_builds_no_slot_mask(monkeypatch):
    """A P-EAGLE training step (capture, slots, loss, backward) never builds cod_visibility's
    (N, N) mask: its slots come from COD and attend through cod_attention."""
    from specdraft.drafts.peagle import model as peagle_model
    from specdraft.train.model import TargetWithDraft
    from test_eagle3 import llama
    from test_peagle import peagle_for

    target = llama(layers=4, vocab=64).eval().requires_grad_(False)
    draft = peagle_for(target)
    model = TargetWithDraft(target, draft, loss_chunk_size=16)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(peagle_model, "cod_visibility", lambda *a: pytest.fail("an (N, N) slot mask was built"))
    out = model(ids, torch.ones_like(ids), **draft.sample_batch_options(torch.Generator().manual_seed(0), 40))
    out.loss.backward()
    assert int(out.tokens) > 2 * 2 * 38  # depth 0's 2 x 38 slots and the deeper ones were counted
