"""draft.type mtp on the targets whose native MTP layer transformers has besides Qwen3-Next:
DeepSeek-V3 and GLM-4.5 (transformers' MtpModel, modeling_layers.py), stored as layer
num_hidden_layers of the checkpoint (model.layers.<L>.*). tests/target_zoo.py builds them with that
layer, as their released checkpoints hold it. Proven here: a new draft is exactly that layer; it
computes what transformers' MtpLayer computes on the same weights; the stitched export is the
target with that layer replaced (the copies of the embeddings and head beside it untouched);
speculators' format is refused in one line; vLLM's conventions for serving it."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from specdraft.config import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts.mtp.export import speculators_refusal, write_stitched
from specdraft.drafts.mtp.layer import layer_after_the_stack
from specdraft.errors import SpecdraftError
from specdraft.target.model import load_frozen_target, load_target_config
from target_zoo import MTP_LAYER_TYPES, build_target

LAYERS = 4  # target_zoo's depth: the MTP layer is model.layers.4.*


@pytest.fixture(scope="module")
def targets(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_layouts")
    return {model_type: build_target(model_type, root / model_type, tiny_target_dir) for model_type in MTP_LAYER_TYPES}


def new_draft(target_dir):
    return build_draft(OmegaConf.structured(DraftConfig(type="mtp")), load_target_config(str(target_dir))).eval()


def ours_to_transformers(name: str) -> str:
    """Our (speculators') names -> transformers' MtpModel's (modeling_layers.MtpLayer)."""
    renames = {
        "token_layernorm.": "enorm.",
        "hidden_layernorm.": "hnorm.",
        "input_proj.": "eh_proj.",
        "final_layernorm.": "post_norm.",
    }
    rest = name[len("mtp_layers.0.") :]
    for ours, theirs in renames.items():
        if rest.startswith(ours):
            return "layers.0." + theirs + rest[len(ours) :]
    return "layers.0.mtp_block." + rest


@pytest.mark.parametrize("model_type", MTP_LAYER_TYPES)
def test_the_new_draft_is_the_checkpoints_layer_after_the_stack(targets, model_type):
    """enorm -> token_layernorm, hnorm -> hidden_layernorm, eh_proj -> input_proj, shared_head.norm
    -> final_layernorm (transformers' conversion_mapping: post_norm), the decoder layer's own names
    with per-expert weights fused; embed_tokens / shared_head.head (the target's) not read."""
    state = new_draft(targets[model_type]).state_dict()
    stored = {
        k: v
        for k, v in load_file(str(targets[model_type] / "model.safetensors")).items()
        if k.startswith(f"model.layers.{LAYERS}.")
    }
    p = f"model.layers.{LAYERS}."
    torch.testing.assert_close(state["mtp_layers.0.input_proj.weight"], stored[p + "eh_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["mtp_layers.0.token_layernorm.weight"], stored[p + "enorm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        state["mtp_layers.0.hidden_layernorm.weight"], stored[p + "hnorm.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        state["mtp_layers.0.final_layernorm.weight"], stored[p + "shared_head.norm.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        state["mtp_layers.0.self_attn.o_proj.weight"], stored[p + "self_attn.o_proj.weight"], rtol=0, atol=0
    )
    gate_up = state["mtp_layers.0.mlp.experts.gate_up_proj"]
    for i in range(gate_up.shape[0]):
        expected = torch.cat(
            [stored[f"{p}mlp.experts.{i}.gate_proj.weight"], stored[f"{p}mlp.experts.{i}.up_proj.weight"]]
        )
        assert torch.equal(gate_up[i], expected)
    assert "mtp_layers.0.mlp.gate.e_score_correction_bias" in state  # the block's MLP is MoE (first_k_dense_replace 0)
    read = {name for name in stored if name not in (p + "embed_tokens.weight", p + "shared_head.head.weight")}
    assert len(read) == sum(1 for k in state if ".experts." not in k) + 3 * gate_up.shape[0]


@pytest.mark.parametrize("model_type", MTP_LAYER_TYPES)
def test_the_layer_computes_what_transformers_mtp_layer_computes(targets, model_type):
    """transformers' MtpModel (built from the target, config.get_mtp_config()) with our draft's
    weights: forward_layer's output equals our step on the same hidden states, embeddings and
    positions (MLA and partial RoPE included: the target's own rotary embedding)."""
    from transformers.modeling_layers import MtpModel

    target = load_frozen_target(str(targets[model_type]))
    draft = new_draft(targets[model_type])
    theirs = MtpModel(target, 1).eval()
    theirs.config._attn_implementation = "sdpa"
    missing, unexpected = theirs.load_state_dict(
        {ours_to_transformers(k): v for k, v in draft.state_dict().items()}, strict=False
    )
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing), missing
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (1, 12), generator=generator)
    hidden = torch.randn(1, 12, 64, generator=generator)
    positions = torch.arange(12)[None]
    with torch.no_grad():
        want = theirs.forward_layer(0, hidden, positions, None, input_ids=ids)
        cos, sin = target.model.rotary_emb(hidden, positions)
        got = draft.step(hidden, target.get_input_embeddings()(ids), cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MTP_LAYER_TYPES)
def test_the_stitched_target_is_the_target_with_the_trained_layer(targets, model_type, tmp_path):
    draft = new_draft(targets[model_type])
    with torch.no_grad():  # every tensor of the layer moved, buffers (the router's score bias) included
        for value in draft.state_dict().values():
            value.add_(0.5)
    state = draft.state_dict()
    write_stitched(draft, state, tmp_path / "stitched", str(targets[model_type]))
    source = load_file(str(targets[model_type] / "model.safetensors"))
    written = load_file(str(tmp_path / "stitched" / "model.safetensors"))
    assert set(written) == set(source)
    layout = layer_after_the_stack(LAYERS)
    for key, value in written.items():
        assert value.dtype == source[key].dtype
        assert torch.equal(value, source[key]) != layout.holds(key), key  # the layer's tensors, and only they
    torch.testing.assert_close(
        written[f"model.layers.{LAYERS}.eh_proj.weight"], state["mtp_layers.0.input_proj.weight"]
    )
    config = json.loads((tmp_path / "stitched" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == LAYERS


@pytest.mark.parametrize("model_type", MTP_LAYER_TYPES)
def test_speculators_format_is_refused_in_one_line(targets, model_type, tmp_path):
    """speculators' MTPDraftModel builds layers for the model types of its mtp_model_classes
    (src/speculators/models/mtp/model_definitions.py: qwen3, qwen3_next, qwen3_5_text,
    qwen3_5_moe_text) only."""
    from specdraft.drafts.mtp.export import write_speculators

    draft = new_draft(targets[model_type])
    assert draft.default_serving_formats() == []  # stitched: on request
    with pytest.raises(SpecdraftError) as err:
        write_speculators(draft, draft.state_dict(), tmp_path / "spec", str(targets[model_type]))
    assert str(err.value) == speculators_refusal(draft) and "\n" not in str(err.value)
    assert f"not {model_type}" in str(err.value) and not (tmp_path / "spec").exists()


def vllm_spec_layer(config: dict, name: str):
    """vLLM's get_spec_layer_idx_from_weight_name (vllm/model_executor/models/deepseek_v2.py; the
    same in glm4_moe_mtp.py): a weight is MTP layer L + i's when it starts with
    model.layers.{num_hidden_layers + i}. for i < num_nextn_predict_layers."""
    start = config["num_hidden_layers"]
    for i in range(config.get("num_nextn_predict_layers", 0)):
        if name.startswith(f"model.layers.{start + i}."):
            return start + i
    return None


def vllm_rewrite(spec_layer: int, name: str) -> str:
    """DeepSeekMTP._rewrite_spec_layer_name (vllm/model_executor/models/deepseek_mtp.py): enorm, hnorm,
    eh_proj, shared_head and embed_tokens stay the MTP layer's own (embed_tokens shared at the top),
    every other name is its decoder layer's (mtp_block)."""
    if not any(part in name for part in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")):
        return name.replace(f"model.layers.{spec_layer}.", f"model.layers.{spec_layer}.mtp_block.")
    if "embed_tokens" in name:
        return name.replace(f"model.layers.{spec_layer}.", "model.")
    return name


@pytest.mark.parametrize("model_type", MTP_LAYER_TYPES)
def test_vllm_reads_the_stitched_layer_by_its_names(targets, model_type, tmp_path):
    """What vLLM's method "mtp" loads from the stitched target (SpeculativeConfig.hf_config_override,
    vllm/config/speculative.py: deepseek_v3 -> deepseek_mtp, Glm4MoeForCausalLM -> glm4_moe_mtp, each
    with n_predict = num_nextn_predict_layers): layer num_hidden_layers, its enorm / hnorm / eh_proj /
    shared_head weights, and its decoder layer's, named as the target's own layers are (every
    mtp_block name is a name of the target's layer L-1, the same class)."""
    draft = new_draft(targets[model_type])
    write_stitched(draft, draft.state_dict(), tmp_path / "stitched", str(targets[model_type]))
    config = json.loads((tmp_path / "stitched" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config["architectures"] == [
        {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}[model_type]
    ]
    written = load_file(str(tmp_path / "stitched" / "model.safetensors"))
    own = {
        name[len(f"model.layers.{LAYERS - 1}.") :] for name in written if name.startswith(f"model.layers.{LAYERS - 1}.")
    }
    spec = [name for name in written if vllm_spec_layer(config, name) is not None]
    assert spec and all(name.startswith(f"model.layers.{LAYERS}.") for name in spec)
    block = set()
    for name in spec:
        rewritten = vllm_rewrite(LAYERS, name)
        if ".mtp_block." in rewritten:
            block.add(rewritten.split(".mtp_block.", 1)[1])
        else:
            assert rewritten in (
                "model.embed_tokens.weight",
                *(
                    f"model.layers.{LAYERS}.{n}.weight"
                    for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
                ),
            ), rewritten
    assert block == own  # the decoder layer, as the target's MoE layers are named
