"""EAGLE-3 trained online in the DeepSpeed loop on the tiny demo target: per-TTT-step metrics, the
vocab maps counted once and carried by checkpoints and exports, resume without recounting,
in-training tau, `specdraft export --format`, and the one-line errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_overrides
from specdraft.cli import main
from specdraft.config import load_config
from specdraft.drafts.eagle3 import vocab as vocab_module
from specdraft.export.files import load_exported_draft
from specdraft.train.loop import train


def overrides(target, data_dir, tmp_path, name, **extra):
    values = {"draft.type": "eagle3", "draft.ttt_steps": 3, "draft.draft_vocab_size": 200, **extra}
    return run_overrides(target, data_dir, tmp_path / name, tmp_path / "cache", **values)


def test_eagle3_trains_logs_ttt_steps_saves_maps_and_resumes_without_recounting(
    served_target_dir, tiny_data, data_dir, tmp_path, monkeypatch, capsys
):
    tiny_target_dir = served_target_dir
    args = overrides(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "run",
        max_steps=20,
        save_steps=10,
        eval_steps=10,
        eval_prompts=tiny_data.prompts_file,
    )
    result = train(load_config(None, args), log=lambda *a: None)
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.5, result.losses
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "ttt_0/loss" in r]
    assert len(steps) == 20
    for k in range(3):
        assert 0.0 <= steps[-1][f"ttt_{k}/accuracy"] <= 1.0 and steps[-1][f"ttt_{k}/loss"] > 0
    assert steps[-1]["ttt_0/accuracy"] > steps[0]["ttt_0/accuracy"]
    assert [r["step"] for r in rows if "eval/tau" in r] == [10, 20]

    # the maps: the top-200 loss-masked target tokens of the packed data, in every save
    export = tmp_path / "run" / "step_20"
    draft, _ = load_exported_draft(export)
    from specdraft.data.packing import open_packed_cache
    from specdraft.data.whole_packing import WholePackedData

    cache = next(p for p in (tmp_path / "cache").iterdir() if (p / "meta.json").is_file())
    windows = WholePackedData(cache, open_packed_cache(cache).meta)  # what the run trained on (packing whole)
    counts = vocab_module.count_target_tokens(windows, draft.dims.vocab_size)
    d2t, t2d = vocab_module.vocab_maps(counts, 200)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    assert sorted(p.name for p in export.iterdir() if p.is_dir()) == ["sglang", "speculators"]
    assert torch.equal(load_file(str(export / "speculators" / "model.safetensors"))["d2t"], d2t)
    assert torch.equal(load_file(str(export / "sglang" / "model.safetensors"))["t2d"], t2d)

    # resume: the maps come from the slot, never from counting again
    monkeypatch.setattr(vocab_module, "count_target_tokens", lambda *a: pytest.fail("recounted on resume"))
    from specdraft.drafts.eagle3 import layer as eagle3_module  # where a new draft counts its maps

    monkeypatch.setattr(eagle3_module, "count_target_tokens", lambda *a: pytest.fail("recounted on resume"))
    more = overrides(tiny_target_dir, data_dir, tmp_path, "run", max_steps=22, save_steps=10)
    resumed = train(load_config(None, more), log=lambda *a: None)
    assert len(resumed.losses) == 2
    again, _ = load_exported_draft(tmp_path / "run" / "step_22")
    assert torch.equal(again.d2t, d2t) and torch.equal(again.t2d, t2d)

    # offline exports from the checkpoint: exact maps (not zero_to_fp32's floats), every format
    assert main(["export", str(tmp_path / "run"), "--format", "speculators", "--out", str(tmp_path / "x")]) == 0
    served = load_file(str(tmp_path / "x" / "speculators" / "model.safetensors"))
    assert served["d2t"].dtype == torch.int64 and torch.equal(served["d2t"], d2t)
    assert served["t2d"].dtype == torch.bool and torch.equal(served["t2d"], t2d)
    assert main(["export", str(tmp_path / "run"), "--format", "native", "--out", str(tmp_path / "n")]) == 0
    native, _ = load_exported_draft(tmp_path / "n")
    assert torch.equal(native.d2t, d2t)


def test_eagle3_bad_input_is_one_line(tiny_target_dir, data_dir, tmp_path, capsys):
    base = overrides(tiny_target_dir, data_dir, tmp_path, "bad", max_steps=1)

    def run(*extra):
        code = main(["train", str(yaml_path), *base, *extra])
        return code, capsys.readouterr().err.strip()

    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("seed: 3\n")
    for extra, expected in [
        ("draft.target_layers=[0,1,9]", "key 'draft.target_layers': layer 9 is outside the target"),
        ("draft.draft_vocab_size=100000", "key 'draft.draft_vocab_size': 100000 is larger than the target vocab"),
        ("export_formats=[sglang,vllm]", "key 'export_formats': 'vllm' is not a serving format of draft.type 'eagle3'"),
    ]:
        code, err = run(extra)
        assert code == 2 and expected in err and "\n" not in err, err
    code, err = run("draft.type=glide", "export_formats=[speculators]")  # EAGLE-3's keys on a GLIDE run
    assert code == 2 and "key 'draft.ttt_steps': not a key of draft.type 'glide' (it belongs to eagle3)" in err
    assert not (tmp_path / "bad").exists()


def test_a_run_on_layers_no_server_captures_exports_native_only(tiny_target_dir, data_dir, tmp_path, capsys):
    """The 2-layer tiny target's default layers [0, 1, 2] include its last output: each save writes
    the native format only, and asking for a serving format is one line naming draft.target_layers."""
    args = overrides(tiny_target_dir, data_dir, tmp_path, "run", max_steps=1, save_steps=1)
    train(load_config(None, args), log=lambda *a: None)
    assert [p.name for p in (tmp_path / "run" / "step_1").iterdir() if p.is_dir()] == []
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", "speculators", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bars
    assert err.startswith("specdraft: error: draft.target_layers: layer 2 is the last layer's output")


def test_exporting_a_glide_run_to_speculators_is_one_line(tiny_target_dir, data_dir, tmp_path, capsys):
    args = run_overrides(tiny_target_dir, data_dir, tmp_path / "glide", tmp_path / "cache", max_steps=1, save_steps=1)
    train(load_config(None, args), log=lambda *a: None)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "glide"), "--format", "speculators"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "specdraft: error: --format speculators: a glide draft exports as native, pth, safetensors, longspec"
    )
    assert not (tmp_path / "glide" / "export_step_1").exists()


def test_eagle3_trains_at_zero3_with_the_losses_of_zero2(tiny_target_dir, data_dir, tmp_path):
    """ZeRO-3 releases the draft's head after forward and the TTT loss reads it again in backward
    (its chunks are recomputed there): ZeRO-3 must re-gather it, which it does only for the
    parameters of a module whose output it can see into (DraftLoss is a NamedTuple for that)."""
    losses = {}
    for stage in (2, 3):
        args = overrides(
            tiny_target_dir,
            data_dir,
            tmp_path,
            f"zero{stage}",
            max_steps=4,
            save_steps=100,
            zero_stage=stage,
            eval_steps=0,
        )
        losses[stage] = train(load_config(None, args), log=lambda *a: None).losses
    assert len(losses[3]) == 4 and losses[3][-1] < losses[3][0]
    assert losses[3] == pytest.approx(losses[2], rel=1e-5)


def test_an_unservable_export_format_named_in_the_config_is_refused_before_training(
    tiny_target_dir, data_dir, tmp_path, capsys
):
    """The 2-layer target's default layers include its last output: naming speculators stops the
    run at start-up in one line (not at the first save), with nothing written."""
    args = overrides(
        tiny_target_dir, data_dir, tmp_path, "unservable", max_steps=2, save_steps=2, export_formats="[speculators]"
    )
    (tmp_path / "run.yaml").write_text("seed: 3\n")
    code = main(["train", str(tmp_path / "run.yaml"), *args])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the target's loading bar
    assert code == 2 and err.startswith("specdraft: error: ")
    assert "key 'export_formats': speculators: draft.target_layers: layer 2 is the last layer's output" in err
    assert not (tmp_path / "unservable").exists()
