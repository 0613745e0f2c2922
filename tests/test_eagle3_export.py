"""EAGLE-3 exports: loaded by speculators' own Eagle3DraftModel (no missing / unexpected keys, same
draft logits over three TTT steps), SGLang's exact key set and config, and the refusals."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from speculators_env import run_in_speculators
from specdraft.config import TrainConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture
from specdraft.export.files import write_draft_export
from test_eagle3 import llama

T = 128  # speculators' flex attention wants T % 128 == 0 for more than one TTT step
STEPS = 3

SPECULATORS_SCRIPT = r"""
import json, sys, torch
from safetensors import safe_open
from speculators.model import SpeculatorModel
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

export, inputs_path, out_path, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
_, info = super(SpeculatorModel, Eagle3DraftModel).from_pretrained(
    export, config=Eagle3SpeculatorConfig.from_pretrained(export), output_loading_info=True)
model = Eagle3DraftModel.from_pretrained(export).eval()
inputs = torch.load(inputs_path, weights_only=True)
logits = []
hook = model.lm_head.register_forward_hook(lambda m, a, o: logits.append(o))
with torch.no_grad():
    model(hidden_states=inputs["hidden"], input_ids=inputs["ids"],
          document_ids=torch.zeros_like(inputs["ids"]), ttt_steps=steps)
hook.remove()
torch.save({"logits": torch.stack(logits)}, out_path)
with safe_open(export + "/model.safetensors", "pt") as f:
    saved = sorted(f.keys())
print(json.dumps({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "mismatched": [str(m) for m in info["mismatched_keys"]], "saved": saved,
                  "layer_ids": model.config.eagle_aux_hidden_state_layer_ids,
                  "has_vocab_maps": model.t2d is not None}))
"""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("verifier")
    llama(layers=6, vocab=160).save_pretrained(directory)
    return directory


def run_cfg(target_dir, out, **draft):
    cfg = OmegaConf.structured(TrainConfig(target=str(target_dir), data_files="unused", output_dir=str(out)))
    cfg.draft = OmegaConf.merge(cfg.draft, dict(type="eagle3", ttt_steps=STEPS, **draft))
    return cfg


def random_eagle3(target, cfg, seed=0):
    draft = build_draft(cfg.draft, target.config)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=generator).numpy()
    draft.set_vocab_maps(*vocab_maps(counts, draft.dims.draft_vocab_size))
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(
                torch.randn(p.shape, generator=generator) * 0.15
                if p.dim() == 2
                else torch.rand(p.shape, generator=generator) + 0.5
            )
    return draft.eval()


@pytest.mark.parametrize(
    "draft_options",
    [
        dict(draft_vocab_size=100),
        dict(target_layers=[5, 0, 3]),
        dict(draft_vocab_size=100, norm_before_residual=True, fc_norm=True, norm_output=True),
        dict(draft_vocab_size=100, norm_before_fc=True),
    ],
    ids=["vocab100", "whole-vocab-unsorted-layers", "eagle3.1-flags", "norm_before_fc"],
)
def test_speculators_loads_the_export_and_computes_the_same_logits(target_dir, tmp_path, draft_options):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = run_cfg(target_dir, tmp_path, **draft_options)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    report = assert_speculators_computes_our_logits(target, draft, export / "speculators", tmp_path)
    expected = sorted(draft.state_dict())
    if draft.dims.draft_vocab_size == draft.dims.vocab_size:
        expected = [k for k in expected if k not in ("d2t", "t2d")]
    assert report["saved"] == sorted(expected + ["embed_tokens.weight"]) and report["has_vocab_maps"] == (
        draft.dims.draft_vocab_size < 160
    )
    assert report["layer_ids"] == draft.dims.target_layers


def assert_speculators_computes_our_logits(target, draft, export_dir, tmp_path) -> dict:
    """speculators loads `export_dir` strictly and its TTT forward gives our logits at every step;
    returns its report (saved keys, layer ids)."""
    ids = torch.randint(0, 160, (1, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        feats = capture(target.model, ids, torch.arange(T + 1)[None], draft.capture_request())
        aux = draft.aux_hidden(feats)
        ours = torch.stack([draft.logits(h) for h in draft.unroll(aux, feats.input_embeds, STEPS)])[:, 0]
    # speculators' alignment (its shift_batch): position j carries (g_j, x_{j+1})
    torch.save({"hidden": aux[:, :-1].contiguous(), "ids": ids[:, 1:].contiguous()}, tmp_path / "inputs.pt")
    report = run_in_speculators(SPECULATORS_SCRIPT, export_dir, tmp_path / "inputs.pt", tmp_path / "logits.pt", STEPS)
    assert report["missing"] == [] and report["unexpected"] == [] and report["mismatched"] == []
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)["logits"][:, 0]  # (steps, T, N)
    for k in range(STEPS):  # the last k positions embed padding (their token 0, our zeros): not compared
        torch.testing.assert_close(ours[k, : T - k], theirs[k, : T - k], rtol=1e-4, atol=1e-4)
    return report


def test_speculators_config_fields(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = run_cfg(target_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    config = json.loads((export / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 100 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == draft.dims.target_layers == [1, 3, 5]  # 6 layers
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[flag] is False  # speculators' defaults, always written
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 160
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": STEPS}]
    assert spec["verifier"] == {"name_or_path": str(target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert "speculators_version" in config


def test_sglang_export_has_exactly_its_keys_and_config(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = run_cfg(target_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    with safe_open(str(export / "sglang" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert torch.equal(
            f.get_tensor("midlayer.self_attn.q_proj.weight"), draft.state_dict()["layers.0.self_attn.q_proj.weight"]
        )
    layer = {
        f"midlayer.{name}"
        for name in (
            "input_layernorm.weight",
            "hidden_norm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    }
    assert keys == layer | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}  # no embed_tokens
    config = json.loads((export / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 100
    assert config["target_hidden_size"] == 64 and config["vocab_size"] == 160
    # SGLang captures id + 1 (set_eagle3_layers_to_capture): the inputs of layers 1, 3, 5 are its 0, 2, 4
    assert draft.dims.target_layers == [1, 3, 5]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "use_aux_hidden_state": True}
    # flags SGLang has no weights for: not written by default, refused when asked for
    cfg31 = run_cfg(target_dir, tmp_path, draft_vocab_size=100, fc_norm=True)
    draft31 = random_eagle3(target, cfg31)
    assert draft31.default_serving_formats() == ["speculators"]
    with pytest.raises(SpecdraftError, match="draft.fc_norm: SGLang"):
        write_draft_export(tmp_path / "step_2", draft31.state_dict(), draft31, cfg31, serving=["sglang"])
    # its midlayer's residual is the un-normed hidden state: norm_before_residual is refused too
    cfg_nbr = run_cfg(target_dir, tmp_path, draft_vocab_size=100, norm_before_residual=True)
    draft_nbr = random_eagle3(target, cfg_nbr)
    assert draft_nbr.default_serving_formats() == ["speculators"]
    with pytest.raises(SpecdraftError, match="draft.norm_before_residual: SGLang"):
        write_draft_export(tmp_path / "step_3", draft_nbr.state_dict(), draft_nbr, cfg_nbr, serving=["sglang"])


def test_a_glide_draft_has_no_speculators_format(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = OmegaConf.structured(TrainConfig(target=str(target_dir), data_files="unused"))
    glide = build_draft(cfg.draft, target.config)
    with pytest.raises(SpecdraftError) as err:
        write_draft_export(tmp_path / "step_1", glide.state_dict(), glide, cfg, serving=["speculators"])
    assert str(err.value) == (
        "export format 'speculators': a glide draft has no such serving format (it has: native, longspec)"
    )
    assert not (tmp_path / "step_1").exists() and not (tmp_path / "step_1.tmp").exists()
