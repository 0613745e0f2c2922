"""`draft.init_from` reads every format bit for bit, and refuses bad files in one line.

Each family's draft (random weights of a realistic scale, EAGLE-3 with its own vocabulary maps) is
written by our writers in each format a family has (native, speculators, the EAGLE / SGLang layout
as .safetensors / .bin / .pth, LongSpec's GLIDE), imported back, and compared tensor by tensor;
then exported again and compared file by file. LongSpec's file loads strictly into a decoder layer
with LongSpec's module names, written here from its published description.
"""

import pickle

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from helpers import imported_draft
from specdraft.config import TrainConfig
from specdraft.drafts.registry import FAMILIES, build_draft
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.errors import SpecdraftError
from specdraft.export.files import write_draft_export
from specdraft.export.init_from import read_init_from

SMALL = {
    "glide": {"attention_bias": True},
    "eagle3": {"ttt_steps": 2, "draft_vocab_size": 200},
    "dflash": {"num_layers": 2, "block_size": 4},
    "dspark": {"num_layers": 1, "block_size": 4, "markov_rank": 8, "markov_head_type": "gated"},
    "peagle": {"num_depths": 3, "draft_vocab_size": 200, "mask_token_id": 3},
}
# (family, format, the file an import is pointed at: relative to the export, "" = the directory)
CASES = [
    ("glide", "native", ""),
    ("glide", "native", "draft_model_weights.pth"),
    ("glide", "longspec", ""),
    ("eagle3", "native", ""),
    ("eagle3", "speculators", ""),
    ("eagle3", "sglang", ""),
    ("eagle3", "sglang", "pytorch_model.bin"),
    ("eagle3", "sglang", "eagle3.pth"),
    ("dflash", "native", ""),
    ("dflash", "speculators", ""),
    ("dspark", "native", ""),
    ("dspark", "speculators", ""),
    ("peagle", "native", ""),
    ("peagle", "speculators", ""),
]
IDS = [f"{f}-{fmt}{'-' + path if path else ''}" for f, fmt, path in CASES]


def run_cfg(target_dir, family, init_from=None, **draft):
    cfg = OmegaConf.structured(TrainConfig(target=str(target_dir), data_files="unused"))
    cfg.draft = OmegaConf.merge(cfg.draft, dict({**SMALL[family], **draft}, type=family, init_from=init_from))
    return cfg


def random_draft(target_dir, family, seed=0, **draft):
    cfg = run_cfg(target_dir, family, **draft)
    model = build_draft(cfg.draft, AutoConfig.from_pretrained(target_dir))
    generator = torch.Generator().manual_seed(seed)
    if family in ("eagle3", "peagle"):  # maps of its own, not the data's
        counts = torch.randint(0, 1000, (model.dims.vocab_size,), generator=generator).numpy()
        model.set_vocab_maps(*vocab_maps(counts, model.dims.draft_vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "mask_delta":  # speculators' DFlash embeds MASK as the verifier's row: delta 0
                p.copy_(
                    torch.randn(p.shape, generator=generator) * 0.1
                    if p.dim() == 2
                    else torch.rand(p.shape, generator=generator) + 0.5
                )
    return model, cfg


def export_in(target_dir, tmp_path, family, fmt, path, **draft):
    """(the source draft, its config, the path to import) with the draft written in `fmt`."""
    model, cfg = random_draft(target_dir, family, **draft)
    out = write_draft_export(
        tmp_path / "step_1", model.state_dict(), model, cfg, serving=[] if fmt == "native" else [fmt]
    )
    where = out if fmt == "native" else out / fmt
    if path.endswith((".bin", ".pth")) and fmt == "sglang":  # the official EAGLE-3 releases' pickles
        torch.save(load_file(str(where / "model.safetensors")), where / path)
        (where / "model.safetensors").unlink()
    return model, cfg, where / path if path else where


def imported_state(target_dir, family, source, **draft):
    cfg = run_cfg(target_dir, family, init_from=str(source), **draft)
    return imported_draft(cfg, AutoConfig.from_pretrained(target_dir))


def assert_equal_states(got, want):
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family,fmt,path", CASES, ids=IDS)
def test_every_format_imports_bit_for_bit_and_exports_again_bit_for_bit(served_target_dir, tmp_path, family, fmt, path):
    model, cfg, source = export_in(served_target_dir, tmp_path / "a", family, fmt, path)
    imported, fresh = imported_state(served_target_dir, family, source)
    assert imported.fmt == fmt
    assert_equal_states(fresh.state_dict(), model.state_dict())  # d2t / t2d too: never recounted
    # export -> init_from -> export: the same tensors in the same file of that format
    again = write_draft_export(
        tmp_path / "b" / "step_1", fresh.state_dict(), fresh, cfg, serving=[] if fmt == "native" else [fmt]
    )
    again = again if fmt == "native" else again / fmt
    assert_equal_states(read(weights_file(again)), read(weights_file(source)))
    if weights_file(again).name == weights_file(source).name:  # the same file: the same bytes
        assert weights_file(again).read_bytes() == weights_file(source).read_bytes()
    if fmt == "native":
        assert_equal_states(
            read(again / "draft_model_weights.pth"), read(tmp_path / "a" / "step_1" / "draft_model_weights.pth")
        )


def read(path):
    return load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def test_a_run_directory_imports_its_newest_export(served_target_dir, tmp_path):
    model, cfg = random_draft(served_target_dir, "glide")
    older, _ = random_draft(served_target_dir, "glide", seed=1)
    write_draft_export(tmp_path / "run" / "step_2", older.state_dict(), older, cfg)
    write_draft_export(tmp_path / "run" / "step_10", model.state_dict(), model, cfg)
    imported, fresh = imported_state(served_target_dir, "glide", tmp_path / "run")
    assert imported.path == tmp_path / "run" / "step_10" / "model.safetensors"
    assert_equal_states(fresh.state_dict(), model.state_dict())


# -- bad files: one line, nothing run -------------------------------------------------------------


def weights_file(source):
    if source.is_file():
        return source
    for name in ("model.safetensors", "draft_model_weights.pth"):
        if (source / name).is_file():
            return source / name


def rewrite(path, change):
    tensors = read(path)
    change(tensors)
    if path.suffix == ".safetensors":
        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)


BAD = [
    ("glide", "native", "", "self_attn.q_proj.weight", "target"),
    ("glide", "longspec", "", "self_attn.q_proj.bias", "draft.attention_bias"),
    ("eagle3", "native", "", "lm_head.weight", "draft.draft_vocab_size"),
    ("eagle3", "speculators", "", "fc.weight", "target"),
    ("eagle3", "sglang", "pytorch_model.bin", "midlayer.mlp.up_proj.weight", "target"),
    ("dflash", "speculators", "", "fc.weight", "draft.target_layers"),
    ("dspark", "speculators", "", "markov_head.markov_w1.weight", "draft.markov_rank"),
]


@pytest.mark.parametrize("family,fmt,path,tensor,key", BAD, ids=[f"{c[0]}-{c[1]}" for c in BAD])
def test_a_wrong_shape_or_a_missing_tensor_is_one_line_naming_it(
    served_target_dir, tmp_path, family, fmt, path, tensor, key
):
    _, _, source = export_in(served_target_dir, tmp_path, family, fmt, path)
    weights = weights_file(source)
    original = read(weights)[tensor]
    rewrite(weights, lambda t: t.__setitem__(tensor, torch.zeros(original.shape[0] + 1, *original.shape[1:])))
    err = import_error(served_target_dir, family, source)
    assert err == (
        f"{weights}: tensor {tensor!r} has shape {tuple(original.shape[:0]) + (original.shape[0] + 1,) + tuple(original.shape[1:])}, "
        f"this run's draft needs {tuple(original.shape)} ({hint(key)})"
    )
    rewrite(weights, lambda t: t.pop(tensor))
    assert import_error(served_target_dir, family, source) == f"{weights}: missing tensor {tensor!r} ({hint(key)})"


def hint(key):
    if key == "target":
        return (
            "its shape comes from the target's config: the imported draft was made for another `target`, "
            "or another draft.* key of its family"
        )
    return f"set {key} to match the imported draft"


def import_error(target_dir, family, source, **draft) -> str:
    with pytest.raises(SpecdraftError) as err:
        read_init_from(
            run_cfg(target_dir, family, init_from=str(source), **draft), AutoConfig.from_pretrained(target_dir)
        )
    message = str(err.value)
    assert "\n" not in message
    return message


class RunsCode:
    """A pickle that would create a file when unpickled with weights_only=False."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.mark.parametrize(
    "family,fmt,name",
    [
        ("glide", "native", "draft_model_weights.pth"),
        ("glide", "longspec", "draft_model_weights.pth"),
        ("eagle3", "sglang", "pytorch_model.bin"),
        ("eagle3", "speculators", "pytorch_model.bin"),
        ("dflash", "speculators", "pytorch_model.bin"),
    ],
)
def test_a_pickle_that_runs_code_is_refused_and_never_run(served_target_dir, tmp_path, family, fmt, name):
    _, _, source = export_in(served_target_dir, tmp_path, family, fmt, "")
    for weights in source.glob("*.safetensors"):
        weights.unlink()  # the pickle is the only weights file left
    marker = tmp_path / "it_ran"
    torch.save({"fc.weight": torch.zeros(1), "payload": RunsCode(marker)}, source / name)
    err = import_error(served_target_dir, family, source)
    assert err.startswith(f"{source / name}: refused: the pickle asks for more than tensors")
    assert "Unsupported global" in err and not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # the same file, read our way, outside the import
        torch.load(source / name, weights_only=True)
    assert not marker.exists()


def test_another_family_or_another_setting_is_one_line_naming_the_key(served_target_dir, tmp_path):
    _, _, source = export_in(served_target_dir, tmp_path / "a", "eagle3", "speculators", "")
    assert import_error(served_target_dir, "glide", source) == (
        f"{source / 'model.safetensors'}: a eagle3 draft (speculators files); this run trains draft.type 'glide' "
        f"(set draft.type: eagle3)"
    )
    assert import_error(served_target_dir, "eagle3", source, target_layers=[0, 1, 3]) == (
        f"{source / 'model.safetensors'}: the imported draft has draft.target_layers=[1, 2, 3], this run's draft "
        f"[0, 1, 3] (set draft.target_layers: [1, 2, 3])"
    )
    _, _, source = export_in(served_target_dir, tmp_path / "b", "dflash", "native", "")
    assert import_error(served_target_dir, "dflash", source, num_layers=1) == (
        f"{source / 'model.safetensors'}: unexpected tensor 'layers.1.input_layernorm.weight': this run's draft "
        f"has no such tensor ({hint('target')})"
    )


# -- LongSpec's own layer ----------------------------------------------------------------------------


class LongSpecAttention(nn.Module):
    """q/k/v/o as LongSpec's layer names them (Qwen2 targets: q/k/v biases)."""

    def __init__(self, hidden, heads, kv_heads, head_dim, bias):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class LongSpecGlideLayer(nn.Module):
    """LongSpec's GLIDE decoder layer, built from the TARGET's config (REFERENCE.md "LongSpec's GLIDE
    files"): self_attn, cross_attn (its k/v never used), mlp, and the three norms."""

    def __init__(self, config, bias):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.self_attn = LongSpecAttention(hidden, heads, config.num_key_value_heads, head_dim, bias)
        self.cross_attn = LongSpecAttention(hidden, heads, config.num_key_value_heads, head_dim, bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        for name in ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm"):
            norm = nn.Module()
            norm.weight = nn.Parameter(torch.ones(hidden))
            setattr(self, name, norm)


@pytest.mark.parametrize("bias", [True, False])
def test_the_longspec_export_loads_strictly_into_longspecs_layer(served_target_dir, tmp_path, bias):
    model, cfg, source = export_in(served_target_dir, tmp_path, "glide", "longspec", "", attention_bias=bias)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(served_target_dir).save_pretrained(tmp_path / "tokenizer")
    tokenizer_files = {p.name for p in (tmp_path / "tokenizer").iterdir()}
    assert {p.name for p in source.iterdir()} == {
        "draft_model_weights.pth",
        "config.json",
        "training_config.yaml",
        *tokenizer_files,
    }
    # the target's config, as LongSpec builds its layer from it
    assert (source / "config.json").read_bytes() == (served_target_dir / "config.json").read_bytes()
    config = AutoConfig.from_pretrained(source)
    layer = LongSpecGlideLayer(config, bias)
    layer.load_state_dict(torch.load(source / "draft_model_weights.pth", weights_only=True), strict=True)
    ours = model.state_dict()
    assert torch.equal(layer.post_self_attention_layernorm.weight, ours["cross_layernorm.weight"])
    assert torch.equal(layer.post_cross_attention_layernorm.weight, ours["post_attention_layernorm.weight"])
    assert torch.equal(layer.cross_attn.q_proj.weight, ours["cross_attn.q_proj.weight"])
    assert not layer.cross_attn.k_proj.weight.any() and not layer.cross_attn.v_proj.weight.any()
    if bias:
        assert torch.equal(layer.self_attn.k_proj.bias, ours["self_attn.k_proj.bias"])


def test_glide_attention_bias_follows_the_target(served_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(served_target_dir)
    cfg = run_cfg(served_target_dir, "glide", attention_bias=None)
    assert build_draft(cfg.draft, config).dims.attention_bias is False  # a Llama target
    qwen2 = AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    draft = build_draft(cfg.draft, qwen2)
    assert draft.dims.attention_bias is True
    assert {k for k in draft.state_dict() if k.endswith("bias")} == {
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "cross_attn.q_proj.bias",
    }


def test_a_final_norm_glide_is_refused_by_the_longspec_format(served_target_dir, tmp_path):
    model, cfg = random_draft(served_target_dir, "glide", final_norm=True)
    assert model.serving_refusal("longspec").startswith("draft.final_norm: LongSpec's GLIDE layer")
    assert model.default_serving_formats() == [] and FAMILIES["glide"].on_request_formats == ("longspec",)


@pytest.mark.parametrize(
    "family,fmt,draft",
    [
        ("eagle3", "speculators", {"fc_norm": True, "norm_output": True}),
        ("eagle3", "sglang", {}),
        ("dflash", "speculators", {"sample_from_anchor": True}),
        ("dspark", "speculators", {"confidence_with_markov": False}),
        ("peagle", "speculators", {"fc_norm": True, "mask_token_id": 9}),
    ],
)
def test_an_import_reads_back_the_settings_our_writer_records(served_target_dir, tmp_path, family, fmt, draft):
    import json

    model, _, source = export_in(served_target_dir, tmp_path, family, fmt, "", **draft)
    recorded = FAMILIES[family].file_formats[fmt].settings(json.loads((source / "config.json").read_text()))
    keys = ("target_layers",) if fmt == "sglang" else FAMILIES[family].import_settings  # SGLang records only the layers
    assert recorded == {key: getattr(model.dims, key) for key in keys}


def test_a_whole_vocab_speculators_eagle3_imports_with_identity_maps(served_target_dir, tmp_path):
    model, _, source = export_in(served_target_dir, tmp_path, "eagle3", "speculators", "", draft_vocab_size=512)
    assert not {"d2t", "t2d"} & set(load_file(str(source / "model.safetensors")))  # speculators has none then
    _, fresh = imported_state(served_target_dir, "eagle3", source, draft_vocab_size=512)
    assert_equal_states(fresh.state_dict(), model.state_dict())
    assert fresh.t2d.all() and not fresh.d2t.any()


def test_files_of_no_format_we_read_are_one_line(served_target_dir, tmp_path):
    import json

    _, _, source = export_in(served_target_dir, tmp_path, "eagle3", "speculators", "")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, speculators_model_type="xpress")))
    readers = ", ".join(family for family, cls in FAMILIES.items() if "speculators" in cls.file_formats)
    assert import_error(served_target_dir, "eagle3", source) == (
        f"{source / 'config.json'}: speculators_model_type 'xpress': specdraft reads speculators drafts of "
        f"{readers} only"
    )
    assert readers == "eagle3, dflash, dspark, mtp, peagle, dflash2"
    save_file({"model.layers.0.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    assert import_error(served_target_dir, "eagle3", tmp_path / "other.safetensors").startswith(
        f"{tmp_path / 'other.safetensors'}: not a draft format specdraft reads (tensors model.layers.0.weight, ...)"
    )
    (tmp_path / "empty").mkdir()
    assert import_error(served_target_dir, "eagle3", tmp_path / "empty") == (
        f"{tmp_path / 'empty'}: no draft weights there (model.safetensors, pytorch_model.bin, draft_model_weights.pth), and "
        f"not a run directory with step_<N>/ exports"
    )
