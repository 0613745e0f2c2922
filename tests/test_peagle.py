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
from specdraft.drafts import DraftConfig, build_draft
from specdraft.drafts.peagle.cod import cod_sample, cod_visibility
from specdraft.drafts.peagle.model import PEagleDraft
from specdraft.drafts.vocab import vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.evaluate import evaluate
from specdraft.target.capture import capture
from specdraft.train.export import load_exported_draft
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
        expected = int((n_valid - d) * max(0.7 ** d, 0.2))
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


def peagle_for(target, seed=0, **options):
    cfg = OmegaConf.structured(DraftConfig(type="peagle", draft_vocab_size=40, num_depths=4, mask_token_id=5,
                                           **options))
    draft = build_draft(cfg, target.config)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=generator).numpy()
    draft.set_vocab_maps(*vocab_maps(counts, draft.dims.draft_vocab_size))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.15 if p.dim() == 2 or "mask" in name
                    else torch.rand(p.shape, generator=generator) + 0.5)
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
        expected = draft.logits(draft.draft_slots(aux, embeds, anchor, depth, ids=ids))[n - 1:]
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
    for key, value, match in (("draft.num_depths", "0", "draft.num_depths"),
                              ("draft.down_sample_ratio", "1.5", "draft.down_sample_ratio"),
                              ("draft.mask_token_id", "99999999", "draft.mask_token_id"),
                              ("draft.ttt_steps", "3", "draft.ttt_steps")):
        overrides = run_overrides(tiny_target_dir, data_dir, tmp_path / "bad", tmp_path / "cache",
                                  **{**PEAGLE, key: value})
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
    sampled = evaluate(result.export_dir, tiny_data.prompts_file, max_prompts=3, max_new_tokens=16, gamma=4,
                       temperature=0.7)
    assert 1.0 <= sampled["tau"] <= 5.0


def test_the_default_mask_token_is_the_targets_pad_then_eos_then_its_last_id():
    from transformers import LlamaConfig

    from specdraft.drafts.peagle.model import default_mask_token

    assert default_mask_token(LlamaConfig(pad_token_id=2, eos_token_id=1)) == 2
    assert default_mask_token(LlamaConfig(pad_token_id=None, eos_token_id=[7, 8])) == 7
    assert default_mask_token(LlamaConfig(pad_token_id=None, eos_token_id=None, bos_token_id=None, vocab_size=50)) == 49
