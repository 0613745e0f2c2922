"""P-EAGLE: COD sampling as speculators' generate_cod_sample_indices, the slot visibility as its
create_peagle_mask_mod, the one-forward drafter against the training forward, and the real
trainer (loss falls, per-depth metrics, export, lossless eval in chain and tree)."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from helpers import run_overrides, train_run
from speculators_env import run_in_speculators
from specdraft.config import load_config
from specdraft.drafts import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts.peagle.cod import cod_anchors, cod_capacity, cod_sample, cod_sample_batch, cod_visibility
from specdraft.drafts.peagle.model import PEagleDraft
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.commands.evaluate import evaluate
from specdraft.target.capture import capture
from specdraft.export.files import load_exported_draft
from test_eagle3 import llama

PEAGLE = {"draft.type": "peagle", "draft.num_depths": 4, "draft.mask_token_id": 3}


def test_cod_sample_sizes_and_chains():
    """Depth d keeps int((|valid| - d) * max(r^d, r_min)) slots, each the next position of a depth
    d-1 survivor of the same anchor, all valid; depth 0 is every position."""
    T = 200
    valid = torch.ones(T, dtype=torch.bool)
    valid[:30] = False
    valid[120:125] = False
    anchor, depth = cod_sample(valid, 8, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(anchor[depth == 0], torch.arange(T))
    n_valid = int(valid.sum())
    survivors = {(a, 0) for a in range(T) if valid[a]}
    for d in range(1, 8):
        at = anchor[depth == d]
        expected = int((n_valid - d) * max(0.7**d, 0.2))
        assert at.numel() <= expected and (at.numel() == expected or d > 1)
        assert torch.equal(at, at.sort().values)
        for a in at.tolist():
            assert valid[a + d] and (a, d - 1) in survivors or d == 1
        survivors = {(a, d) for a in at.tolist()}
    assert int((depth == 1).sum()) == int((n_valid - 1) * 0.7)


SPECULATORS_COD = r"""
import json, sys, torch
from speculators.models.peagle.data import generate_cod_sample_indices
from speculators.models.peagle.attention import create_peagle_mask_mod
mask = torch.zeros(1, 300); mask[0, 40:260] = 1
torch.manual_seed(0)
anchor, depth = generate_cod_sample_indices(300, mask, 8, 0.7, 0.2)
counts = [int((depth == d).sum()) for d in range(8)]
fn = create_peagle_mask_mod(anchor, depth, torch.zeros(300, dtype=torch.long))
n = anchor.numel()
q = torch.arange(n)[:, None].expand(n, n); k = torch.arange(n)[None, :].expand(n, n)
vis = fn(0, 0, q, k)
print(json.dumps({"counts": counts, "anchor": anchor.tolist(), "depth": depth.tolist(), "visible": vis.nonzero().tolist()}))
"""


def test_sizes_and_visibility_equal_speculators():
    """On the same valid positions, speculators' sampler keeps as many slots per depth as ours, and
    its mask_mod over its own slots equals cod_visibility."""
    report = run_in_speculators(SPECULATORS_COD)
    valid = torch.zeros(300, dtype=torch.bool)
    valid[40:260] = True
    anchor, depth = cod_sample(valid, 8, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert [int((depth == d).sum()) for d in range(8)] == report["counts"]
    theirs_anchor, theirs_depth = torch.tensor(report["anchor"]), torch.tensor(report["depth"])
    ours = cod_visibility(theirs_anchor, theirs_depth).nonzero().tolist()
    assert ours == report["visible"]


def test_the_same_seed_draws_the_same_slots_and_another_does_not():
    valid = torch.rand(64, generator=torch.Generator().manual_seed(1)) > 0.3
    one = cod_sample(valid, 6, 0.7, 0.2, torch.Generator().manual_seed(5))
    two = cod_sample(valid, 6, 0.7, 0.2, torch.Generator().manual_seed(5))
    other = cod_sample(valid, 6, 0.7, 0.2, torch.Generator().manual_seed(6))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert not torch.equal(one[0], other[0])


def assert_cod_rule(valid, slots, K, r, r_min):
    """Every row of a CODBatch against COD's rule (cod.py), row by row on the host: depth 0 every
    position; depth d's slots first in its places, increasing, then padding (anchor T, not drawn);
    a slot at position o = anchor + d lies in the pool (depth 1: the valid positions >= 1; then
    the depth d-1 slots' o + 1 that are valid); as many as min(n_d, |pool|)."""
    B, T = valid.shape
    assert slots.sizes == (T, *cod_capacity(T, K, r, r_min)) and slots.anchor.shape == (B, sum(slots.sizes))
    assert torch.equal(slots.anchor[:, :T], torch.arange(T).expand(B, T)) and slots.drawn[:, :T].all()
    counts = []
    for b in range(B):
        n_valid = int(valid[b].sum())
        pool = {o for o in range(1, T) if valid[b, o]}
        row = []
        for d, (first, last) in enumerate(slots.depth_rows(), start=1):
            assert (slots.depth[first:last] == d).all()
            drawn, anchor = slots.drawn[b, first:last], slots.anchor[b, first:last]
            k = int(drawn.sum())
            assert drawn[:k].all() and (anchor[k:] == T).all()
            kept = (anchor[:k] + d).tolist()
            assert kept == sorted(set(kept)) and set(kept) <= pool, (b, d)
            assert k == min(int(max(0, n_valid - d) * max(r**d, r_min)), len(pool)), (b, d)
            pool = {o + 1 for o in kept if o + 1 < T and valid[b, o + 1]}
            row.append(k)
        counts.append(row)
    return counts


def test_the_batched_cod_sampler_keeps_the_rule_in_every_row():
    """cod_sample_batch (training: every row at once, fixed shapes) draws by cod_anchors' rule in
    each row, whatever the other rows hold; the same seed the same slots (exact resume)."""
    T, K = 64, 6
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(6, T, generator=g) > 0.3
    valid[1, 20:30] = False  # a border: a rollout stops there
    valid[2] = False  # nothing taught
    valid[3] = True
    valid[4, 5:] = False  # a few positions
    valid[:, -2:] = False  # training's rows: the last two positions predict nothing
    slots = cod_sample_batch(valid, K, 0.7, 0.2, torch.Generator().manual_seed(5))
    counts = assert_cod_rule(valid, slots, K, 0.7, 0.2)
    assert counts[2] == [0] * (K - 1) and counts[3][0] == int((int(valid[3].sum()) - 1) * 0.7)
    again = cod_sample_batch(valid, K, 0.7, 0.2, torch.Generator().manual_seed(5))
    other = cod_sample_batch(valid, K, 0.7, 0.2, torch.Generator().manual_seed(6))
    assert torch.equal(slots.anchor, again.anchor) and torch.equal(slots.drawn, again.drawn)
    assert not torch.equal(slots.anchor, other.anchor)
    assert cod_sample_batch(valid, 1, 0.7, 0.2, g).sizes == (T,)  # one depth: depth 0 alone


def test_the_batched_cod_sampler_draws_each_pool_position_with_cods_probability():
    """A pool position is kept at depth d with probability min(1, n_d / |pool|) (a uniform subset
    of the pool, as randperm's first n_d), and each (depth, position) is a slot as often as under
    cod_anchors, the one-row reference: 6000 rows drawn at once against 6000 reference draws."""
    T, K, r, r_min, n = 20, 4, 0.6, 0.3, 6000
    valid = torch.zeros(T, dtype=torch.bool)
    valid[2:18] = True
    valid[9] = False  # a rollout crossing 9 stops
    slots = cod_sample_batch(valid.expand(n, T), K, r, r_min, torch.Generator().manual_seed(0))
    n_valid = int(valid.sum())
    pool = valid.clone()
    pool[0] = False
    pool = pool.expand(n, T)
    ours = []
    for d, (first, last) in enumerate(slots.depth_rows(), start=1):
        drawn = slots.drawn[:, first:last]
        at = torch.where(drawn, slots.anchor[:, first:last] + d, T)  # the slot's position o; padding: T
        kept = torch.zeros(n, T + 1, dtype=torch.bool).scatter(1, at, drawn)[:, :T]
        size = int(max(0, n_valid - d) * max(r**d, r_min))
        chance = (size / pool.sum(dim=1, keepdim=True).clamp_min(1)).clamp(max=1.0)  # per row, given its pool
        expected = (pool * chance).mean(dim=0)
        assert (kept.double().mean(dim=0) - expected).abs().max() < 0.03, d
        assert not (kept & ~pool).any()
        ours.append(kept.double().mean(dim=0))
        pool = torch.zeros_like(kept)
        pool[:, 1:] = kept[:, :-1] & valid[1:]
    generator = torch.Generator().manual_seed(1)
    reference = torch.zeros(K - 1, T, dtype=torch.float64)
    for _ in range(n):
        for d, anchor in enumerate(cod_anchors(valid, K, r, r_min, generator)[1:]):
            reference[d, anchor + d + 1] += 1.0 / n
    assert len(ours) == K - 1 and reference[0, 0] == 0
    assert (torch.stack(ours) - reference).abs().max() < 0.04


def test_the_batched_forward_equals_each_rows_own(monkeypatch):
    """The training forward over a batch of COD slots (fixed places, padding, mask-free attention,
    packed conversations) gives each drawn slot what the one-sequence forward over that row's
    slots alone gives under cod_visibility's dense mask."""
    target = llama(layers=4, vocab=64).eval()
    draft = peagle_for(target)
    B, T = 3, 40
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    ids[1, 7] = draft.dims.mask_token_id
    documents = torch.tensor([[0] * 40, [0] * 13 + [1] * 27, [0] * 5 + [1] * 30 + [2] * 5])
    valid = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) > 0.2
    valid[:, -2:] = False
    valid[:, :-2] &= documents[:, 2:] == documents[:, :-2]
    slots = cod_sample_batch(valid, draft.dims.num_depths, 0.7, 0.2, torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats = capture(target.model, ids, torch.arange(T).expand(B, T), draft.capture_request())
        aux, embeds = draft.aux_hidden(feats), feats.input_embeds
        batched = draft.draft_slots(aux, embeds, slots.anchor, slots.depth, documents, ids, sizes=slots.sizes)
        assert batched.shape == (B, sum(slots.sizes), draft.dims.hidden_size)
        for b in range(B):
            drawn = slots.drawn[b]
            alone = draft.draft_slots(
                aux[b], embeds[b], slots.anchor[b, drawn], slots.depth[drawn], documents[b], ids[b]
            )
            torch.testing.assert_close(batched[b, drawn], alone, rtol=1e-5, atol=1e-5)


def peagle_for(target, seed=0, **options):
    cfg = OmegaConf.structured(
        DraftConfig(type="peagle", draft_vocab_size=40, num_depths=4, mask_token_id=5, **options)
    )
    draft = build_draft(cfg, target.config)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=generator).numpy()
    draft.set_vocab_maps(*vocab_maps(counts, draft.dims.draft_vocab_size))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=generator) * 0.15
                if p.dim() == 2 or "mask" in name
                else torch.rand(p.shape, generator=generator) + 0.5
            )
    return draft.eval()


def test_the_drafter_proposes_what_the_training_forward_computes_in_one_forward():
    """Round from x_n: depth d's logits equal the training forward's slot (anchor n-1, depth d) on
    the same sequence, and the whole round is one call of the draft layer."""
    target = llama(layers=4, vocab=64).eval()
    draft = peagle_for(target)
    n, K = 20, 4
    ids = torch.randint(0, 64, (n + 1,), generator=torch.Generator().manual_seed(2))
    ids[7] = draft.dims.mask_token_id
    with torch.no_grad():
        feats = capture(target.model, ids[None, :n], torch.arange(n)[None], draft.capture_request())
        aux = draft.aux_hidden(feats)[0]
        embeds = target.model.embed_tokens(ids[None])[0]
        anchor = torch.cat([torch.arange(n), torch.full((K - 1,), n - 1)])
        depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, K)])
        expected = draft.logits(draft.draft_slots(aux, embeds, anchor, depth, ids=ids))[n - 1 :]
    drafter = draft.make_drafter(target)
    drafter.observe_target({layer: feats.hidden[layer][0] for layer in draft.dims.target_layers}, 0)
    calls = []
    handle = draft.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))

    class Cache:  # the target cache holds 0..n-1
        def get_seq_length(self):
            return n

    from specdraft.decode import cache as cache_module

    length = cache_module.cache_length
    cache_module.cache_length = lambda c: n
    import specdraft.drafts.peagle.decode as decode_module

    decode_module.cache_length = lambda c: n
    try:
        logits = drafter._parallel(ids, n, K)
        tree = drafter.propose_tree(ids, Cache(), [3, 2, 2, 1])
    finally:
        cache_module.cache_length = length
        decode_module.cache_length = length
    handle.remove()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # one forward per proposal
    assert tree.tokens.numel() == 3 + 2 + 2 + 1


def test_a_bad_peagle_key_is_one_line(tiny_target_dir, data_dir, tmp_path):
    for key, value, match in (
        ("draft.num_depths", "0", "draft.num_depths"),
        ("draft.down_sample_ratio", "1.5", "draft.down_sample_ratio"),
        ("draft.mask_token_id", "99999999", "draft.mask_token_id"),
        ("draft.ttt_steps", "3", "draft.ttt_steps"),
    ):
        overrides = run_overrides(
            tiny_target_dir, data_dir, tmp_path / "bad", tmp_path / "cache", **{**PEAGLE, key: value}
        )
        with pytest.raises(SpecdraftError, match=match):
            load_config(None, overrides)
    assert not (tmp_path / "bad").exists()


def test_peagle_trains_logs_depths_exports_and_evaluates(tiny_target_dir, tiny_data, data_dir, tmp_path):
    result = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=30, save_steps=30, **PEAGLE)
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first - 0.5, result.losses
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert {"depth_0/accuracy", "depth_3/loss"} <= set(logged[-1]) and "depth_4/loss" not in logged[-1]
    assert not (result.export_dir / "speculators").exists()  # tiny target: layer 2 (its output) is no server's
    draft, config = load_exported_draft(result.export_dir)
    assert isinstance(draft, PEagleDraft) and config["architecture"] == "PEagleDraft"
    assert not math.isclose(float(draft.mask_embedding.detach().abs().sum()), 0.0)
    for shape in (dict(gamma=4), dict(tree=[2, 2, 2])):
        report = evaluate(result.export_dir, tiny_data.prompts_file, max_prompts=3, max_new_tokens=16, **shape)
        assert report["matches_target"] is True and report["tau"] >= 1.0
    sampled = evaluate(
        result.export_dir, tiny_data.prompts_file, max_prompts=3, max_new_tokens=16, gamma=4, temperature=0.7
    )
    assert 1.0 <= sampled["tau"] <= 5.0


def test_the_default_mask_token_is_the_targets_pad_then_eos_then_its_last_id():
    from transformers import LlamaConfig

    from specdraft.drafts.peagle.model import default_mask_token

    assert default_mask_token(LlamaConfig(pad_token_id=2, eos_token_id=1)) == 2
    assert default_mask_token(LlamaConfig(pad_token_id=None, eos_token_id=[7, 8])) == 7
    assert default_mask_token(LlamaConfig(pad_token_id=None, eos_token_id=None, bos_token_id=None, vocab_size=50)) == 49
