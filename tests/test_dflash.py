"""DFlash block drafts: what a block position sees, what it predicts, the vectorised training pass
against a slow reference, training == inference, anchors, and the loss weights.

A tiny Llama target (hidden 64, 4 layers, vocab 128) on CPU; the default target layers of a
4-layer target are ids 1..4 (4 = the last layer's output), so every capture path is exercised.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf

import dflash_reference as reference
from helpers import random_llama
from specdraft.drafts.base import LossBatch
from specdraft.drafts import DraftConfig
from specdraft.drafts.dflash.model import DFlashDraft
from specdraft.drafts.dflash.options import default_target_layers
from specdraft.drafts.dflash.blocks import BlockLayout, BlockVisibility, loss_weights, sample_training_blocks
from specdraft.drafts.dflash.decode import DFlashDrafter
from specdraft.errors import SpecdraftError
from specdraft.target.capture import TargetFeatures, capture

torch.set_num_threads(1)
VOCAB, T = 128, 24


@pytest.fixture(scope="module")
def target():
    return random_llama(vocab=VOCAB, layers=4, max_positions=256, init=0.02)


def make_draft(target, **overrides):
    values = dict(type="dflash", num_layers=2, block_size=4, max_anchors=5)
    values.update(overrides)
    cfg = OmegaConf.structured(DraftConfig(**values))
    DFlashDraft.validate_config(cfg, target.config, "test", max_seq_length=T)
    draft = DFlashDraft.from_target_config(target.config, cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # realistic scales so every path carries signal
        for p in draft.parameters():
            p.copy_(
                torch.rand(p.shape, generator=generator) + 0.5
                if p.dim() == 1 and p is not draft.mask_delta
                else torch.randn(p.shape, generator=generator) * 0.2
            )
    return draft


def features(target, draft, ids):
    B, L = ids.shape
    return capture(target.model, ids, torch.arange(L).expand(B, L), draft.capture_request())


def hidden_at(draft, feats, anchors):
    """Vectorised training forward at given anchors (B, A) -> (B, A, S, H)."""
    blocks = sample_training_blocks(torch.zeros_like(anchors), torch.zeros_like(anchors), draft.layout, 1, 0)
    blocks.anchors, blocks.block_size = anchors, draft.layout.block_size
    return draft.training_hidden(feats, blocks)


# -- layer ids, layout ---------------------------------------------------------------------------


def test_default_target_layers_are_five_evenly_spaced_inputs_of_layers():
    assert default_target_layers(36) == [2, 10, 18, 26, 34]  # DFlash's outputs 1..33, +1
    assert default_target_layers(32) == [2, 9, 16, 23, 30]
    # too shallow: every layer a server captures (inputs of 1..L-1; never L, the last output)
    assert default_target_layers(4) == [1, 2, 3]
    assert default_target_layers(2) == [1]
    assert default_target_layers(1) == [0]


def test_a_speculators_export_of_the_last_layers_output_is_refused_and_not_a_default(tiny_target_dir):
    """vLLM captures the input of layer i < L only: a draft trained on layer L (allowed, native) is
    refused by the speculators writer in one line, and saves skip that format."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from specdraft.config import DraftConfig
    from specdraft.drafts.registry import build_draft
    from specdraft.errors import SpecdraftError

    config = AutoConfig.from_pretrained(tiny_target_dir)  # 2 layers
    cfg = OmegaConf.structured(DraftConfig(type="dflash", num_layers=1, block_size=4, target_layers=[1, 2]))
    draft = build_draft(cfg, config)
    assert draft.default_serving_formats() == [] and "no speculators export" in draft.describe()
    with pytest.raises(SpecdraftError, match="^draft.target_layers: layer 2 is the last layer's output, which vLLM"):
        draft.serving_formats["speculators"](draft, draft.state_dict(), "/nonexistent", str(tiny_target_dir))
    cfg.target_layers = [0, 1]
    assert build_draft(cfg, config).default_serving_formats() == ["speculators"]


@pytest.mark.parametrize("sample_from_anchor, first, predictions", [(False, 1, 3), (True, 0, 4)])
def test_block_layout_names_the_slot_of_each_prediction(sample_from_anchor, first, predictions):
    layout = BlockLayout(4, sample_from_anchor)
    assert (layout.first_slot, layout.predictions) == (first, predictions)


def test_validate_config_names_the_bad_key(target):
    base = dict(type="dflash")
    cases = {
        "target_layers": dict(target_layers=[1, 5]),
        "block_size": dict(block_size=1),
        "loss_decay_gamma": dict(loss_decay_gamma=0.0),
        "mask_token_id": dict(mask_token_id=VOCAB),
        "max_anchors": dict(max_anchors=0),
        "num_layers": dict(num_layers=0),
    }
    for key, bad in cases.items():
        cfg = OmegaConf.structured(DraftConfig(**base, **bad))
        with pytest.raises(SpecdraftError, match=f"draft.{key}"):
            DFlashDraft.validate_config(cfg, target.config, "cfg.yaml", max_seq_length=T)
    repeated = OmegaConf.structured(DraftConfig(type="dflash", target_layers=[2, 2]))
    with pytest.raises(SpecdraftError, match="repeats"):
        DFlashDraft.validate_config(repeated, target.config, "cfg.yaml", max_seq_length=T)
    with pytest.raises(SpecdraftError, match="draft.block_size.*max_seq_length"):
        DFlashDraft.validate_config(
            OmegaConf.structured(DraftConfig(type="dflash", block_size=8)), target.config, "cfg.yaml", max_seq_length=8
        )
    # without a readable target config, the checks that need it wait for training start
    DFlashDraft.validate_config(
        OmegaConf.structured(DraftConfig(type="dflash", target_layers=[99])), None, "cfg.yaml", max_seq_length=T
    )


# -- what a block position sees ------------------------------------------------------------------


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_no_block_position_sees_its_anchor_or_later_through_the_context(target, sample_from_anchor):
    draft = make_draft(target, sample_from_anchor=sample_from_anchor)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    feats = features(target, draft, ids)
    anchors = torch.tensor([[3, 9, 15]])
    base = hidden_at(draft, feats, anchors)
    for i, a in enumerate(anchors[0].tolist()):
        for changed_from, visible in ((a, False), (a - 1, True)):  # the exact boundary, both sides
            perturbed = {k: h.clone() for k, h in feats.hidden.items()}
            for h in perturbed.values():
                h[:, changed_from:] += torch.randn_like(h[:, changed_from:])
            out = hidden_at(draft, type(feats)(**{**feats.__dict__, "hidden": perturbed}), anchors)
            same = torch.allclose(out[0, i], base[0, i], rtol=0, atol=1e-6)
            assert same != visible, f"block at {a}: context from {changed_from} {'in' if visible else ''}visible"


def test_tokens_after_the_anchor_never_reach_its_block_through_the_target(target):
    """End to end through the real target: the label tokens themselves are invisible."""
    draft = make_draft(target)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([[6, 12]])
    base = hidden_at(draft, features(target, draft, ids), anchors)
    for i, a in enumerate(anchors[0].tolist()):
        later = ids.clone()
        later[0, a + 1 :] = (later[0, a + 1 :] + 5) % VOCAB
        torch.testing.assert_close(
            hidden_at(draft, features(target, draft, later), anchors)[0, i], base[0, i], rtol=0, atol=1e-6
        )
        for changed in (a, a - 1):  # the anchor (through the block) and the last context token
            other = ids.clone()
            other[0, changed] = (other[0, changed] + 5) % VOCAB
            assert not torch.allclose(hidden_at(draft, features(target, draft, other), anchors)[0, i], base[0, i])


def test_blocks_see_their_whole_block_and_no_other_block(target):
    draft = make_draft(target)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(4))
    feats = features(target, draft, ids)
    anchors = torch.tensor([[5, 10]])
    base = hidden_at(draft, feats, anchors)
    embeds = feats.input_embeds.clone()
    embeds[0, 10] += 1.0  # only block 1's anchor slot reads this
    out = hidden_at(draft, type(feats)(**{**feats.__dict__, "input_embeds": embeds}), anchors)
    torch.testing.assert_close(out[0, 0], base[0, 0], rtol=0, atol=1e-6)
    # bidirectional: every slot of block 1, the ones before... all slots change
    for s in range(draft.layout.block_size):
        assert not torch.allclose(out[0, 1, s], base[0, 1, s])


def test_dense_mask_and_flex_block_mask_agree(target):
    """One rule, two forms: the CPU SDPA path's dense mask and the GPU path's BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    anchors = torch.tensor([[1, 4, 9], [2, 3, 11]])
    vis = BlockVisibility(anchors, context_len=14, block_size=4)
    dense = vis.dense()[:, 0]
    q_len, kv_len = vis.query_len, 14 + vis.query_len
    for b in range(2):  # the rule, spelled out
        for q in range(q_len):
            a = anchors[b, q // 4]
            expect = [(kv < a) if kv < 14 else ((kv - 14) // 4 == q // 4) for kv in range(kv_len)]
            assert dense[b, q].tolist() == [bool(e) for e in expect]
    q = torch.randn(2, 4, q_len, 16)
    k, v = torch.randn(2, 2, kv_len, 16), torch.randn(2, 2, kv_len, 16)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=True)
    flex = flex_attention(q, k, v, block_mask=vis.block_mask(), enable_gqa=True)  # forward runs on CPU
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


# -- the vectorised training pass against the slow reference --------------------------------------


def rotary_of(target):
    def rotary(position):
        cos, sin = target.model.rotary_emb(torch.zeros(1, 1, 64), torch.tensor([[position]]))
        return cos[0, 0], sin[0, 0]

    return rotary


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_vectorised_forward_loss_and_grads_equal_the_reference(target, sample_from_anchor):
    draft = make_draft(target, sample_from_anchor=sample_from_anchor, train_mask_embedding=True, max_anchors=14)
    with torch.no_grad():
        draft.mask_delta.normal_(0, 0.3)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, T), generator=generator)
    loss_mask = (torch.rand(2, T, generator=generator) > 0.4).long()
    feats = features(target, draft, ids)
    lm_head = target.lm_head.weight
    blocks = draft.training_blocks(ids, loss_mask, anchor_seed=11)
    assert blocks.valid.any() and not blocks.valid.all()  # padding anchors are in the batch too

    out = draft.training_loss(LossBatch(feats, lm_head, ids, loss_mask, chunk_size=7, options={"anchor_seed": 11}))
    grads = torch.autograd.grad(out.loss, [p for p in draft.parameters()])

    total, count = torch.zeros(()), 0
    hidden = draft.training_hidden(feats, blocks)
    for b in range(2):
        row_hidden = {k: h[b] for k, h in feats.hidden.items()}
        for i, (a, ok) in enumerate(zip(blocks.anchors[b].tolist(), blocks.valid[b].tolist())):
            ref = reference.block_hidden(
                draft, row_hidden, feats.input_embeds[b], feats.token_embeds[0], rotary_of(target), a
            )
            torch.testing.assert_close(hidden[b, i], ref, rtol=1e-4, atol=1e-5)
        row_total, row_count = reference.loss(
            draft,
            row_hidden,
            feats.input_embeds[b],
            feats.token_embeds[0],
            rotary_of(target),
            lm_head,
            ids[b],
            loss_mask[b],
            blocks.anchors[b],
            blocks.valid[b],
        )
        total, count = total + row_total, count + row_count
    assert int(out.tokens) == count > 0
    ref_loss = total / count
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_grads = torch.autograd.grad(ref_loss, [p for p in draft.parameters()])
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    assert all(float(g.abs().sum()) > 0 for g in grads)  # every parameter, mask_delta included, learns


# -- anchors and labels ---------------------------------------------------------------------------


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_anchors_are_distinct_candidates_and_labels_are_the_next_tokens(sample_from_anchor):
    layout = BlockLayout(4, sample_from_anchor)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (4, 30), generator=generator)
    loss_mask = (torch.rand(4, 30, generator=generator) > 0.5).long()
    loss_mask[2] = 0
    loss_mask[2, 8] = 1  # one candidate only: anchor 7
    loss_mask[3] = 0
    loss_mask[3, 1] = 1  # would be anchor 0's first label: no context, so no candidate at all
    blocks = sample_training_blocks(ids, loss_mask, layout, max_anchors=6, seed=3)
    again = sample_training_blocks(ids, loss_mask, layout, max_anchors=6, seed=3)
    assert torch.equal(blocks.anchors, again.anchors)  # a pure function of the seed
    assert not torch.equal(blocks.anchors, sample_training_blocks(ids, loss_mask, layout, 6, seed=4).anchors)
    for b in range(4):
        chosen = blocks.anchors[b][blocks.valid[b]].tolist()
        candidates = [a for a in range(1, 30 - layout.span) if loss_mask[b, a + 1]]
        assert len(set(chosen)) == len(chosen) == min(6, len(candidates))
        assert set(chosen) <= set(candidates)
        for i, a in enumerate(blocks.anchors[b].tolist()):
            for j in range(layout.predictions):
                assert blocks.labels[b, i, j] == ids[b, a + 1 + j]
                assert blocks.counted[b, i, j] == (bool(loss_mask[b, a + 1 + j]) and bool(blocks.valid[b, i]))
    assert blocks.anchors[2][blocks.valid[2]].tolist() == [7]
    assert not blocks.valid[3].any() and not blocks.counted[3].any()


def test_each_sp_rank_takes_its_valid_blocks_and_not_the_samplers_padding():
    """Sequence parallelism: a rank trains the valid blocks anchored in its shard. The sampler pads
    a row with few candidates with invalid anchors at position 1 (a static A); those are dropped,
    not given to the first rank, which would otherwise run min(max_anchors, T) blocks."""
    from specdraft.drafts.dflash.blocks import own_blocks
    from specdraft.parallel.sequence import SequenceShard

    layout = BlockLayout(4, False)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, [6, 9, 25, 31]] = 1  # candidates 5, 8 (rank 0) and 24, 30 (rank 1)
    loss_mask[1, [27, 33]] = 1  # candidates 26, 32: rank 1 only
    blocks = sample_training_blocks(ids, loss_mask, layout, max_anchors=30, seed=0)
    assert blocks.anchors.shape[1] == 30 and int(blocks.valid.sum()) == 6  # 24 padding blocks
    first, second = (own_blocks(blocks, SequenceShard(None, 2, rank, 40)) for rank in (0, 1))
    assert first.anchors[0].tolist() == [5, 8] and first.valid.tolist() == [[True, True], [False, False]]
    assert second.anchors.tolist() == [[24, 30], [26, 32]] and bool(second.valid.all())
    assert not first.counted[1].any()  # its second row's blocks are padding: anchored at 0, counting nothing
    assert first.anchors[1].tolist() == [0, 0]
    fixed = own_blocks(blocks, SequenceShard(None, 2, 1, 40), static=True)  # compiled flex: the sampler's A, always
    assert fixed.anchors.shape == (2, 30) and fixed.anchors[:, :2].tolist() == [[24, 30], [26, 32]]
    assert not fixed.valid[:, 2:].any() and not fixed.counted[:, 2:].any() and bool((fixed.anchors[:, 2:] == 20).all())


def test_packed_conversations_keep_each_blocks_labels_in_its_anchors_conversation():
    """Every token a label (distill_tokens: all), two conversations per row: an anchor whose first
    label starts the next conversation, or with no context in its own, is no candidate; later
    labels across the border are not counted; each block's context starts with its conversation."""
    layout = BlockLayout(4, False)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(2))
    documents = torch.zeros(2, 30, dtype=torch.long)
    documents[:, 12:] = 1
    everything = torch.ones_like(ids)
    blocks = sample_training_blocks(ids, everything, layout, max_anchors=40, seed=0, documents=documents)
    for b in range(2):
        chosen = blocks.anchors[b][blocks.valid[b]].tolist()
        assert chosen == [a for a in range(1, 30 - layout.span) if a not in (11, 12)]
        assert blocks.context_start[b][blocks.valid[b]].tolist() == [0 if a < 12 else 12 for a in chosen]
        for i, a in enumerate(blocks.anchors[b].tolist()):
            for j in range(layout.predictions):
                same = bool(documents[b, a + 1 + j] == documents[b, a])
                assert blocks.counted[b, i, j] == (same and bool(blocks.valid[b, i]))
    assert blocks.counted.sum() < sample_training_blocks(ids, everything, layout, 40, seed=0).counted.sum()


def test_a_sequence_too_short_for_a_block_gives_a_zero_loss_with_a_graph(target):
    draft = make_draft(target, block_size=4)
    ids = torch.randint(0, VOCAB, (1, 4))
    out = draft.training_loss(
        LossBatch(features(target, draft, ids), target.lm_head.weight, ids, torch.ones_like(ids), 8)
    )
    assert float(out.loss.detach()) == 0.0 and int(out.tokens) == 0
    assert set(out.metrics) == {f"block_{j}/{name}" for j in (1, 2, 3) for name in ("loss", "accuracy")}
    out.loss.backward()


def test_loss_weights_decay_from_the_first_prediction():
    for flag in (False, True):
        weights = loss_weights(BlockLayout(8, flag), gamma=4.0)
        expected = [math.exp(-j / 4.0) for j in range(7 if not flag else 8)]
        assert weights == pytest.approx(expected, rel=1e-15)


# -- training == inference ------------------------------------------------------------------------


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_inference_block_equals_the_training_block_at_the_same_anchor(target, sample_from_anchor):
    """The drafter feeds [x_n, MASK...] at n.. over context < n: exactly a training block at anchor n,
    and its j-th prediction is the slot training labels with the token at n + 1 + j."""
    draft = make_draft(target, sample_from_anchor=sample_from_anchor, train_mask_embedding=True).eval()
    with torch.no_grad():
        draft.mask_delta.normal_(0, 0.3)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(7))
    feats = features(target, draft, ids)
    anchors = torch.tensor([[4, 11, 17]])
    train_logits = draft.head_logits(hidden_at(draft, feats, anchors), target.lm_head.weight)
    drafter = DFlashDrafter(draft, target)
    for i, n in enumerate(anchors[0].tolist()):
        drafter.start()
        drafter.observe_target({k: h[0, :n] for k, h in feats.hidden.items()}, 0)
        block = drafter.block_logits(int(ids[0, n]), n)
        torch.testing.assert_close(block, train_logits[0, i], rtol=1e-5, atol=1e-5)
        # the drafter's j-th proposal is read from the slot training labels with ids[n + 1 + j]
        first = draft.layout.first_slot
        torch.testing.assert_close(
            drafter.predictions(int(ids[0, n]), n), train_logits[0, i, first:], rtol=1e-5, atol=1e-5
        )


def test_context_fed_in_pieces_equals_context_fed_at_once(target):
    draft = make_draft(target).eval()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(8))
    feats = features(target, draft, ids)
    whole, pieces = DFlashDrafter(draft, target), DFlashDrafter(draft, target)
    whole.observe_target({k: h[0, :15] for k, h in feats.hidden.items()}, 0)
    for start, end in ((0, 6), (6, 7), (7, 15)):
        pieces.observe_target({k: h[0, start:end] for k, h in feats.hidden.items()}, start)
    torch.testing.assert_close(pieces.block_logits(int(ids[0, 15]), 15), whole.block_logits(int(ids[0, 15]), 15))
    pieces.rollback(9)  # a rejection: context beyond 9 forgotten, then re-fed
    pieces.observe_target({k: h[0, 9:15] for k, h in feats.hidden.items()}, 9)
    torch.testing.assert_close(pieces.block_logits(int(ids[0, 15]), 15), whole.block_logits(int(ids[0, 15]), 15))


class _Cache:  # stands in for the target's DynamicCache: the drafter reads only its length
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_one_block_gives_the_chain_and_the_tree(target, sample_from_anchor):
    """Chain: proposal j is slot j's pick; tree: depth d + 1 holds slot d's best tokens, ranked by
    the summed slot log-probs (the block predicts its positions jointly, one forward for all)."""
    draft = make_draft(target, sample_from_anchor=sample_from_anchor).eval()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(9))
    feats = features(target, draft, ids)
    n = 10
    drafter = DFlashDrafter(draft, target)
    drafter.observe_target({k: h[0, :n] for k, h in feats.hidden.items()}, 0)
    slots = drafter.predictions(int(ids[0, n]), n)  # (P, V)
    greedy = drafter.propose_chain(ids[0, : n + 1], _Cache(n), gamma=10, temperature=0.0, generator=None)
    assert greedy.tokens.tolist() == slots.argmax(-1).tolist()  # gamma beyond the block: P tokens
    short = drafter.propose_chain(ids[0, : n + 1], _Cache(n), gamma=2, temperature=0.0, generator=None)
    assert short.tokens.tolist() == slots.argmax(-1)[:2].tolist()
    sampled = drafter.propose_chain(
        ids[0, : n + 1], _Cache(n), gamma=3, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(sampled.q, torch.softmax(slots[:3], dim=-1))  # each token's own q
    tree = drafter.propose_tree(ids[0, : n + 1], _Cache(n), widths=[3, 2, 2])
    logprobs = torch.log_softmax(slots, dim=-1)
    depth = tree.depth
    assert tree.tokens[depth == 1].tolist() == logprobs[0].topk(3).indices.tolist()
    for node in range(len(tree)):  # each node's score is the sum of its path's slot log-probs
        path, i = [], node
        while i >= 0:
            path.append(int(tree.tokens[i]))
            i = int(tree.parents[i])
        path.reverse()
        expected = sum(float(logprobs[d, t]) for d, t in enumerate(path))
        assert float(tree.scores[node]) == pytest.approx(expected, abs=1e-5)
    chain_tree = drafter.propose_tree(ids[0, : n + 1], _Cache(n), widths=[1] * 10)
    assert chain_tree.is_chain and chain_tree.tokens.tolist() == slots.argmax(-1).tolist()


# -- draft.loss: distillation for block drafts ------------------------------------------------------


@pytest.mark.parametrize("distill_tokens", ["answers", "all"])
def test_objectives_take_the_targets_distribution_at_anchor_plus_j_as_teacher(target, distill_tokens):
    """Prediction j of a block (the token at anchor + 1 + j) is taught by the target's own
    distribution at anchor + j; each j's term weighs exp(-j / gamma), all over the counted labels.
    'all': anchors and labels among every token; KL over all of slot j's labels, CE the mean over
    its answer labels standing for all of them."""
    import torch.nn.functional as F

    from specdraft.train.model import TargetWithDraft

    draft = make_draft(target, loss="0.7*kl + 0.3*ce", distill_temperature=0.5, distill_tokens=distill_tokens)
    assert draft.capture_request().final_hidden and not make_draft(target).capture_request().final_hidden
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    mask = (torch.rand(2, T, generator=torch.Generator().manual_seed(6)) < 0.8).long()
    options = draft.sample_batch_options(torch.Generator().manual_seed(7), T)
    out = TargetWithDraft(target, draft, loss_chunk_size=3)(ids, mask, **options)
    grads = torch.autograd.grad(out.loss, [p for p in draft.parameters() if p.requires_grad])

    feats = features(target, draft, ids)
    taught = mask if distill_tokens == "answers" else torch.ones_like(mask)
    blocks = draft.training_blocks(ids, taught, options["anchor_seed"])
    label_is_answer = mask.gather(1, blocks.label_positions.flatten(1)).view_as(blocks.counted).bool()
    assert (distill_tokens == "all") == bool((blocks.counted & ~label_is_answer).any())
    hidden = draft.training_hidden(feats, blocks)
    full = target(ids).logits  # (B, T, V) from a plain forward
    ref, tokens = 0.0, 0
    for j in range(draft.layout.predictions):
        counted = blocks.counted[..., j]
        answer = label_is_answer[..., j][counted]
        z = (hidden[:, :, draft.layout.first_slot + j] @ target.lm_head.weight.t())[counted]
        t = full.gather(1, (blocks.anchors + j)[..., None].expand(-1, -1, VOCAB))[counted]
        kl = F.kl_div(F.log_softmax(z / 0.5, -1), F.log_softmax(t / 0.5, -1), log_target=True, reduction="sum")
        ce = F.cross_entropy(z[answer], blocks.labels[..., j][counted][answer], reduction="sum")
        ref = ref + math.exp(-j / draft.dims.loss_decay_gamma) * (0.7 * kl + 0.3 * ce * len(answer) / answer.sum())
        tokens += int(counted.sum())
    ref = ref / tokens
    ref_grads = torch.autograd.grad(ref, [p for p in draft.parameters() if p.requires_grad])
    assert int(out.tokens) == tokens > 0
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert {"objective/kl", "objective/ce"} <= set(out.metrics)


def packed_features(target, parts):
    """The features of conversations packed in one row, as the document mask gives them: each
    conversation's own pass, its positions from 0."""
    cat = lambda name: torch.cat([getattr(p, name) for p in parts], 1)  # noqa: E731
    embeds = cat("input_embeds")
    return TargetFeatures(
        input_embeds=embeds,
        cos=cat("cos"),
        sin=cat("sin"),
        hidden={layer: torch.cat([p.hidden[layer] for p in parts], 1) for layer in parts[0].hidden},
        token_embeds=parts[0].token_embeds,
        position_ids=cat("position_ids"),
        rotary=lambda positions: target.model.rotary_emb(embeds, positions),
    )


def test_a_block_crossing_into_the_next_conversation_keeps_its_own_positions(target):
    """Slot s of a block sits at its anchor's position in the anchor's conversation + s, also
    where token anchor + s belongs to the next packed conversation (whose positions restart at 0):
    the block computes what it computes on its conversation alone, continued by any tokens."""
    draft = make_draft(target)  # block_size 4
    first, second = 10, 16
    ids = torch.randint(0, VOCAB, (1, first + second), generator=torch.Generator().manual_seed(9))
    packed = packed_features(target, [features(target, draft, ids[:, :first]), features(target, draft, ids[:, first:])])
    documents = torch.zeros_like(ids)
    documents[:, first:] = 1
    blocks = sample_training_blocks(ids, torch.ones_like(ids), draft.layout, 40, 0, documents=documents)
    anchors = blocks.anchors[0].tolist()
    crossing, inside = anchors.index(first - 2), anchors.index(first + 3)  # labels first-1 | first, first+1
    asked, rotary = [], packed.rotary
    packed.rotary = lambda positions: (asked.append(positions.clone()), rotary(positions))[1]
    got = draft.training_hidden(packed, blocks)[0]
    continued = torch.cat(
        [ids[:, :first], torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(3))], 1
    )
    want = hidden_at(draft, features(target, draft, continued), torch.tensor([[first - 2]]))[0, 0]
    torch.testing.assert_close(got[crossing], want, rtol=1e-5, atol=1e-5)
    slots = asked[0].view(len(anchors), 4)
    assert slots[crossing].tolist() == [8, 9, 10, 11]  # not [8, 9, 0, 1]
    assert slots[inside].tolist() == [3, 4, 5, 6]  # the second conversation's own positions


def test_a_block_of_packed_data_computes_what_its_conversation_alone_computes(target):
    """Two conversations packed in one row, the target's features as its document mask gives them
    (each conversation's own pass, positions from 0): a block anchored in the second sees none of
    the first, so its hidden states equal those of the second conversation trained alone."""
    draft = make_draft(target)
    first, second = 10, 16
    ids = torch.randint(0, VOCAB, (1, first + second), generator=torch.Generator().manual_seed(9))
    parts = [features(target, draft, ids[:, :first]), features(target, draft, ids[:, first:])]
    packed = packed_features(target, parts)
    documents = torch.zeros_like(ids)
    documents[:, first:] = 1
    blocks = sample_training_blocks(ids, torch.ones_like(ids), draft.layout, 40, 0, documents=documents)
    alone = sample_training_blocks(ids[:, first:], torch.ones_like(ids[:, first:]), draft.layout, 40, 0)
    in_second = blocks.anchors[0] >= first
    assert (blocks.anchors[0][in_second] - first).tolist() == alone.anchors[0][alone.valid[0]].tolist()
    got = draft.training_hidden(packed, blocks)[0][in_second]
    want = draft.training_hidden(parts[1], alone)[0][alone.valid[0]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
