"""bench/versus.py's parts against speculators 0.9.0 itself (its venv): the features of our rows in
its offline layout train in its own trainer on a CPU (bench/speculators_train.py), its checkpoint
reads back as our export, and the "matched" settings resolve to the same recipe on both sides.
Skipped where SPECDRAFT_SPECULATORS_PYTHON is unset (the Makefile sets it for `make test`)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import load_bench
from speculators_env import PYTHON_ENV_VAR, require_speculators_python, run_in_speculators

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [0, 1, 2]  # the tiny target has 2 layers: EAGLE-3's three distinct ids are 0, 1 and L = 2
VOCAB = 64  # a draft vocab smaller than the target's 512: the d2t / t2d files are read

pytestmark = pytest.mark.skipif(not os.environ.get(PYTHON_ENV_VAR), reason=f"{PYTHON_ENV_VAR} is not set")


@pytest.fixture(scope="module")
def written(tiny_target_dir, data_dir, tmp_path_factory):
    """Our rows of the chat data, in speculators' layout: (features dir, versus.json, overrides)."""
    features = load_bench("versus_features")
    work = tmp_path_factory.mktemp("versus")
    overrides = [
        f"target={tiny_target_dir}",
        f"data_files={data_dir}/*.jsonl",
        f"data_cache_dir={work / 'cache'}",
        "max_seq_length=128",
    ]
    cfg = features.run_config(None, overrides)
    summary = features.write_features(
        work / "features", cfg, LAYERS, VOCAB, python=require_speculators_python(), log=lambda *a: None
    )
    return work, summary, overrides


READ_BACK = r"""
import json, sys, numpy as np, torch
from datasets import load_from_disk
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from speculators.train.data import ArrowDataset
path, n = sys.argv[1], int(sys.argv[2])
freq = torch.load(f"{path}/token_freq.pt", weights_only=True)
d2t, t2d = build_vocab_mappings_from_distribution(freq, n, 512)
data = ArrowDataset(max_len=4096, datapath=path, on_missing="raise", train_ratio=1.0, hidden_states_dtype=torch.float32)
row = data[0]
print(json.dumps({
    "same_maps": bool(torch.equal(d2t, torch.from_numpy(np.load(f"{path}/d2t-{n}.npy")))
                      and torch.equal(t2d, torch.from_numpy(np.load(f"{path}/t2d-{n}.npy")))),
    "rows": len(data), "keys": sorted(row), "fused": list(row["hidden_states"].shape),
    "last": list(row["verifier_last_hidden_states"].shape), "mask": row["loss_mask"].tolist(),
}))
"""


def test_our_rows_and_vocab_read_back_in_speculators_as_written(written, tiny_target_dir):
    from safetensors.torch import load_file

    work, summary, overrides = written
    path = work / "features"
    out = run_in_speculators(READ_BACK, path, VOCAB)
    assert out["same_maps"]  # its own build from token_freq.pt picks our draft vocabulary
    assert out["rows"] == summary["rows"] + summary["val_rows"]
    first = load_file(str(path / "hidden_states" / "hs_0.safetensors"))
    T, H = len(first["token_ids"]), 64
    assert summary["slots"] == [*LAYERS, 2] and list(first["hidden_states"].shape) == [T, 4, H]
    assert out["fused"] == [T, 3 * H] and out["last"] == [T, H]
    # the rows and loss masks are our pipeline's: the first conversation of the packed data
    features = load_bench("versus_features")
    from specdraft.target.model import load_target_tokenizer
    from specdraft.train.data import prepare_data

    cfg = features.run_config(None, overrides)
    data = prepare_data(cfg, load_target_tokenizer(cfg.target), 0, lambda *a: None)
    place = data.placements(0)[0]
    ids, mask = data.conversation(place.row)
    assert first["token_ids"].tolist() == list(ids[: place.length])
    assert out["mask"] == [int(m) for m in mask[: place.length]]
    # a training row's last slot is the pre-norm last state: the final norm of it is the target's
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    with torch.no_grad():
        final = target.model(first["token_ids"][None]).last_hidden_state[0]
        assert torch.allclose(target.model.norm(first["hidden_states"][:, -1]), final, atol=1e-4)


def test_a_feature_cache_converts_to_the_same_files_as_the_live_pass(written):
    """feature_cache set: our capture's values (fp32) are the files, bit for bit those of the pass."""
    from safetensors.torch import load_file

    from specdraft.commands.capture import capture

    work, summary, overrides = written
    features = load_bench("versus_features")
    cache = [f"feature_cache={work / 'fc'}", "feature_cache_dtype=fp32", "draft.type=eagle3"]
    capture(features.run_config(None, [*overrides, *cache, f"output_dir={work / 'cap'}"]), log=lambda *a: None)
    cfg = features.run_config(None, [*overrides, *cache])
    again = features.write_features(
        work / "converted", cfg, LAYERS, VOCAB, python=require_speculators_python(), log=lambda *a: None
    )
    assert again["source"] == str(work / "fc") and again["rows"] == summary["rows"]
    for i in range(again["rows"] + again["val_rows"]):
        live = load_file(str(work / "features" / "hidden_states" / f"hs_{i}.safetensors"))
        cached = load_file(str(work / "converted" / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(live["token_ids"], cached["token_ids"])
        assert torch.equal(live["hidden_states"], cached["hidden_states"])
    for name in ("d2t-64.npy", "t2d-64.npy", "token_freq.pt"):
        assert (work / "features" / name).read_bytes() == (work / "converted" / name).read_bytes()


def test_speculators_trains_on_them_and_its_draft_reads_back_as_our_export(written, tiny_target_dir, tmp_path):
    from safetensors.torch import load_file

    from specdraft.export.files import load_exported_draft

    work, summary, overrides = written
    settings = load_bench("versus_settings")
    run = settings.RunShape(str(tiny_target_dir), LAYERS, 2, 128, VOCAB, summary["train_data_ratio"])
    save = tmp_path / "spec"
    # a process of its own: this one's init_distributed left LOCAL_RANK in the environment
    load_bench("speculators_train").run(
        settings.speculators_argv("matched", run, work / "features", save),
        tmp_path / "train.log",
        require_speculators_python(),
    )
    saved = load_file(str(save / "0" / "model.safetensors"))
    assert json.loads((save / "0" / "training_state.json").read_text())["global_step"] == 2
    export = load_bench("versus_draft").import_speculators(
        save / "0", tmp_path / "export", None, overrides, log=lambda *a: None
    )
    draft, config = load_exported_draft(export)
    assert draft.family == "eagle3" and config["dims"]["target_layers"] == LAYERS
    ours = draft.state_dict()
    for name, value in saved.items():
        if name != "embed_tokens.weight":  # the target's, read from the target by our draft
            assert torch.equal(ours[name], value.to(ours[name].dtype)), name
    assert torch.equal(ours["d2t"], torch.from_numpy(np.load(work / "features" / f"d2t-{VOCAB}.npy")))


MATCHED = r"""
import json, sys
from speculators.train.config import TrainConfig
print(json.dumps(TrainConfig.resolve(sys.argv[1:]).flatten()))
"""


def test_the_matched_recipe_is_the_same_on_both_sides(tmp_path):
    from specdraft.config.load import load_config

    settings = load_bench("versus_settings")
    run = settings.RunShape("/absent/target", LAYERS, 5, 256, VOCAB, 0.9)
    theirs = run_in_speculators(MATCHED, *settings.speculators_argv("matched", run, tmp_path, tmp_path / "s"))
    ours = load_config(None, [*settings.specdraft_overrides("matched", run), "data_files=x.jsonl"], inputs_built=False)
    d = ours.draft
    pairs = [
        (theirs["optimizer"], "adamw"),
        (theirs["lr"], ours.learning_rate),
        (theirs["weight_decay"], ours.weight_decay),
        ((theirs["scheduler_type"], theirs["scheduler_warmup_steps"]), ("cosine", ours.warmup_steps)),
        (theirs["ttt_steps"], d.ttt_steps),
        (theirs["ttt_step_loss_decay"], d.ttt_decay),
        ((theirs["loss_fn"], d.loss, d.teacher_rows), ("kl_div", "kl", "all")),
        (theirs["norm_before_residual"], d.norm_before_residual),
        (theirs["norm_before_fc"], d.norm_before_fc),
        (theirs["norm_output"], d.norm_output),
        (theirs["fc_norm"], d.fc_norm),
        (theirs["full_attention_indices"], [0]),  # one draft layer, full causal attention as ours
        ((theirs["hidden_states_dtype"], ours.precision), ("float32", "fp32")),
        ((theirs["total_seq_len"], theirs["max_steps"]), (ours.max_seq_length, ours.max_steps)),
        (theirs["draft_vocab_size"], d.draft_vocab_size),
        (theirs["target_layer_ids"], list(d.target_layers)),
        (ours.per_device_batch_size * ours.gradient_accumulation_steps, 1),
        ((ours.adam_beta1, ours.adam_beta2, ours.adam_eps), (0.9, 0.999, 1e-8)),  # torch's AdamW defaults
    ]
    for got, want in pairs:
        assert got == want


def test_a_speculators_run_stopped_early_is_the_first_steps_of_the_longer_run(written, tiny_target_dir, tmp_path):
    """bench/versus.py's speculators export at a smaller token count: a run of n steps given the
    longer run's --scheduler-total-steps is that run's first n steps, bit for bit (compared where
    both save, the end of the first epoch), and epoch_batches counts the --epochs that hold exactly
    the steps (the longer run ends in its second epoch at its last step)."""
    from safetensors.torch import load_file

    work, summary, overrides = written
    settings, train = load_bench("versus_settings"), load_bench("speculators_train")
    python = require_speculators_python()
    ratio, seq_len = summary["train_data_ratio"], 512  # 4 windows' rows a step: fewer steps an epoch
    first = train.epoch_batches(work / "features", seq_len, ratio, 1, python)[0]  # the steps of epoch 0
    longer = first + 2
    runs = []
    for steps, epochs in ((first, 1), (longer, 2)):
        run = settings.RunShape(
            str(tiny_target_dir), LAYERS, steps, seq_len, VOCAB, ratio, epochs=epochs, schedule_steps=longer
        )
        save = tmp_path / f"s{steps}"
        runs.append((settings.speculators_argv("defaults", run, work / "features", save), tmp_path / f"s{steps}.log"))
    train.run_many(runs, tmp_path / "runs.log", python)
    short = load_file(str(tmp_path / f"s{first}" / "0" / "model.safetensors"))
    long = load_file(str(tmp_path / f"s{longer}" / "0" / "model.safetensors"))
    assert short.keys() == long.keys() and all(torch.equal(short[k], long[k]) for k in short)
    state = json.loads((tmp_path / f"s{longer}" / "1" / "training_state.json").read_text())
    assert state["global_step"] == longer
