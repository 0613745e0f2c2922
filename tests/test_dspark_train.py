"""A DSpark draft through the real trainer on one CPU rank: the loss falls, the objective's terms
and the confidence head's calibration are logged, both exports are written, `specdraft eval`
decodes losslessly with and without the confidence stop; a DFlash slot does not resume as DSpark."""

import json

from helpers import run_overrides, train_run
from specdraft.cli import main
from specdraft.drafts.dspark.model import DSparkDraft
from specdraft.commands.evaluate import evaluate
from specdraft.export.files import load_exported_draft

DSPARK = {
    "draft.type": "dspark",
    "draft.num_layers": 1,
    "draft.block_size": 4,
    "draft.max_anchors": 16,
    "draft.markov_rank": 8,
}


def test_dspark_trains_logs_its_terms_exports_and_evaluates(tiny_target_dir, tiny_data, data_dir, tmp_path, capsys):
    result = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=24, save_steps=24, **DSPARK)
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first, result.losses
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r][-1]
    assert {
        "objective/tv",
        "objective/ce",
        "confidence/bce",
        "confidence/brier",
        "confidence/accuracy",
        "block_3/accuracy",
    } <= set(logged)
    assert 0.0 <= logged["confidence/brier"] <= 1.0 and 0.0 <= logged["confidence/accuracy"] <= 1.0
    served = json.loads((result.export_dir / "speculators" / "config.json").read_text())
    assert served["speculators_model_type"] == "dspark" and served["markov_rank"] == 8
    draft, config = load_exported_draft(result.export_dir)
    assert isinstance(draft, DSparkDraft) and config["architecture"] == "DSparkDraft"
    for threshold in (None, 0.0, 0.9):
        for shape in (dict(gamma=3), dict(tree=[2, 2, 2])):
            report = evaluate(
                result.export_dir,
                tiny_data.prompts_file,
                max_prompts=3,
                max_new_tokens=16,
                confidence_threshold=threshold,
                **shape,
            )
            assert report["matches_target"] is True and report["tau"] >= 1.0
            assert report["proposed_per_round"] == report["drafted_tokens"] / report["target_forwards"]
    # bad input at the CLI: one line, exit 2
    capsys.readouterr()
    code = main(
        ["eval", str(result.export_dir), "--prompts", str(tiny_data.prompts_file), "--confidence-threshold", "1.5"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--confidence-threshold: must be in [0, 1], got 1.5" in err and "\n" not in err

    # a DFlash run's slot resumed as DSpark: refused, one line
    dflash = {**DSPARK, "draft.type": "dflash"}
    del dflash["draft.markov_rank"]
    train_run(tiny_target_dir, data_dir, tmp_path, "dflash", max_steps=2, save_steps=2, **dflash)
    capsys.readouterr()
    config = tmp_path / "resume.yaml"
    config.write_text(
        "\n".join(
            o.replace("=", ": ", 1)
            for o in run_overrides(
                tiny_target_dir,
                data_dir,
                tmp_path / "dflash",
                tmp_path / "cache",
                max_steps=4,
                save_steps=2,
                resume="auto",
            )
        )
        + "\n"
    )
    assert main(["train", str(config), *(f"{k}={v}" for k, v in DSPARK.items())]) == 2
    err = capsys.readouterr().err.strip()
    assert "a dflash draft's checkpoint; this run trains draft.type 'dspark'" in err and "\n" not in err
