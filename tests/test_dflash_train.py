"""A DFlash draft through the real trainer on one CPU rank: the loss falls, per-block metrics and the
in-training tau are logged (ZeRO-2 and ZeRO-3), the export reloads and `specdraft eval` decodes
with it losslessly.
"""

import json

import pytest

from helpers import run_overrides, train_run
from specdraft.config import load_config
from specdraft.commands.evaluate import evaluate
from specdraft.drafts.dflash.model import DFlashDraft
from specdraft.export.files import load_exported_draft
from specdraft.errors import SpecdraftError

DFLASH = dict(**{"draft.type": "dflash", "draft.num_layers": 1, "draft.block_size": 4, "draft.max_anchors": 16})


def run(target, data_dir, tmp_path, name, **extra):
    return train_run(target, data_dir, tmp_path, name, **{**DFLASH, **extra})


def test_dflash_trains_logs_tau_exports_and_evaluates(tiny_target_dir, tiny_data, data_dir, tmp_path):
    result = run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "long",
        max_steps=30,
        save_steps=30,
        eval_steps=15,
        eval_prompts=tiny_data.prompts_file,
    )
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first - 0.5, result.losses
    rows = [json.loads(line) for line in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert {"block_1/accuracy", "block_3/loss"} <= set(logged[-1]) and "block_4/loss" not in logged[-1]
    assert [r["step"] for r in rows if "eval/tau" in r] == [15, 30]
    assert all(1.0 <= r["eval/tau"] <= 5.0 for r in rows if "eval/tau" in r)  # gamma 4

    served = json.loads((result.export_dir / "speculators" / "config.json").read_text())
    assert served["speculators_model_type"] == "dflash" and served["block_size"] == 4
    assert (result.export_dir / "speculators" / "model.safetensors").is_file()
    draft, config = load_exported_draft(result.export_dir)
    assert isinstance(draft, DFlashDraft) and config["architecture"] == "DFlashDraft"
    assert draft.dims.target_layers == [1] and draft.dims.block_size == 4  # tiny target: 2 layers, layer 2 never served
    for shape in (dict(gamma=3), dict(tree=[2, 2, 2])):
        report = evaluate(result.export_dir, tiny_data.prompts_file, max_prompts=3, max_new_tokens=16, **shape)
        assert report["matches_target"] is True and report["tau"] >= 1.0


def test_dflash_stage3_trains_its_mask_row_and_measures_tau(tiny_target_dir, tiny_data, data_dir, tmp_path):
    result = run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "z3",
        zero_stage=3,
        max_steps=4,
        save_steps=4,
        eval_steps=4,
        eval_prompts=tiny_data.prompts_file,
        **{"draft.train_mask_embedding": True},
    )
    rows = [json.loads(line) for line in (tmp_path / "z3" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/tau" in r] == [4]
    draft, _ = load_exported_draft(result.export_dir)
    assert draft.mask_delta.abs().sum() > 0  # the MASK row trained (ZeRO-3 gathered it)
    assert not (result.export_dir / "speculators").exists()  # speculators cannot carry it


def test_a_bad_dflash_key_stops_before_anything_is_written(tiny_target_dir, data_dir, tmp_path):
    overrides = run_overrides(
        tiny_target_dir, data_dir, tmp_path / "bad", tmp_path / "cache", **{**DFLASH, "draft.target_layers": "[1,9]"}
    )
    with pytest.raises(SpecdraftError, match="draft.target_layers"):
        load_config(None, overrides)
    assert not (tmp_path / "bad").exists()


def test_a_frozen_mask_row_travels_through_resume_elastic_resume_and_offline_export(
    tiny_target_dir, data_dir, tmp_path, monkeypatch
):
    """DeepSpeed leaves frozen parameters out of a slot: the frozen mask_delta comes back from the
    slot exactly (not from a fresh build) when resumed at the same stage, through the universal
    format (ZeRO-2 -> 3), and in `specdraft export` / `consolidate`."""
    import torch
    from safetensors.torch import load_file

    from specdraft.drafts import registry
    from specdraft.cli import main

    mark = {"value": 0.25}

    class MarkedDFlash(DFlashDraft):  # a frozen MASK row that a fresh build does not reproduce
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with torch.no_grad():
                self.mask_delta.fill_(mark["value"])

    monkeypatch.setitem(registry.FAMILIES, "dflash", MarkedDFlash)
    monkeypatch.setitem(registry.ARCHITECTURES, "DFlashDraft", MarkedDFlash)
    native = {"export_formats": "[]"}  # speculators cannot carry a MASK row of the draft's own
    run(tiny_target_dir, data_dir, tmp_path, "marked", max_steps=2, save_steps=2, **native)
    mark["value"] = 0.0
    for name, stage in (("same", 2), ("zero3", 3)):
        run(
            tiny_target_dir,
            data_dir,
            tmp_path,
            name,
            max_steps=3,
            save_steps=3,
            zero_stage=stage,
            **native,
            resume=tmp_path / "marked" / "ckpt" / "step_2",
        )
        delta = load_file(str(tmp_path / name / "step_3" / "model.safetensors"))["mask_delta"]
        assert torch.equal(delta, torch.full_like(delta, 0.25)), name
    assert main(["export", str(tmp_path / "marked"), "--out", str(tmp_path / "x")]) == 0
    assert main(["consolidate", str(tmp_path / "marked")]) == 0
    for path in (
        tmp_path / "x" / "model.safetensors",
        tmp_path / "marked" / "consolidated" / "step_2" / "draft_fp32.safetensors",
    ):
        delta = load_file(str(path))["mask_delta"]
        assert torch.equal(delta, torch.full_like(delta, 0.25)), path
