"""The servers' conventions, one test per row of the "Conventions" table of docs/serving.md.

Where the consumer runs here (speculators, through tests/speculators_env.py) the test runs its
classes; where it does not (SGLang, vLLM's capture), the test checks our files against the rule
its source states (cited in each docstring and in docs/serving.md).
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from helpers import random_llama
from specdraft.drafts.eagle3.export import serving_refusal
from specdraft.drafts.eagle3.vocab import draft_to_target_ids
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture
from specdraft.export.files import write_draft_export
from test_eagle3_export import assert_speculators_computes_our_logits, random_eagle3, run_cfg

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # small: the scaled band covers most frequencies


def tiny_llama(layers=6, vocab=160, rope_scaling=None, max_positions=512, theta=10000.0):
    return random_llama(
        vocab=vocab, layers=layers, max_positions=max_positions, rope_theta=theta, rope_scaling=rope_scaling
    )


@pytest.fixture(scope="module")
def llama31_dir(tmp_path_factory):
    """A target shaped like Llama-3.1: rope_theta 500000, llama3 rope scaling, 8192 positions."""
    directory = tmp_path_factory.mktemp("llama31")
    tiny_llama(rope_scaling=dict(LLAMA31_ROPE), max_positions=8192, theta=500000.0).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plain")
    tiny_llama().save_pretrained(directory)
    return directory


def target_of(directory):
    return LlamaForCausalLM.from_pretrained(directory).eval()


# -- layer numbering and order ------------------------------------------------------------------


def test_sglang_gets_our_layer_ids_minus_one(plain_dir, tmp_path):
    """SGLang's LlamaForCausalLM.set_eagle3_layers_to_capture (python/sglang/srt/models/llama.py)
    captures `val + 1` for each id, and LlamaModel.forward appends layer i's input before running
    it: SGLang's id i is the output of layer i. Ours (vLLM's) are layer inputs."""
    target = target_of(plain_dir)
    cfg = run_cfg(plain_dir, tmp_path, draft_vocab_size=100, target_layers=[1, 3, 4])
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg, serving=["sglang"])
    ids = json.loads((export / "sglang" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ]
    layers_to_capture = [val + 1 for val in ids]  # SGLang's rule
    assert layers_to_capture == draft.dims.target_layers == [1, 3, 4]


def test_captured_states_concatenate_in_increasing_layer_order(plain_dir, tmp_path):
    """vLLM's LlamaModel.forward (vllm/model_executor/models/llama.py) and SGLang's append the
    captured states while looping over the layers, so fc's input is in increasing layer order
    whatever order the config lists: an unsorted draft.target_layers is sorted."""
    target = target_of(plain_dir)
    draft = random_eagle3(target, run_cfg(plain_dir, tmp_path, draft_vocab_size=100, target_layers=[4, 0, 2]))
    assert draft.dims.target_layers == [0, 2, 4]
    ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(0))
    feats = capture(target.model, ids, torch.arange(12)[None], draft.capture_request())
    hidden = target.model(ids, output_hidden_states=True).hidden_states  # hidden[i]: input of layer i
    torch.testing.assert_close(draft.aux_hidden(feats), torch.cat([hidden[0], hidden[2], hidden[4]], dim=-1))


def test_duplicate_layers_are_refused_in_one_line(plain_dir, tmp_path):
    from specdraft.drafts.eagle3.model import Eagle3Draft

    cfg = run_cfg(plain_dir, tmp_path, target_layers=[2, 4, 2])
    with pytest.raises(SpecdraftError) as err:
        Eagle3Draft.validate_config(cfg.draft, target_of(plain_dir).config, "run.yaml", 64)
    assert "draft.target_layers" in str(err.value) and "\n" not in str(err.value)


def test_a_layer_no_server_captures_is_refused_in_one_line(plain_dir, tmp_path):
    """vLLM and SGLang capture before each layer runs (idx < L): id L, the last layer's output,
    is never captured. SGLang has no id for the embeddings (vLLM id 0 would be its -1)."""
    target = target_of(plain_dir)  # 6 layers
    last = random_eagle3(target, run_cfg(plain_dir, tmp_path, draft_vocab_size=100, target_layers=[1, 3, 6]))
    assert last.default_serving_formats() == []  # native only
    for fmt in ("speculators", "sglang"):
        with pytest.raises(SpecdraftError) as err:
            write_draft_export(
                tmp_path / f"last_{fmt}", last.state_dict(), last, run_cfg(plain_dir, tmp_path), serving=[fmt]
            )
        assert str(err.value).startswith("draft.target_layers: layer 6 is the last layer's output")
        assert "\n" not in str(err.value) and not (tmp_path / f"last_{fmt}").exists()
    embeddings = random_eagle3(target, run_cfg(plain_dir, tmp_path, draft_vocab_size=100, target_layers=[0, 3, 5]))
    assert embeddings.default_serving_formats() == ["speculators"]
    assert serving_refusal(embeddings.dims, "sglang").startswith("draft.target_layers: layer 0 (the embeddings)")
    assert "no sglang export" in embeddings.describe()


# -- RoPE and positions ---------------------------------------------------------------------------


def test_llama31_rope_scaling_is_the_targets_and_speculators_computes_our_logits(llama31_dir, tmp_path):
    """The draft's rotary is the target's (theta 500000, llama3 scaling): speculators'
    Eagle3DraftModel builds its rotary from transformer_layer_config (speculators/models/eagle3/
    core.py, Eagle3DraftModel.__init__), and its forward equals ours on a Llama-3.1-shaped target."""
    target = target_of(llama31_dir)
    cfg = run_cfg(llama31_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    theirs = LlamaRotaryEmbedding(target.config)
    unscaled = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0))
    torch.testing.assert_close(draft.rotary_emb.inv_freq, theirs.inv_freq, rtol=0, atol=0)
    assert not torch.allclose(draft.rotary_emb.inv_freq, unscaled.inv_freq)  # the scaling matters here
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    layer = json.loads((export / "speculators" / "config.json").read_text())["transformer_layer_config"]
    assert layer["rope_parameters"] == {**LLAMA31_ROPE, "rope_theta": 500000.0}
    assert_speculators_computes_our_logits(target, draft, export / "speculators", tmp_path)


def test_sglang_config_spells_rope_as_its_llama_layer_reads_it(llama31_dir, tmp_path):
    """SGLang's LlamaDecoderLayer (python/sglang/srt/models/llama.py) reads getattr(config,
    "rope_theta", 10000), getattr(config, "rope_scaling", None) and max_position_embeddings."""
    target = target_of(llama31_dir)
    cfg = run_cfg(llama31_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg, serving=["sglang"])
    config = json.loads((export / "sglang" / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {**LLAMA31_ROPE, "type": "llama3"}
    assert config["max_position_embeddings"] == 8192


def test_max_position_embeddings_is_the_targets(llama31_dir, tmp_path):
    """A draft config left at 2048 collapsed tau on long contexts (SpecForge PR #271): every
    export carries the target's max_position_embeddings."""
    target = target_of(llama31_dir)
    cfg = run_cfg(llama31_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    speculators = json.loads((export / "speculators" / "config.json").read_text())
    assert speculators["transformer_layer_config"]["max_position_embeddings"] == 8192
    assert json.loads((export / "sglang" / "config.json").read_text())["max_position_embeddings"] == 8192
    assert json.loads((export / "config.json").read_text())["dims"]["max_position_embeddings"] == 8192


# -- vocabulary, embeddings, head -----------------------------------------------------------------


def test_d2t_is_an_offset_from_draft_id_to_target_id(plain_dir, tmp_path):
    """target = draft + d2t[draft]: SGLang's LlamaForCausalLMEagle3.load_weights (hot_token_id =
    d2t + arange), speculators' `draft_ids + self.d2t[draft_ids]`; t2d (target vocab,) bool marks
    the draft's tokens."""
    target = target_of(plain_dir)
    cfg = run_cfg(plain_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    for fmt in ("speculators", "sglang"):
        with safe_open(str(export / fmt / "model.safetensors"), "pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        hot_token_id = d2t + torch.arange(d2t.shape[0])  # SGLang's rule
        assert torch.equal(hot_token_id, draft_to_target_ids(draft.d2t))
        assert t2d.dtype == torch.bool and t2d.shape == (160,) and int(t2d.sum()) == 100
        assert bool(t2d[hot_token_id].all())


def test_embeddings_are_the_targets_and_the_head_is_the_drafts(plain_dir, tmp_path):
    """speculators loads embed_tokens from the file (written: the target's); SGLang takes the
    target's (set_embed; no key written); the head over the draft vocab is the draft's own."""
    target = target_of(plain_dir)
    cfg = run_cfg(plain_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    with safe_open(str(export / "speculators" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), target.model.embed_tokens.weight)
        assert torch.equal(f.get_tensor("lm_head.weight"), draft.lm_head.weight)
    with safe_open(str(export / "sglang" / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
        assert torch.equal(f.get_tensor("lm_head.weight"), draft.lm_head.weight)


# -- dtype ------------------------------------------------------------------------------------


def test_a_bf16_draft_keeps_its_rotary_fp32_as_training_does(plain_dir, tmp_path):
    """DeepSpeed's bf16 engine casts parameters only (engine._configure_distributed_model:
    "preserve fp32 buffers (e.g. rotary inv_freq)"); Draft.cast does the same at eval, and the
    exported weights load into the same draft."""
    from specdraft.export.files import load_exported_draft

    target = target_of(plain_dir)
    cfg = run_cfg(plain_dir, tmp_path, draft_vocab_size=100)
    draft = random_eagle3(target, cfg)
    trained = draft.rotary_emb.inv_freq.clone()
    export = write_draft_export(tmp_path / "step_1", draft.state_dict(), draft, cfg)
    loaded, _ = load_exported_draft(export, torch.bfloat16)
    for model in (loaded, random_eagle3(target, cfg).cast(torch.bfloat16)):
        assert model.fc.weight.dtype == torch.bfloat16
        assert model.rotary_emb.inv_freq.dtype == torch.float32
        assert torch.equal(model.rotary_emb.inv_freq, trained)
        assert model.d2t.dtype == torch.long and model.t2d.dtype == torch.bool


# -- the targets of docs/targets.md, at their released depths --------------------------------------

# model_type -> (released model, num_hidden_layers of its published config.json)
RELEASED_DEPTHS = {
    "gpt_oss": ("gpt-oss-20b", 24),
    "qwen3_moe": ("Qwen3-30B-A3B", 48),
    "deepseek_v3": ("DeepSeek-V3", 61),
    "glm4_moe": ("GLM-4.5", 92),
    "gemma3_text": ("gemma-3-27b", 62),
    "mistral": ("Mistral-7B-v0.1", 32),
    "phi3": ("Phi-3-mini", 32),
    "qwen3_next": ("Qwen3-Next-80B-A3B", 48),
}


@pytest.mark.parametrize("model_type", sorted(RELEASED_DEPTHS))
def test_eagle3_layer_ids_of_each_target_are_the_servers_default(model_type, tmp_path):
    """EAGLE-3's default layers on a target of the released depth L are [2, L//2, L-3]: speculators'
    resolve_target_layer_ids (src/speculators/models/utils.py:52, what Eagle3DraftModel.from_pretrained
    fills in when the config names none: models/eagle3/core.py:169) and vLLM's SupportsEagle3 default
    (get_eagle3_aux_hidden_state_layers). The speculators config names them as they are, SGLang's
    eagle_config one less (set_eagle3_layers_to_capture captures val + 1); the verifier block names
    the target's architectures (src/speculators/config.py:80-99, VerifierConfig.from_pretrained)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from specdraft.drafts.eagle3.export import sglang_config, speculators_config
    from specdraft.drafts.eagle3.layer import Eagle3Dims, layer_dims

    name, layers = RELEASED_DEPTHS[model_type]
    config = AutoConfig.for_model(
        model_type,
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    config.architectures = [f"{type(config).__name__[: -len('Config')]}ForCausalLM"]
    config.save_pretrained(tmp_path)
    cfg = run_cfg(tmp_path, tmp_path / "out")
    draft = SimpleNamespace(dims=Eagle3Dims(**layer_dims(config, cfg.draft, "eagle3")))
    default = [2, layers // 2, layers - 3]
    assert draft.dims.target_layers == default, name
    speculators = speculators_config(draft, str(tmp_path))
    assert speculators["eagle_aux_hidden_state_layer_ids"] == default
    assert speculators["speculators_config"]["verifier"]["architectures"] == config.architectures
    assert sglang_config(draft)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in default]


@pytest.mark.parametrize(
    "model_type,rope",
    [
        ("gemma3_text", {"rope_type": "default", "rope_theta": 10000.0}),
        ("glm4_moe", {"rope_type": "default", "rope_theta": 10000.0}),
        (
            "gpt_oss",
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
                "rope_theta": 150000.0,
            },
        ),
    ],
)
def test_an_eagle3_drafts_rope_is_one_flat_table_over_its_whole_head(model_type, rope):
    """The draft's own RoPE, as its transformer_layer_config writes it: Gemma 3's nested per-layer
    rope_parameters flattened to the local layers' (speculators' flatten_rope_parameters,
    src/speculators/models/utils.py:60, takes "sliding_attention"), a partial_rotary_factor dropped
    (the draft rotates its whole head, as its LlamaRotaryEmbedding does in training; vLLM's get_rope
    would rotate part of it), gpt-oss's YaRN kept."""
    from transformers import AutoConfig

    from specdraft.drafts.eagle3.layer import layer_dims
    from specdraft.target.rotary import draft_rope_parameters

    config = AutoConfig.for_model(
        model_type,
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    )
    assert draft_rope_parameters(config) == rope
    assert layer_dims(config, run_cfg("unused", "unused").draft, "eagle3")["rope_parameters"] == rope
