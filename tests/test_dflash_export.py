"""DFlash exports: the native round trip, and speculators' format loaded by speculators' own DFlash
class (in its own venv) with no missing / unexpected keys and the same logits as ours.

speculators needs transformers <= 5.19, so it lives in a venv of its own: SPECDRAFT_SPECULATORS_PYTHON
names its interpreter (default: .venv-speculators/bin/python in the repository, made by
`make speculators-venv`); tests/speculators_env.py skips without it, and fails under CI=true.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from helpers import random_llama, save_target
from speculators_env import run_speculators_file
from specdraft.drafts import DraftConfig
from specdraft.drafts.dflash.model import DFlashDraft
from specdraft.drafts.dflash.export import write_speculators_export
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
VOCAB, T = 128, 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(
        random_llama(vocab=VOCAB, layers=4, max_positions=256, init=0.02), tmp_path_factory.mktemp("target")
    )


@pytest.fixture(scope="module")
def target(target_dir):
    return LlamaForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False)


def make_draft(target, **overrides):
    cfg = OmegaConf.structured(DraftConfig(**{"type": "dflash", "num_layers": 2, **overrides}))
    draft = DFlashDraft.from_target_config(target.config, cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "mask_delta":
                p.copy_(
                    torch.rand(p.shape, generator=generator) + 0.5
                    if p.dim() == 1
                    else torch.randn(p.shape, generator=generator) * 0.2
                )
    return draft.eval()


def our_logits(draft, target, ids, anchors):
    feats = capture(target.model, ids, torch.arange(ids.shape[1])[None], draft.capture_request())
    blocks = draft.training_blocks(ids, torch.ones_like(ids), 0)
    blocks.anchors, blocks.valid = anchors[None], torch.ones_like(anchors[None], dtype=torch.bool)
    with torch.no_grad():
        hidden = draft.training_hidden(feats, blocks)
        return draft.head_logits(hidden, target.lm_head.weight)[0].flatten(0, 1), feats


def test_native_export_round_trip(target, tmp_path):
    from safetensors.torch import save_file

    from specdraft.drafts.registry import draft_from_export_config

    draft = make_draft(target, train_mask_embedding=True)
    with torch.no_grad():
        draft.mask_delta.normal_()
    (tmp_path / "config.json").write_text(json.dumps(draft.export_config()))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = draft_from_export_config(json.loads((tmp_path / "config.json").read_text()))
    from safetensors.torch import load_file

    loaded.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    assert loaded.dims == draft.dims and loaded.layout == draft.layout
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([3, 17, 30])
    torch.testing.assert_close(
        our_logits(loaded.eval(), target, ids, anchors)[0], our_logits(draft, target, ids, anchors)[0], rtol=0, atol=0
    )


def test_speculators_export_refuses_a_trained_mask_row(target, target_dir, tmp_path):
    draft = make_draft(target, train_mask_embedding=True)
    with torch.no_grad():
        draft.mask_delta.fill_(0.1)
    with pytest.raises(SpecdraftError, match="mask"):
        write_speculators_export(draft, draft.state_dict(), tmp_path / "x", str(target_dir))
    assert not (tmp_path / "x").exists()


def test_speculators_export_has_its_key_set_and_config(target, target_dir, tmp_path):
    from safetensors import safe_open

    draft = make_draft(target, block_size=8, sample_from_anchor=False)
    out = write_speculators_export(draft, draft.state_dict(), tmp_path / "spec", str(target_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3] and config["mask_token_id"] == VOCAB - 1
    assert (config["block_size"], config["sample_from_anchor"]) == (8, False)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    per_layer = {
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in per_layer
    }
    assert keys == expected


@pytest.mark.parametrize("block_size, sample_from_anchor", [(8, False), (5, True)])
def test_speculators_loads_the_export_and_computes_our_logits(
    target, target_dir, tmp_path, block_size, sample_from_anchor
):
    draft = make_draft(target, block_size=block_size, sample_from_anchor=sample_from_anchor)
    out = write_speculators_export(draft, draft.state_dict(), tmp_path / "spec", str(target_dir))
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    ids[0, 10] = draft.dims.mask_token_id  # an anchor equal to the MASK id embeds the same both ways
    anchors = torch.tensor([2, 10, 21, 30])
    ours, feats = our_logits(draft, target, ids, anchors)
    hidden_states = torch.cat([feats.hidden[i] for i in draft.dims.target_layers], dim=-1)
    torch.save({"anchors": anchors, "input_ids": ids, "hidden_states": hidden_states}, tmp_path / "in.pt")
    # a failure under CI=true without the venv, never a silent skip there
    run_speculators_file(REPO / "tests" / "speculators_dflash_check.py", out, tmp_path / "in.pt", tmp_path / "out.pt")
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["unexpected"] == [] and result["mismatched"] == []
    # what a speculators DFlash checkpoint omits on purpose: the verifier's tensors, loaded from it
    assert set(result["missing"]) <= {
        "embed_tokens.weight",
        "lm_head.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    assert result["weights_equal"] and result["mask_token_id"] == draft.dims.mask_token_id
    torch.testing.assert_close(result["logits"], ours, rtol=1e-4, atol=1e-4)
