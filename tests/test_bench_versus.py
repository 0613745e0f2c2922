"""bench/versus.py end to end on the tiny demo, --quick (a few steps, EAGLE-3 alone to stay near a
minute): both trainers train in both modes to every token count, each export and prompt lookup is
measured the three ways, the report has the structure docs/benchmarks/acceptance.md quotes, its
last line is key=value pairs, and a second run of the same --out reuses every part, training and
measuring nothing. Skipped where SPECDRAFT_SPECULATORS_PYTHON is unset (the Makefile sets it for
`make test`). No figure is asserted."""

import json
import os
import re
from pathlib import Path

import pytest

from speculators_env import PYTHON_ENV_VAR
from helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"^(\w+=\S+)(\s+\w+=\S+)*\s*$")  # bench/summary.py's

pytestmark = pytest.mark.skipif(not os.environ.get(PYTHON_ENV_VAR), reason=f"{PYTHON_ENV_VAR} is not set")


def test_versus_quick_measures_both_trainers_at_every_count_and_reuses_every_part(
    tiny_target_dir, tiny_data, tmp_path, capsys
):
    bench = load_bench("versus")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    argv = ["--quick", "--families", "eagle3", "--target", str(tiny_target_dir), "--out", str(tmp_path)]
    argv += ["--prompts", str(tiny_data.prompts_file), "--data", data_glob]
    results = bench.main(argv)
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert LAST_LINE.match(last), last
    keys = dict(item.split("=", 1) for item in last.split())
    shapes = ["chain", "tree", "T0.7"]
    assert sorted(results["lookup"]) == sorted(shapes)
    for mode in ("defaults", "matched"):
        for trainer in ("specdraft", "speculators"):
            assert float(keys[f"tau_eagle3_{mode}_{trainer}"]) >= 1.0
        for shape in ("chain", "tree", "t0_7"):
            assert float(keys[f"ratio_eagle3_{mode}_{shape}"]) > 0

    # the counts: multiples of every trainer's tokens a step (specdraft's defaults read 2 x 256)
    counts = [512, 1024, 1536]
    assert results["counts"] == counts
    runs = results["runs"]
    assert runs["eagle3/defaults"]["specdraft"]["steps"] == [1, 2, 3]
    assert runs["eagle3/matched"]["specdraft"]["steps"] == [2, 4, 6]
    for mode in ("defaults", "matched"):
        theirs = runs[f"eagle3/{mode}"]["speculators"]
        # a run per count, each the first steps of the largest one's schedule, stopped in its last epoch
        assert [theirs[c]["steps"] for c in counts] == [2, 4, 6]
        assert all(theirs[c]["schedule_steps"] == 6 for c in counts)
        for c in counts:
            state = Path(theirs[c]["save_path"]) / str(theirs[c]["epochs"] - 1) / "training_state.json"
            assert json.loads(state.read_text())["global_step"] == theirs[c]["steps"]

    # every export, both trainers, every count and shape: greedy output is the target's own, and
    # the per-prompt counts pool to tau, and each ratio is specdraft's tau over speculators'
    for mode in ("defaults", "matched"):
        for c in counts:
            for shape in shapes:
                pair = [results["tau"][f"eagle3/{mode}/{t}/{c}"][shape] for t in ("specdraft", "speculators")]
                for r in pair:
                    produced, passes = map(sum, zip(*r["per_prompt"]))
                    assert len(r["per_prompt"]) == 2 and produced / passes == pytest.approx(r["tau"])
                    assert r["lossless"] is (None if shape.startswith("T") else True)
                ratio = results["ratios"][f"eagle3/{mode}/{c}/{shape}"]
                assert ratio["ratio"] == pytest.approx(pair[0]["tau"] / pair[1]["tau"])
                assert ratio["low"] <= ratio["ratio"] <= ratio["high"]

    report = (tmp_path / "tiny" / "versus.md").read_text()
    for text in ("τ, greedy, chain γ=3", "τ, greedy, tree 2,2", "τ, sampled at T=0.7", "τ specdraft / speculators"):
        assert text in report
    assert "EAGLE-3: the settings that differ" in report and "| TTT steps | 3 " in report
    assert "P-EAGLE: not compared" in report and "| prompt lookup |" in report
    assert json.loads((tmp_path / "tiny" / "versus.json").read_text())["headline"] == last.split()

    parts = sorted(p.stem for p in (tmp_path / "tiny" / "parts").glob("*.json"))
    assert not results["reused"] and len(parts) == 2 + 2 * (1 + 3) + 1 + 12  # features, batches; runs; taus
    again = bench.main(argv)  # every part reused: nothing trained, imported or measured twice
    assert sorted(again["reused"]) == parts
    assert again["tau"] == results["tau"] and again["runs"] == results["runs"]
