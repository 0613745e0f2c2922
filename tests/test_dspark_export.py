"""DSpark exports: the native round trip, and speculators' DSpark format loaded by speculators' own
DSparkDraftModel (in its own venv, tests/speculators_env.py): no missing / unexpected keys, and its
forward's Markov-biased logits and confidences equal ours within 1e-4, for every Markov variant."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from helpers import realistic_block_draft
from speculators_env import run_speculators_file
from specdraft.drafts import DraftConfig
from specdraft.drafts.registry import draft_from_export_config
from specdraft.drafts.dspark.model import DSparkDraft
from specdraft.drafts.dspark.export import write_speculators_export
from specdraft.target.capture import capture
from test_dflash_export import REPO, VOCAB, T, target, target_dir  # noqa: F401 (DFlash's target, DSpark's base)

torch.set_num_threads(1)


def make_draft(target, **overrides):
    cfg = OmegaConf.structured(DraftConfig(**{"type": "dspark", "num_layers": 2, "markov_rank": 16, **overrides}))
    draft = DSparkDraft.from_target_config(target.config, cfg)
    realistic_block_draft(draft)
    return draft.eval()


def our_outputs(draft, target, ids, anchors):
    """(A*S, V) logits and (A*S,) confidence logits at the anchors, each slot's previous token the data's."""
    feats = capture(target.model, ids, torch.arange(ids.shape[1])[None], draft.capture_request())
    blocks = draft.training_blocks(ids, torch.ones_like(ids), 0)
    blocks.anchors, blocks.valid = anchors[None], torch.ones_like(anchors[None], dtype=torch.bool)
    with torch.no_grad():
        head = draft.block_head(
            draft.training_hidden(feats, blocks),
            blocks.previous_tokens(ids, draft.layout.first_slot),
            draft.head_weight(target.lm_head.weight),
        )
        return head.logits()[0].flatten(0, 1), head.confidence[0].flatten(), feats


def test_native_export_round_trip(target, tmp_path):
    from safetensors.torch import load_file, save_file

    draft = make_draft(target, markov_head_type="rnn", confidence_with_markov=False, confidence_threshold=0.3)
    (tmp_path / "config.json").write_text(json.dumps(draft.export_config()))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = draft_from_export_config(json.loads((tmp_path / "config.json").read_text()))
    loaded.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    assert type(loaded) is DSparkDraft and loaded.dims == draft.dims
    assert loaded.make_drafter(target).confidence_threshold == 0.3  # the config's default travels with it
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 17, 30])
    for ours, theirs in zip(
        our_outputs(loaded.eval(), target, ids, anchors)[:2], our_outputs(draft, target, ids, anchors)[:2]
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("head_type, with_markov", [("vanilla", True), ("gated", False), ("rnn", True)])
def test_speculators_export_has_the_heads_keys_and_config(target, target_dir, tmp_path, head_type, with_markov):
    draft = make_draft(target, markov_head_type=head_type, confidence_with_markov=with_markov)
    out = write_speculators_export(draft, draft.state_dict(), tmp_path / "spec", str(target_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["speculators_config"]["algorithm"] == "dspark"
    assert (config["markov_rank"], config["markov_head_type"]) == (16, head_type)
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is with_markov
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        heads = {k for k in f.keys() if k.startswith(("markov_head.", "confidence_head."))}
    extra = {
        "gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
        "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"},
    }.get(head_type, set())
    assert (
        heads
        == {
            "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight",
            "confidence_head.proj.weight",
            "confidence_head.proj.bias",
        }
        | extra
    )


@pytest.mark.parametrize(
    "head_type, with_markov, block_size, sample_from_anchor",
    [("vanilla", True, 8, False), ("gated", True, 5, True), ("rnn", True, 6, False), ("rnn", False, 5, True)],
)
def test_speculators_loads_the_export_and_computes_our_logits_and_confidences(
    target, target_dir, tmp_path, head_type, with_markov, block_size, sample_from_anchor
):
    draft = make_draft(
        target,
        markov_head_type=head_type,
        confidence_with_markov=with_markov,
        block_size=block_size,
        sample_from_anchor=sample_from_anchor,
    )
    out = write_speculators_export(draft, draft.state_dict(), tmp_path / "spec", str(target_dir))
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([2, 10, 21, 30])
    logits, confidence, feats = our_outputs(draft, target, ids, anchors)
    hidden_states = torch.cat([feats.hidden[i] for i in draft.dims.target_layers], dim=-1)
    torch.save({"anchors": anchors, "input_ids": ids, "hidden_states": hidden_states}, tmp_path / "in.pt")
    # a failure under CI=true without the venv, never a silent skip there
    run_speculators_file(REPO / "tests" / "speculators_dspark_check.py", out, tmp_path / "in.pt", tmp_path / "out.pt")
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["unexpected"] == [] and result["mismatched"] == []
    assert set(result["missing"]) <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    assert result["weights_equal"] and result["markov_head_type"] == head_type and result["with_markov"] is with_markov
    torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result["confidence"], confidence, rtol=1e-4, atol=1e-4)


def test_each_block_familys_default_layout_is_speculators_default():
    """speculators' DSparkConfig defaults sample_from_anchor to true (every slot predicts), its
    DFlashConfig to false (the anchor is the bonus token): ours follow, read from its source."""
    from omegaconf import OmegaConf

    from specdraft.drafts import DraftConfig
    from specdraft.drafts.dflash.model import DFlashDraft
    from specdraft.drafts.dspark.model import DSparkDraft
    from tests.speculators_env import run_in_speculators

    theirs = run_in_speculators(
        "import json\n"
        "from speculators.models.dflash.config import DFlashSpeculatorConfig as F\n"
        "from speculators.models.dspark.config import DSparkSpeculatorConfig as S\n"
        "print(json.dumps({'dflash': F.model_fields['sample_from_anchor'].default,"
        " 'dspark': S.model_fields['sample_from_anchor'].default}))"
    )
    unset = OmegaConf.structured(DraftConfig())
    ours = {"dflash": DFlashDraft.sample_from_anchor(unset), "dspark": DSparkDraft.sample_from_anchor(unset)}
    assert ours == theirs == {"dflash": False, "dspark": True}
