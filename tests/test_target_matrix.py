"""Every target architecture specdraft accepts x every draft family (docs/targets.md is this table).

The targets are tiny random models built from transformers' own config classes (tests/target_zoo.py:
hidden 64, 4 layers, the demo tokenizer; windows of 16 / 32 below max_seq_length 64 where the
architecture has them, so the window path matters). For every cell either:

- the family trains on the target: 2 steps (saving each), a resume from step 1 that repeats step
  2's loss bit for bit, an export to every format the family has (EXPORT_FORMATS and its serving
  formats, the ones a save writes only on request included), and `specdraft eval` of the run whose
  greedy output equals the target's own (matches_target); or
- `specdraft train` refuses it: exit 2, one line, the reason below (REFUSED), before anything runs.

Apart from the cells: plain greedy decoding of every target (the baseline `eval` compares drafts
with) equals transformers' own `generate` on a prompt longer than the windows, and speculative
decoding with a tree is lossless there too (tree passes apply each layer's window themselves).
"""

import json
import math
from pathlib import Path

import pytest
import torch

from specdraft.cli import main
from specdraft.config import load_config
from specdraft.drafts.registry import FAMILIES
from specdraft.commands.export import EXPORT_FORMATS
from specdraft.train.loop import train
from target_zoo import MODEL_TYPES, build_target
from offline_runs import SMALL
from helpers import TrainingSpy, assert_every_update_moved_everything, assert_same_states

STEPS = 3
BASE = {
    "max_seq_length": 64,
    "per_device_batch_size": 2,
    "learning_rate": 1e-2,
    # rates 1/3, 2/3, 1 of the peak: a resume from step 1 that lost the schedule's state (the
    # optimizer's own state brings back update 2's rate) runs update 3 at 2/3
    "warmup_steps": STEPS,
    "logging_steps": 1,
    "max_steps": STEPS,
    "save_steps": 1,
    "keep_last": STEPS,
    "seed": 3,
    "zero_stage": 2,
}

ROTARY_DFLASH = (
    "rotates its own queries and keys over whole heads with one rotary table, the target's (servers "
    "rebuild it from the exported transformer_layer_config); the target "
)
PARTIAL = "rotates only part of each head ({0}: partial_rotary_factor {1}), its tables cover {1} of the head"
GEMMA_TABLES = (
    "rotates its layers with 2 rotary tables (gemma3_text: rope_theta full_attention 1000000.0, "
    "sliding_attention 10000.0), not one"
)
MLA = (
    "GLIDE's cross-attention takes keys and values of one head width (head_dim 8), RoPE over the whole head; "
    "deepseek_v3 attends with MLA: per head keys of 24 (16 without RoPE + 8 with interleaved RoPE) and values of "
    "16, decompressed from a cached latent of 32, which it cannot take"
)


MTP_TARGETS = ("qwen3_next", "deepseek_v3", "glm4_moe")  # a native MTP layer in transformers


def no_mtp(model_type):
    return (
        f"mtp fine-tunes a target's native MTP layer; {{target}} (model_type {model_type}) has none in "
        f"transformers (targets with one: qwen3_next checkpoints holding mtp.* tensors, deepseek_v3 and "
        f"glm4_moe ones holding model.layers.<num_hidden_layers>.*)"
    )


# (model_type, family) -> the reason `train` gives, after "specdraft: error: run.yaml: key 'draft.type': "
REFUSED = {
    ("deepseek_v3", "glide"): MLA,
    **{
        (model_type, family): f"{label} {ROTARY_DFLASH}{why}"
        for family, label in (("dflash", "DFlash"), ("dspark", "DSpark"), ("dflash2", "DFlash2"))
        for model_type, why in (
            ("gemma3_text", GEMMA_TABLES),
            ("glm4_moe", PARTIAL.format("glm4_moe", 0.5)),
            ("qwen3_next", PARTIAL.format("qwen3_next", 0.25)),
        )
    },
    **{(model_type, "mtp"): no_mtp(model_type) for model_type in MODEL_TYPES if model_type not in MTP_TARGETS},
}
CELLS = [(model_type, family) for model_type in MODEL_TYPES for family in FAMILIES]
# (model_type, family, serving format) -> why `export --format` refuses it (the cell trains)
FORMAT_REFUSED = {
    (model_type, "mtp", "speculators"): (
        f"speculators' MTPDraftModel builds MTP layers for qwen3, qwen3_next, "
        f"qwen3_5_text, qwen3_5_moe_text targets only (its mtp_model_classes), not "
        f"{model_type}; export --format stitched: the target with the trained layer, "
        f"which vLLM serves with method mtp"
    )
    for model_type in ("deepseek_v3", "glm4_moe")
}


@pytest.fixture(scope="module")
def zoo(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {model_type: build_target(model_type, root / model_type, tiny_target_dir) for model_type in MODEL_TYPES}


@pytest.fixture(scope="module")
def work(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("matrix")
    (path / "run.yaml").write_text(
        "".join(
            f"{key}: {value}\n"
            for key, value in {
                **BASE,
                "data_files": f"{data_dir}/*.jsonl",
                "data_cache_dir": str(path / "cache"),
            }.items()
        )
    )
    return path


# DSpark's first Adam update at 1e-2 / 3 overshoots (its loss on that batch rises, 1.685 -> 1.721 on
# llama; at 1e-4: 1.685 -> 1.679): the matrix's check that a cell learned needs a smaller step
OWN_RATE = {"dspark": {"learning_rate": 1e-3}}


def overrides(zoo, work, model_type, family, name, *extra):
    return [
        f"target={zoo[model_type]}",
        f"draft.type={family}",
        f"output_dir={work / name}",
        *(f"{key}={value}" for key, value in {**SMALL.get(family, {}), **OWN_RATE.get(family, {})}.items()),
        *extra,
    ]


def test_every_cell_is_decided():
    assert set(REFUSED) <= set(CELLS) and len(CELLS) == len(MODEL_TYPES) * len(FAMILIES) == 77


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plain_greedy_decoding_is_the_targets_own_generate(zoo, model_type):
    """The baseline eval's matches_target compares with: transformers' generate (its own caches and
    masks: sliding-window caches, sinks, MLA's latent cache) on 60 tokens, past every window; and a
    tree of the target drafting for itself, whose passes carry the windows in their masks."""
    from transformers import AutoModelForCausalLM

    from specdraft.decode.drafters import ModelDrafter
    from specdraft.decode.speculative import generate_plain, speculative_generate

    target = AutoModelForCausalLM.from_pretrained(zoo[model_type]).eval()
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt += prompt[:20]
    with torch.no_grad():
        theirs = target.generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    assert len(set(theirs)) > 8  # not a degenerate target: a window dropped would change the tokens
    assert generate_plain(target, prompt, max_new_tokens=24).tokens == theirs
    tree = speculative_generate(target, ModelDrafter(target), prompt, max_new_tokens=24, tree=[2, 2, 2])
    assert tree.tokens == theirs


@pytest.mark.parametrize("model_type,family", [cell for cell in CELLS if cell in REFUSED])
def test_a_refused_cell_is_one_line_naming_the_reason(zoo, work, model_type, family, capsys):
    capsys.readouterr()
    args = overrides(zoo, work, model_type, family, f"{model_type}_{family}_refused")
    assert main(["train", str(work / "run.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip()
    reason = REFUSED[model_type, family].format(target=zoo[model_type])
    assert err == f"specdraft: error: {work / 'run.yaml'}: key 'draft.type': {reason}", err
    assert not (work / f"{model_type}_{family}_refused").exists()


@pytest.mark.parametrize("model_type,family", [cell for cell in CELLS if cell not in REFUSED])
def test_a_cell_trains_resumes_exports_and_evaluates_losslessly(
    zoo, work, tiny_data, model_type, family, capsys, monkeypatch
):
    name = f"{model_type}_{family}"
    run = work / name
    spy = TrainingSpy(monkeypatch)
    cfg = load_config(str(work / "run.yaml"), overrides(zoo, work, model_type, family, name))
    losses = train(cfg, log=lambda *a: None).losses
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses
    trained = spy.snapshots
    assert_every_update_moved_everything(trained)
    # the draft learned its own training text: its first update lowered its loss on the batch it
    # took it on (top-1 hits on a random target stay at 0 in most cells after 3 updates, and the
    # losses of 3 different batches rise and fall: neither tells a trained draft from an untrained one)
    assert spy.loss(trained[1]) < spy.loss(trained[0])

    # resumed from step 1 in another directory: updates 2 and 3 again, bit for bit: the losses,
    # the weights and Adam's moments after each update
    resumed = train(
        load_config(
            str(work / "run.yaml"),
            overrides(zoo, work, model_type, family, f"{name}_resumed", f"resume={run}/ckpt/step_1"),
        ),
        log=lambda *a: None,
    ).losses
    assert resumed == losses[1:]
    assert_same_states(spy.snapshots[1:], trained[2:])

    draft_cls, exported = FAMILIES[family], {}
    for fmt in (*EXPORT_FORMATS, *draft_cls.serving_formats):
        out = work / f"{name}_export_{fmt}"
        capsys.readouterr()
        code = main(["export", str(run), "--format", fmt, "--out", str(out)])
        if (model_type, family, fmt) in FORMAT_REFUSED:
            err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading progress
            assert code == 2 and err == f"specdraft: error: {FORMAT_REFUSED[model_type, family, fmt]}", err
            continue
        assert code == 0, capsys.readouterr().err
        written = out / fmt if fmt in draft_cls.serving_formats else out
        assert_exported_weights_are_the_trained_ones(written, fmt, trained[-1], cfg, spy.engine)
        if fmt in draft_cls.serving_formats:
            exported[fmt] = json.loads((written / "config.json").read_text())
    assert_servers_conventions(exported, json.loads((zoo[model_type] / "config.json").read_text()), zoo[model_type])

    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                str(run),
                "--prompts",
                str(tiny_data.prompts_file),
                "--max-prompts",
                "2",
                "--max-new-tokens",
                "16",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    # lossless by construction (greedy verification): beside the accuracy check above, it pins the
    # verifier on this target, not the draft
    assert report["matches_target"] is True and report["draft"].endswith(f"step_{STEPS}"), report


def assert_exported_weights_are_the_trained_ones(written: Path, fmt: str, trained: dict, cfg, engine) -> None:
    """Read the export back into our names (draft.init_from's readers: each format's writer run
    backwards; a stitched target: its MTP layer, as the mtp family reads a target's own) and
    compare with the weights the engine trained, exactly (fp32 exports) or to the dtype the
    format stores."""
    from omegaconf import OmegaConf

    from specdraft.drafts.mtp.export import read_target_mtp
    from specdraft.export.init_from import read_init_from
    from specdraft.target.model import load_target_config

    if fmt == "stitched":
        state = read_target_mtp(str(written), engine.module.draft_model.state_dict())
    else:
        reading = OmegaConf.merge(cfg, {"draft": {"init_from": str(written)}})
        state = read_init_from(reading, load_target_config(cfg.target)).state
    for name, value in trained.items():
        assert name in state, f"{fmt}: {name} not in the export"
        got = state[name].float().reshape(-1)
        assert torch.equal(got, value["fp32"].to(state[name].dtype).float()), f"{fmt}: {name} is not the trained tensor"


def assert_servers_conventions(exported, target, target_dir):
    """What each server reads of an export, on this target (docs/serving.md, "Conventions"):
    - speculators' verifier block: the target's path and its config.json's architectures
      (src/speculators/config.py, VerifierConfig.from_pretrained, 0.9.0: architectures as found in
      the verifier's config.json; speculators reloads the verifier from name_or_path);
    - EAGLE-3 / P-EAGLE / DFlash / DSpark layer ids: vLLM's (input of layer i), each in 1..L-1,
      the layers every server captures (vLLM appends a layer's input before running it); SGLang's
      eagle_config ids are ours minus one (set_eagle3_layers_to_capture captures val + 1);
    - MTP stitched: the target's config with num_nextn_predict_layers (vLLM's n_predict:
      SpeculativeConfig.hf_config_override) and its architectures (glm4_moe -> glm4_moe_mtp is keyed
      on architectures[0] == "Glm4MoeForCausalLM")."""
    layers = target["num_hidden_layers"]
    for fmt, config in exported.items():
        if fmt == "speculators":
            verifier = config["speculators_config"]["verifier"]
            assert verifier["architectures"] == target["architectures"], verifier
            assert Path(verifier["name_or_path"]).resolve() == Path(target_dir).resolve(), verifier
            ids = config.get("eagle_aux_hidden_state_layer_ids", config.get("aux_hidden_state_layer_ids"))
            if config["speculators_model_type"] != "mtp":
                assert ids == sorted(ids) and all(1 <= i < layers for i in ids), ids
        elif fmt == "sglang":
            ours = exported["speculators"]["eagle_aux_hidden_state_layer_ids"]
            assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ours]
        elif fmt == "stitched":
            assert config["num_nextn_predict_layers"] == 1 and config["architectures"] == target["architectures"]
            assert config["num_hidden_layers"] == layers
