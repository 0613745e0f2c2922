"""DFlash2 exports: speculators' format loaded by speculators 0.9.0's own DFlash2DraftModel (in its
own venv, tests/speculators_env.py) with exactly its key set, and its forward's unary logits and the
selector's scores of its training candidates equal ours within 1e-4; the native round trip."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from helpers import realistic_block_draft
from speculators_env import run_speculators_file
from specdraft.drafts import DraftConfig
from specdraft.drafts.dflash2.export import write_speculators_export
from specdraft.drafts.dflash2.model import DFlash2Draft
from specdraft.drafts.registry import draft_from_export_config
from specdraft.target.capture import capture
from test_dflash_export import REPO, VOCAB, T, target, target_dir  # noqa: F401 (DFlash's target, DFlash2's base)

torch.set_num_threads(1)


def make_draft(target, **overrides):
    keys = {"type": "dflash2", "num_layers": 2, "selector_rank": 8, "selector_top_k": 6, "conv_group_size": 8}
    draft = DFlash2Draft.from_target_config(target.config, OmegaConf.structured(DraftConfig(**{**keys, **overrides})))
    realistic_block_draft(draft)
    return draft.eval()


def our_outputs(draft, target, ids, anchors):
    """(A*S, V) unary logits at the anchors, the hidden states and each slot's data predecessor."""
    feats = capture(target.model, ids, torch.arange(ids.shape[1])[None], draft.capture_request())
    blocks = draft.training_blocks(ids, torch.ones_like(ids), 0)
    blocks.anchors, blocks.valid = anchors[None], torch.ones_like(anchors[None], dtype=torch.bool)
    with torch.no_grad():
        hidden = draft.training_hidden(feats, blocks)
        previous = blocks.previous_tokens(ids, draft.layout.first_slot)
        head = draft.block_head(hidden, previous, draft.head_weight(target.lm_head.weight))
    return head.logits()[0].flatten(0, 1), hidden[0].flatten(0, 1), previous[0].flatten(), feats


@pytest.mark.parametrize("block_size, sample_from_anchor, kernel", [(8, False, 2), (5, True, 3)])
def test_speculators_loads_the_export_and_computes_our_logits_and_selector_scores(
    target, target_dir, tmp_path, block_size, sample_from_anchor, kernel
):
    draft = make_draft(target, block_size=block_size, sample_from_anchor=sample_from_anchor, conv_kernel_size=kernel)
    out = write_speculators_export(draft, draft.state_dict(), tmp_path / "spec", str(target_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([2, 10, 21, 30])
    logits, hidden, previous, feats = our_outputs(draft, target, ids, anchors)
    hidden_states = torch.cat([feats.hidden[i] for i in draft.dims.target_layers], dim=-1)
    torch.save(
        {"anchors": anchors, "input_ids": ids, "hidden_states": hidden_states, "final_hidden": feats.final_hidden},
        tmp_path / "in.pt",
    )
    run_speculators_file(REPO / "tests" / "speculators_dflash2_check.py", out, tmp_path / "in.pt", tmp_path / "out.pt")
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["unexpected"] == [] and result["mismatched"] == []
    assert set(result["missing"]) <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    assert result["weights_equal"] and result["fields"] == [kernel, 8, 8, 6]
    torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-4)
    # its candidates: the unary top-K, the target's argmax injected in the last place only
    assert torch.equal(result["ids"][:, :-1], logits.topk(6, dim=-1).indices[:, :-1])
    with torch.no_grad():
        ours = draft.candidate_selector.score_candidates(logits, hidden, previous, result["ids"])
    torch.testing.assert_close(result["scores"], ours, rtol=1e-4, atol=1e-4)


def test_native_export_round_trip(target, tmp_path):
    from safetensors.torch import load_file, save_file

    draft = make_draft(target)
    (tmp_path / "config.json").write_text(json.dumps(draft.export_config()))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = draft_from_export_config(json.loads((tmp_path / "config.json").read_text()))
    loaded.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    assert type(loaded) is DFlash2Draft and loaded.dims == draft.dims
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 17, 30])
    torch.testing.assert_close(
        our_outputs(loaded.eval(), target, ids, anchors)[0], our_outputs(draft, target, ids, anchors)[0], rtol=0, atol=0
    )
