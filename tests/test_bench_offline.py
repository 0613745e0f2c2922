"""bench/offline.py end to end on the tiny demo, --quick (a few steps): every part runs, its report has
the structure docs/benchmarks/offline.md quotes, its last line is key=value pairs, and a second run
of the same --out reuses the finished parts. No time is asserted."""

import json
import re
from pathlib import Path
from helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"^(\w+=\S+)(\s+\w+=\S+)*\s*$")  # bench/summary.py's


def test_offline_bench_quick_reports_every_part_and_reuses_them(tiny_target_dir, tiny_data, tmp_path, capsys):
    bench = load_bench("offline")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    argv = ["--quick", "--preset", "tiny", "--target", str(tiny_target_dir), "--prompts", str(tiny_data.prompts_file)]
    argv += ["--data", data_glob, "--families", "glide,eagle3,mtp", "--out", str(tmp_path)]
    results = bench.main(argv)
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert LAST_LINE.match(last), last
    keys = dict(item.split("=", 1) for item in last.split())
    for family in ("glide", "eagle3"):
        for key in ("capture_tps", "bytes_bf16", "bytes_vs_speculators", "cached_over_draft", "online_over_cached"):
            assert float(keys[f"{key}_{family}"]) > 0
    for key in (
        "sha256_mbps",
        "sha256_cold_mbps",
        "tau_offline_over_online",
        "tau_fp8_token_over_bf16",
        "tau_fp8_token_layer_over_bf16",
    ):
        assert float(keys[key]) > 0
    assert float(keys["tau_peak_epochs"]) in (1.0, 2.0)
    # MTP drafts only for a target with an MTP layer: named, not measured
    assert set(results["captures"]) == {"glide", "eagle3"} and "--preset mtp" in results["skipped"]["mtp"]
    # bytes per token: the shard files against the formula, fp32 > bf16 > fp8 (token_layer: a scale a kind)
    for family, by_precision in results["captures"].items():
        sizes = {p: c["formula_bytes_per_token"] for p, c in by_precision.items()}
        assert sizes["fp32"] > sizes["bf16"] > sizes["fp8_token_layer"] > sizes["fp8_token"], sizes
        for c in by_precision.values():
            assert c["tokens"] > 0 and c["bytes_per_token"] >= c["formula_bytes_per_token"]
    H = results["hidden_size"]
    assert results["speculators_bytes_per_token"] == 4 * H * 2 + 8
    assert results["captures"]["glide"]["bf16"]["kinds"] == ["last_keys", "last_values"]
    for family in ("glide", "eagle3"):
        timing = results["timing"][family]
        assert timing["cached"]["read"] > 0 and timing["online"]["read"] == 0.0  # live: nothing read
        assert results["verify"][family]["shards"] >= 1 and results["verify"][family]["sha256_mb_per_s"] > 0
    assert set(results["tau"]) == {"online", "fp32", "bf16", "fp8_token", "fp8_token_layer"}
    assert all(r["lossless"] and r["tau"] >= 1.0 for r in results["tau"].values())
    # fp32 features read back are the ones computed: the same training, the same tau
    assert results["tau"]["fp32"]["tau"] == results["tau"]["online"]["tau"]
    assert results["tau_ratios"]["offline_over_online"] == dict(ratio=1.0, low=1.0, high=1.0)
    for r in results["tau"].values():  # the per-prompt counts pool to the reported tau
        produced, passes = map(sum, zip(*r["per_prompt"]))
        assert len(r["per_prompt"]) == 2 and produced / passes == r["tau"]
    for v in results["verify"].values():
        assert v["sha256_cold_mb_per_s"] > 0 and v["open_verified_cold_seconds"] > 0
    assert [r["steps"] for r in results["epochs"].values()] == [
        results["steps_per_epoch"],
        2 * results["steps_per_epoch"],
    ]
    report = (tmp_path / "tiny" / "offline.md").read_text()
    assert "cached / draft fwd/bwd" in report and "τ against epochs" in report
    assert json.loads((tmp_path / "tiny" / "offline.json").read_text())["headline"] == last.split()

    again = bench.main(argv)  # the finished parts are reused, nothing measured twice
    assert "capture-eagle3-fp8_token-b2" in again["reused"] and "epochs-eagle3-" in " ".join(again["reused"])
    assert again["tau"] == results["tau"] and again["timing"] == results["timing"]


def test_tau_ratio_pools_each_side_and_its_interval_comes_from_the_same_resampled_prompts():
    parts = load_bench("offline_parts")
    over = {"per_prompt": [[30, 10], [20, 10], [40, 10]]}  # (tokens produced, target passes) a prompt
    under = {"per_prompt": [[15, 10], [10, 10], [20, 10]]}
    r = parts.tau_ratio(over, under)
    assert r["ratio"] == (90 / 30) / (45 / 30)  # pooled tau over pooled tau: 3.0 / 1.5
    # every prompt doubles: any resample keeps the ratio, so a paired interval is a point
    assert r["low"] == r["high"] == 2.0
    noisy = parts.tau_ratio({"per_prompt": [[30, 10], [10, 10], [40, 10]]}, under)
    assert noisy["low"] < noisy["ratio"] < noisy["high"]


def test_summary_runs_the_offline_bench():
    assert "offline" in load_bench("summary").SCRIPTS
