"""Offline training text for distillation (specdraft/demo/text_data.py): the stdlib functions as
written, never a held-out prompt, and `specdraft demo --data text` training on it with a teacher
term."""

import json
import shutil

import pytest

from specdraft.config import PACKAGED_CONFIGS
from specdraft.demo.corpus import extract_functions, read_corpus
from specdraft.demo.text_data import TEXT_BYTES, distillation_overrides, ensure_text_data, text_rows


def test_the_text_is_every_function_as_written_but_the_held_out_ones(tiny_assets):
    target_dir, data = tiny_assets
    held_out = {json.loads(line)["prompt"] for line in data.prompts_file.read_text().splitlines()}
    functions = extract_functions(read_corpus(TEXT_BYTES, 0))
    rows = text_rows(0, held_out)
    assert held_out and held_out <= {f.prompt for f in functions}  # the prompts' functions are in the corpus
    assert [(r["conversations"][0]["content"], r["conversations"][1]["content"]) for r in rows] == [
        (f.prompt, f.answer) for f in functions if f.prompt not in held_out
    ]
    assert len(rows) > 1000  # enough text for hundreds of thousands of tokens


def test_the_text_is_built_once_and_rebuilt_when_the_held_out_prompts_change(tiny_assets, tmp_path):
    _, data = tiny_assets
    logged = []
    files = ensure_text_data(tmp_path, "tiny", data.prompts_file, 0, log=logged.append)
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    held_out = {json.loads(line)["prompt"] for line in data.prompts_file.read_text().splitlines()}
    assert rows == text_rows(0, held_out) and len(files) == 4
    before = {f: f.stat().st_mtime_ns for f in files}
    assert ensure_text_data(tmp_path, "tiny", data.prompts_file, 0, log=logged.append) == files
    assert {f: f.stat().st_mtime_ns for f in files} == before and "reusing cached text" in logged[-1]
    other = tmp_path / "other_prompts"
    other.mkdir()
    (other / "prompts.jsonl").write_text(json.dumps({"prompt": rows[0]["conversations"][0]["content"]}) + "\n")
    rebuilt = [
        json.loads(line)
        for f in ensure_text_data(tmp_path, "tiny", other / "prompts.jsonl", 0, log=logged.append)
        for line in f.read_text().splitlines()
    ]
    assert rows[0] not in rebuilt and len(rebuilt) == len(text_rows(0, set())) - 1


@pytest.mark.parametrize(
    "name, expected",
    [
        ("demo", ["draft.loss=kl"]),
        ("demo-dflash", ["draft.loss=kl"]),
        ("demo-eagle3", []),
        ("demo-peagle", []),
        ("demo-dspark", []),
        ("demo-mtp", []),
    ],
)
def test_text_is_learnt_through_a_teacher_term(name, expected):
    """GLIDE and DFlash default to CE (the text itself): kl instead; EAGLE-3's soft CE, P-EAGLE's KL
    and DSpark's configured TV already read the target's distribution; MTP has no draft.loss."""
    assert distillation_overrides(PACKAGED_CONFIGS / f"{name}.yaml") == expected


def test_demo_trains_on_the_text_with_distillation(tiny_assets, tmp_path, monkeypatch, capsys):
    """`demo --data text` needs the target and the held-out prompts alone: no answer is generated (a
    fresh home holding only the target), and the prompts are the dataset's own."""
    from specdraft.cli import main

    home = tmp_path / "home"
    shutil.copytree(tiny_assets[0], home / "tiny" / "target")  # its stamp: reused, not rebuilt
    monkeypatch.setenv("SPECDRAFT_HOME", str(home))
    out = tmp_path / "run"
    assert (
        main(
            [
                "demo",
                "--preset",
                "tiny",
                "--data",
                "text",
                f"output_dir={out}",
                "max_steps=2",
                "save_steps=2",
                "eval_steps=0",
                "max_seq_length=128",
                "per_device_batch_size=2",
                "logging_steps=1",
            ]
        )
        == 0
    )
    config = (out / "config.yaml").read_text()
    assert "loss: kl" in config and f"{home}/tiny/text/shard-00000.jsonl" in config
    assert sorted(p.name for p in (home / "tiny").iterdir()) == ["prompts", "target", "text"]  # no data/
    assert (home / "tiny" / "prompts" / "prompts.jsonl").read_text() == tiny_assets[1].prompts_file.read_text()
    assert f"eval_prompts: {home}/tiny/prompts/prompts.jsonl" in config
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all("objective/kl" in r for r in logged)


def test_demo_text_refuses_an_answer_temperature_in_one_line(capsys):
    from specdraft.cli import main

    assert main(["demo", "--preset", "tiny", "--data", "text", "--answer-temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--answer-temperature" in err and "--data text generates none" in err
