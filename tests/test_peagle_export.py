"""P-EAGLE exports: speculators' own PEagleDraftModel loads them strictly and its parallel-group
forward (COD slots given, mask token and mask_hidden in the deeper slots) computes our logits;
the config carries what vLLM reads (mask_token_id -> pard_token)."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from helpers import imported_draft
from speculators_env import run_in_speculators
from specdraft.config import TrainConfig
from specdraft.drafts.peagle.cod import cod_anchors, slot_order
from specdraft.target.capture import capture
from specdraft.export.files import write_draft_export
from test_eagle3_export import random_eagle3, target_dir  # noqa: F401 (the 6-layer verifier fixture)
from test_eagle3_export import run_cfg as eagle3_run_cfg

T = 128  # speculators' flex block mask: a multiple of 128
DEPTHS = 4

# speculators' forward draws its own COD slots: the test hands it ours (same signature)
SPECULATORS_SCRIPT = r"""
import json, sys, torch
import speculators.models.peagle.core as core
from speculators.model import SpeculatorModel
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

export, inputs_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
inputs = torch.load(inputs_path, weights_only=True)
core.generate_cod_sample_indices = lambda **kw: (inputs["anchor"], inputs["depth"])
config = PEagleSpeculatorConfig.from_pretrained(export)
config.transformer_layer_config._attn_implementation = "eager"
_, info = super(SpeculatorModel, PEagleDraftModel).from_pretrained(export, config=config, output_loading_info=True)
model = PEagleDraftModel.from_pretrained(export, config=config).eval()
logits = []
hook = model.lm_head.register_forward_hook(lambda m, a, o: logits.append(o))
with torch.no_grad():
    n = inputs["ids"].shape[1]
    model(hidden_states=inputs["hidden"], input_ids=inputs["ids"], document_ids=torch.zeros_like(inputs["ids"]),
          verifier_last_hidden_states=torch.zeros(1, n, model.hidden_size), num_depths=int(inputs["depths"]),
          loss_config={"none": (lambda lg, tg: lg.new_zeros(lg.shape[:-1]), 1.0)})  # no Triton on CPU
hook.remove()
torch.save({"logits": logits[0]}, out_path)
print(json.dumps({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "mismatched": [str(m) for m in info["mismatched_keys"]],
                  "mask_token_id": model.mask_token_id, "type": model.config.speculators_model_type}))
"""


def run_cfg(target_dir, out, **draft):
    cfg = eagle3_run_cfg(target_dir, out)
    cfg.draft = OmegaConf.merge(
        OmegaConf.structured(TrainConfig).draft, dict(type="peagle", num_depths=DEPTHS, **draft)
    )
    return cfg


def random_peagle(target, cfg, seed=0):
    return random_eagle3(target, cfg, seed)  # EAGLE-3's random weights and maps; mask_* positive, not 0


@pytest.mark.parametrize(
    "draft_options",
    [
        dict(draft_vocab_size=100, mask_token_id=7),
        dict(draft_vocab_size=100, norm_before_residual=True, fc_norm=True, mask_token_id=0),
        dict(target_layers=[5, 0, 3], mask_token_id=159),
    ],
    ids=["vocab100", "flags", "whole-vocab"],
)
def test_speculators_loads_the_export_and_computes_the_same_logits(target_dir, tmp_path, draft_options):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = run_cfg(target_dir, tmp_path, **draft_options)
    draft = random_peagle(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg) / "speculators"
    assert_speculators_computes_our_logits(target, draft, export, tmp_path)


def test_config_carries_what_vllm_reads(target_dir, tmp_path):
    """vLLM's update_peagle maps mask_token_id to pard_token (required) and serves the draft as
    eagle3 with parallel drafting, num_speculative_tokens from speculative_tokens."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = run_cfg(target_dir, tmp_path, draft_vocab_size=100, mask_token_id=11)
    draft = random_peagle(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg) / "speculators"
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 11 and config["embed_requires_grad"] is True
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    from safetensors.torch import load_file

    tensors = load_file(str(export / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 3 * 64)
    torch.testing.assert_close(tensors["embed_tokens.weight"][11], draft.mask_embedding.detach())
    torch.testing.assert_close(tensors["embed_tokens.weight"][12], target.model.embed_tokens.weight[12].detach())


def assert_speculators_computes_our_logits(target, draft, export, tmp_path):
    """speculators loads `export` strictly and its forward over COD slots (a prompt of 10, K
    depths) gives our logits, the text holding the mask token once."""
    ids = torch.randint(0, 160, (1, T + 1), generator=torch.Generator().manual_seed(1))
    ids[0, 40] = draft.dims.mask_token_id  # the text itself holds the mask token: it reads the same row
    valid = torch.ones(T, dtype=torch.bool)
    valid[:10] = False  # a prompt: depth 0 everywhere, deeper slots only where x_{o+2} is taught
    by_depth = cod_anchors(valid, DEPTHS, 0.7, 0.2, torch.Generator().manual_seed(3))
    anchor, depth = slot_order(by_depth)
    assert int(depth.max()) == DEPTHS - 1
    with torch.no_grad():
        feats = capture(target.model, ids, torch.arange(T + 1)[None], draft.capture_request())
        aux = draft.aux_hidden(feats)[0]
        # the training path: COD's slots attend without the (N, N) mask (cod_attention.py)
        ours = draft.logits(
            draft.draft_slots(aux[:T], feats.input_embeds[0], anchor, depth, ids=ids[0], by_depth=by_depth)
        )
    # speculators' alignment: position j carries (g_j, x_{j+1})
    torch.save(
        {
            "hidden": aux[None, :T].contiguous(),
            "ids": ids[:, 1:].contiguous(),
            "anchor": anchor,
            "depth": depth,
            "depths": DEPTHS,
        },
        tmp_path / "inputs.pt",
    )
    report = run_in_speculators(SPECULATORS_SCRIPT, export, tmp_path / "inputs.pt", tmp_path / "logits.pt")
    assert report["missing"] == [] and report["unexpected"] == [] and report["mismatched"] == []
    assert report["type"] == "peagle" and report["mask_token_id"] == draft.dims.mask_token_id
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)["logits"][0]
    assert theirs.shape == ours.shape and (depth > 0).sum() > 50
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


RESAVE = r"""
import sys, torch
from speculators.models.peagle import PEagleDraftModel
export, out = sys.argv[1], sys.argv[2]
model = PEagleDraftModel.from_pretrained(export)
generator = torch.Generator().manual_seed(7)
with torch.no_grad():  # new weights of its own, a new mask row and mask_hidden
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("fc", "layers", "norm", "lm_head", "mask_hidden"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1 if p.dim() >= 2 else torch.rand(p.shape, generator=generator) + 0.5)
    model.embed_tokens.weight[model.mask_token_id] = torch.randn(model.hidden_size, generator=generator) * 0.1
model.save_pretrained(out)
print("{}")
"""


def test_a_draft_speculators_saved_imports_and_computes_its_logits(target_dir, tmp_path):
    """init_from a PEagleDraftModel.save_pretrained: its weights, mask_hidden and the mask token's
    embedding row come in, and speculators computes the imported draft's logits."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = run_cfg(target_dir, tmp_path, draft_vocab_size=100, mask_token_id=7)
    ours = random_peagle(target, cfg)
    export = write_draft_export(tmp_path / "step_1", ours.state_dict(), ours, cfg) / "speculators"
    run_in_speculators(RESAVE, export, tmp_path / "theirs")
    cfg.draft.init_from = str(tmp_path / "theirs")
    imported, draft = imported_draft(cfg, target.config)
    assert imported.fmt == "speculators"
    draft.eval()
    assert not torch.equal(draft.mask_embedding, ours.mask_embedding) and not torch.equal(
        draft.mask_hidden, ours.mask_hidden
    )
    assert torch.equal(draft.d2t, ours.d2t)
    assert_speculators_computes_our_logits(target, draft, tmp_path / "theirs", tmp_path)
