"""The light reader returns exactly the tensors transformers would load, from every layout, and
turns each kind of broken checkpoint into a one-line SpecdraftError naming the file."""

import json
import pickle
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from specdraft.errors import SpecdraftError
from specdraft.target import checkpoint_files
from specdraft.target.weights import describe_target, format_target_description, load_target_head_weights

SHARD = "40KB"  # small enough that every tiny model below spans several shards


# ------------------------------------------------------------------------- tiny target models


def llama_config(**overrides):
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        **overrides,
    )


def qwen2_config(**overrides):
    return Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=160,
        **overrides,
    )


def qwen3_config(**overrides):
    return Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        **overrides,
    )


def gemma3_config():
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=200,
        sliding_window=16,
        max_position_embeddings=64,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=199,
        boi_token_index=197,
        eoi_token_index=198,
    )


def build_model(config):
    torch.manual_seed(0)
    if isinstance(config, Gemma3Config):
        return Gemma3ForConditionalGeneration(config)
    return AutoModelForCausalLM.from_config(config)


def save_bin(model, directory, shards=1):
    """pytorch_model.bin layouts, written by hand: transformers 5 save_pretrained writes safetensors only."""
    model.config.architectures = [type(model).__name__]  # model.save_pretrained would record it
    model.config.save_pretrained(directory)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    keys = list(state)
    weight_map = {}
    for shard in range(shards):
        name = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        shard_keys = keys[shard::shards]
        torch.save({key: state[key] for key in shard_keys}, directory / name)
        weight_map.update(dict.fromkeys(shard_keys, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))


# name -> (config factory, how to save)
CHECKPOINTS = {
    "llama": (llama_config, "safetensors"),
    "llama-bin": (llama_config, "bin"),
    "qwen2-tied-sharded": (lambda: qwen2_config(tie_word_embeddings=True), "safetensors-sharded"),
    "qwen2-bin-sharded": (qwen2_config, "bin-sharded"),
    "qwen3-tied": (lambda: qwen3_config(tie_word_embeddings=True), "safetensors"),
    "qwen3-untied-sharded": (lambda: qwen3_config(tie_word_embeddings=False), "safetensors-sharded"),
    "qwen3-tied-bin": (lambda: qwen3_config(tie_word_embeddings=True), "bin"),
    "qwen3-tied-bin-sharded": (lambda: qwen3_config(tie_word_embeddings=True), "bin-sharded"),
    "qwen3-untied-bin": (lambda: qwen3_config(tie_word_embeddings=False), "bin"),
    "gemma3-mm-sharded": (gemma3_config, "safetensors-current-sharded"),
    "gemma3-mm-legacy": (gemma3_config, "safetensors"),
}


def save_checkpoint(name, directory):
    make_config, layout = CHECKPOINTS[name]
    model = build_model(make_config())
    if layout == "safetensors":
        model.save_pretrained(directory)  # Gemma 3 keys come out in the legacy hub layout
    elif layout == "safetensors-sharded":
        model.save_pretrained(directory, max_shard_size=SHARD)
    elif layout == "safetensors-current-sharded":
        model.save_pretrained(directory, max_shard_size=SHARD, save_original_format=False)
    else:
        save_bin(model, directory, shards=3 if layout == "bin-sharded" else 1)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> its directory, built on first use and shared by the module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = save_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    """A private copy of a built checkpoint, free to break."""

    def get(name):
        return shutil.copytree(checkpoint(name), tmp_path / name)

    return get


def reference_head(directory):
    """What a trainer got by building the whole target."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def edit_config(directory, edit):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def raises_one_line(call, *fragments):
    with pytest.raises(SpecdraftError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


# ------------------------------------------------------------------------------ correct reads


def test_the_layouts_under_test_are_what_they_claim(checkpoint):
    assert (checkpoint("qwen3-untied-sharded") / "model.safetensors.index.json").is_file()
    assert (checkpoint("qwen2-bin-sharded") / "pytorch_model.bin.index.json").is_file()
    assert (checkpoint("llama-bin") / "pytorch_model.bin").is_file()
    legacy = load_file(checkpoint("gemma3-mm-legacy") / "model.safetensors")
    assert "language_model.model.embed_tokens.weight" in legacy
    index = json.loads((checkpoint("gemma3-mm-sharded") / "model.safetensors.index.json").read_text())
    assert "model.language_model.embed_tokens.weight" in index["weight_map"]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_reads_the_tensors_transformers_loads(checkpoint, name):
    directory = checkpoint(name)
    reference_embed, reference_head_weight = reference_head(directory)

    head = load_target_head_weights(directory)

    assert torch.equal(head.embed_tokens, reference_embed)
    assert torch.equal(head.lm_head, reference_head_weight)
    assert head.tied == (reference_head_weight is reference_embed)
    assert (head.lm_head is head.embed_tokens) == head.tied
    assert head.embed_tokens.device.type == "cpu"
    assert head.embed_location.shape == tuple(reference_embed.shape)


def test_untied_heads_really_differ(checkpoint):
    head = load_target_head_weights(checkpoint("qwen3-untied-sharded"))
    assert not head.tied
    assert not torch.equal(head.embed_tokens, head.lm_head)
    assert head.lm_head_location.key == "lm_head.weight"


def test_casts_to_the_requested_dtype(checkpoint):
    directory = checkpoint("qwen3-untied-sharded")
    reference_embed, reference_head_weight = reference_head(directory)

    head = load_target_head_weights(directory, dtype=torch.bfloat16)

    assert head.embed_tokens.dtype == head.lm_head.dtype == torch.bfloat16
    assert torch.equal(head.embed_tokens, reference_embed.to(torch.bfloat16))
    assert torch.equal(head.lm_head, reference_head_weight.to(torch.bfloat16))
    assert head.embed_location.dtype == "float32"  # where it came from, not what it became


def test_dtype_by_name(checkpoint):
    head = load_target_head_weights(checkpoint("qwen3-tied"), dtype="float16")
    assert head.embed_tokens.dtype == torch.float16 and head.lm_head is head.embed_tokens


def test_expected_sizes_that_match_pass(checkpoint):
    head = load_target_head_weights(checkpoint("qwen3-tied"), expected_vocab=256, expected_hidden=64)
    assert head.embed_tokens.shape == (256, 64)


def test_missing_tie_flag_takes_the_model_types_default(copy_of):
    # Gemma defaults to tied, Qwen3 to untied; transformers applies the same defaults.
    for name, tied in (("gemma3-mm-sharded", True), ("qwen3-untied-sharded", False)):
        directory = copy_of(name)
        edit_config(
            directory,
            lambda config: [
                section.pop("tie_word_embeddings", None) for section in (config, config.get("text_config", {}))
            ],
        )
        reference_embed, reference_head_weight = reference_head(directory)

        head = load_target_head_weights(directory)

        assert head.tied is tied
        assert torch.equal(head.embed_tokens, reference_embed)
        assert torch.equal(head.lm_head, reference_head_weight)


def test_unknown_model_type_without_lm_head_is_tied(copy_of):
    directory = copy_of("qwen3-tied")
    edit_config(
        directory, lambda config: (config.pop("tie_word_embeddings"), config.update(model_type="not-a-known-model"))
    )
    head = load_target_head_weights(directory)
    assert head.tied and head.lm_head is head.embed_tokens


def test_tied_config_with_a_different_stored_head_stays_untied(copy_of):
    # transformers refuses to tie a stored lm_head that differs from the embedding; so do we.
    directory = copy_of("qwen3-tied")
    path = directory / "model.safetensors"
    state = load_file(path)
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, path)
    reference_embed, reference_head_weight = reference_head(directory)

    head = load_target_head_weights(directory)

    assert not head.tied and head.lm_head_location.key == "lm_head.weight"
    assert torch.equal(head.embed_tokens, reference_embed)
    assert torch.equal(head.lm_head, reference_head_weight)


@pytest.mark.parametrize("name", ["qwen3-untied-sharded", "qwen3-untied-bin"])
def test_writing_to_the_tensors_leaves_the_checkpoint_alone(copy_of, name):
    directory = copy_of(name)
    before = load_target_head_weights(directory).embed_tokens.clone()

    load_target_head_weights(directory).embed_tokens.add_(1.0)

    assert torch.equal(load_target_head_weights(directory).embed_tokens, before)


def test_expected_shape_picks_among_several_embedding_keys(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    state = load_file(path)
    real = state.pop("model.embed_tokens.weight")
    state["model.embed_tokens.weight"] = torch.zeros(7, 32)  # a decoy of the wrong shape
    state["embed_tokens.weight"] = real
    save_file(state, path)

    head = load_target_head_weights(directory)

    assert head.embed_location.key == "embed_tokens.weight"
    assert torch.equal(head.embed_tokens, real)


def test_only_shards_holding_the_two_tensors_are_opened(checkpoint, monkeypatch):
    directory = checkpoint("qwen3-untied-sharded")
    headers_read, tensors_read = set(), set()
    real_header, real_safe_open = checkpoint_files.read_safetensors_header, checkpoint_files.safe_open
    monkeypatch.setattr(
        checkpoint_files, "read_safetensors_header", lambda path: headers_read.add(str(path)) or real_header(path)
    )
    monkeypatch.setattr(
        checkpoint_files,
        "safe_open",
        lambda path, **kwargs: tensors_read.add(str(path)) or real_safe_open(path, **kwargs),
    )

    head = load_target_head_weights(directory)

    wanted = {head.embed_location.file, head.lm_head_location.file}
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > len(wanted)
    assert headers_read == tensors_read == wanted


# ------------------------------------------------------------------------------- describe_target


def test_describe_reads_no_tensor_data(checkpoint, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("describe_target must not read tensor data")

    monkeypatch.setattr(checkpoint_files, "safe_open", no_data)
    directory = checkpoint("qwen3-untied-sharded")

    desc = describe_target(directory)

    assert desc["architecture"] == "Qwen3ForCausalLM"
    assert (desc["num_layers"], desc["hidden_size"], desc["vocab_size"]) == (2, 64, 256)
    assert desc["tied"] is False
    assert desc["weight_files"] > 1
    assert desc["embed_tokens"]["key"] == "model.embed_tokens.weight"
    assert desc["lm_head"]["key"] == "lm_head.weight"
    for tensor in ("embed_tokens", "lm_head"):
        assert desc[tensor]["shape"] == (256, 64)
        assert desc[tensor]["dtype"] == "float32"
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert desc[tensor]["file"] == str(directory / index["weight_map"][desc[tensor]["key"]])
    json.dumps(desc)  # the CLI may print it as JSON


def test_describe_multimodal_tied(checkpoint):
    desc = describe_target(checkpoint("gemma3-mm-sharded"))

    assert desc["architecture"] == "Gemma3ForConditionalGeneration"
    assert (desc["num_layers"], desc["hidden_size"], desc["vocab_size"]) == (1, 32, 200)
    assert desc["tied"] is True
    assert desc["lm_head"] == desc["embed_tokens"]
    assert desc["embed_tokens"]["key"] == "model.language_model.embed_tokens.weight"


def test_format_description_names_both_tensors(checkpoint):
    untied = format_target_description(describe_target(checkpoint("qwen3-untied-bin")))
    tied = format_target_description(describe_target(checkpoint("qwen3-tied")))

    assert "Qwen3ForCausalLM" in untied and "2 layers, hidden 64, vocab 256" in untied
    assert "model.embed_tokens.weight  256x64  float32  in pytorch_model.bin" in untied
    assert "lm_head.weight  256x64  float32" in untied
    assert "tied to embed_tokens" in tied


# ---------------------------------------------------------------------------------- bad inputs


def test_missing_directory(tmp_path):
    raises_one_line(lambda: load_target_head_weights(tmp_path / "nope"), tmp_path / "nope", "does not exist")


def test_missing_config(tmp_path):
    raises_one_line(lambda: describe_target(tmp_path), tmp_path / "config.json", "missing")


def test_no_weight_files(copy_of):
    directory = copy_of("llama")
    (directory / "model.safetensors").unlink()
    raises_one_line(lambda: load_target_head_weights(directory), directory, "no weight files")


def test_index_naming_a_missing_shard(copy_of):
    directory = copy_of("qwen3-untied-sharded")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (directory / gone).unlink()
    raises_one_line(lambda: load_target_head_weights(directory), "model.safetensors.index.json", gone, "does not exist")


def test_truncated_safetensors_header(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    (header_length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[: 8 + header_length // 2])
    raises_one_line(
        lambda: load_target_head_weights(directory),
        path,
        "truncated safetensors header",
        f"announces {header_length} bytes",
    )


def test_file_too_short_for_a_header_length(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    raises_one_line(lambda: load_target_head_weights(directory), path, "truncated safetensors file")


def test_truncated_safetensors_data(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    raises_one_line(lambda: load_target_head_weights(directory), path, "truncated safetensors data")


def test_neither_embedding_nor_head_present(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(32)}, path)
    raises_one_line(
        lambda: load_target_head_weights(directory), path, "no input-embedding tensor", "model.embed_tokens.weight"
    )


def test_untied_config_without_lm_head(copy_of):
    directory = copy_of("llama")
    path = directory / "model.safetensors"
    state = load_file(path)
    del state["lm_head.weight"]
    save_file(state, path)
    raises_one_line(lambda: load_target_head_weights(directory), path, "no lm_head tensor")


def test_vocab_mismatch_with_the_caller(checkpoint):
    directory = checkpoint("qwen3-untied-sharded")
    message = raises_one_line(
        lambda: load_target_head_weights(directory, expected_vocab=300),
        "(256, 64)",
        "(300, any)",
        "model.embed_tokens.weight",
    )
    assert str(directory) in message and ".safetensors" in message


def test_hidden_mismatch_with_the_caller(checkpoint):
    raises_one_line(
        lambda: load_target_head_weights(checkpoint("llama-bin"), expected_hidden=48),
        "pytorch_model.bin",
        "(128, 32)",
        "(any, 48)",
    )


def test_config_disagreeing_with_the_checkpoint(copy_of):
    directory = copy_of("qwen3-tied")
    edit_config(directory, lambda config: config.update(vocab_size=512))
    raises_one_line(
        lambda: describe_target(directory), directory / "model.safetensors", "(256, 64)", "(512, 64)", "config.json"
    )


def test_unknown_dtype(checkpoint):
    raises_one_line(lambda: load_target_head_weights(checkpoint("llama"), dtype="float99"), "float99")


class FileCreatingPayload:
    """Unpickling this runs open(marker, "w"): the shape of a malicious checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_payload_is_live_when_unpickled_unsafely(tmp_path):
    # Guards the test below: refusing the payload must be what keeps the file from appearing.
    marker = tmp_path / "created-by-plain-pickle"
    pickle.loads(pickle.dumps(FileCreatingPayload(marker), protocol=2)).close()
    assert marker.exists()


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_malicious_pickle_is_refused_not_run(copy_of, tmp_path, writer):
    directory = copy_of("llama-bin")
    path = directory / "pytorch_model.bin"
    marker = tmp_path / "pwned"
    payload = {"model.embed_tokens.weight": FileCreatingPayload(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))

    raises_one_line(lambda: load_target_head_weights(directory), path, "refused to unpickle")
    assert not marker.exists()


def test_bin_holding_a_non_tensor_entry(copy_of):
    directory = copy_of("llama-bin")
    path = directory / "pytorch_model.bin"
    torch.save({"model.embed_tokens.weight": torch.zeros(128, 32), "note": "hello"}, path)
    raises_one_line(lambda: load_target_head_weights(directory), path, "'note' is a str")


def test_bin_holding_something_other_than_a_dict(copy_of):
    directory = copy_of("llama-bin")
    path = directory / "pytorch_model.bin"
    torch.save([torch.zeros(128, 32)], path)
    raises_one_line(lambda: load_target_head_weights(directory), path, "holds a list")


def test_bin_that_is_not_a_checkpoint(copy_of):
    directory = copy_of("llama-bin")
    path = directory / "pytorch_model.bin"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    raises_one_line(lambda: load_target_head_weights(directory), path, "not a readable PyTorch checkpoint")
