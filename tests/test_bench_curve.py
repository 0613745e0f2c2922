"""bench/curve.py end to end on the tiny demo, --quick: one run of two drafts exports at every count,
each export and prompt lookup is measured on the same prompts, the report names the first count at
which a family passes prompt lookup, and a rerun of the same --out trains and measures nothing. A run
stopped between two counts resumes from its committed slot: the same exports, bit for bit."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from helpers import load_bench

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"^(\w+=\S+)(\s+\w+=\S+)*\s*$")  # bench/summary.py's


def test_the_first_count_above_prompt_lookup_and_counts_in_whole_steps():
    bench = load_bench("curve")
    lookup = {"tau": 2.0}
    taus = {1: {"tau": 1.5}, 2: {"tau": 2.0}, 3: {"tau": 2.01}, 4: {"tau": 1.9}}
    assert bench.passes_lookup(taus, lookup, [1, 2, 3, 4]) == 3  # above, not equal
    assert bench.passes_lookup({1: {"tau": 1.0}}, lookup, [1]) is None
    assert bench.step_counts([64_000, 128_000, 1_000_000], 256) == [250, 500, 4000]
    assert bench.step_counts([1000, 2500], 256) == [4, 8]  # multiples of the first: one run saves at each
    with pytest.raises(SpecdraftError, match="give counts further apart"):
        bench.step_counts([1000, 1500], 256)  # both round to 4 steps


def test_curve_quick_measures_every_count_reuses_every_part_and_resumes_exactly(
    tiny_target_dir, tiny_data, tmp_path, capsys, monkeypatch
):
    bench = load_bench("curve")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    argv = ["--quick", "--target", str(tiny_target_dir), "--prompts", str(tiny_data.prompts_file)]
    argv += ["--data", data_glob, "--out", str(tmp_path)]
    report = bench.main(argv)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert LAST_LINE.match(last), last
    counts = report["counts"]
    assert len(counts) == 2 and counts[1] == 2 * counts[0]
    for family in ("glide", "dflash"):
        taus = report["families"][family]["taus"]
        assert list(map(int, taus)) == counts
        first = report["families"][family]["passes_lookup_at"]
        assert first == next((c for c in counts if taus[c] > report["lookup"]), None)
    # a rerun of the same --out: nothing trained, nothing measured, the same report
    train_curve = bench.train_curve
    monkeypatch.setattr(bench, "train_curve", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    monkeypatch.setattr(bench, "Judge", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert bench.main(argv) == report
    # stopped after the first count: the run resumes from that slot and writes the same last exports
    run_dir = next(p for p in (tmp_path / "tiny" / "runs").iterdir() if p.is_dir())
    steps = sorted(int(p.name.split("_")[1]) for p in run_dir.glob("step_*"))
    last = {f: load_file(str(run_dir / f"step_{steps[-1]}" / f / "model.safetensors")) for f in ("glide", "dflash")}
    shutil.rmtree(run_dir / f"step_{steps[-1]}")
    shutil.rmtree(run_dir / "ckpt" / f"step_{steps[-1]}")
    monkeypatch.setattr(bench, "train_curve", train_curve)
    assert bench.main(argv) == report  # every tau part kept: measured once
    for family, tensors in last.items():
        again = load_file(str(run_dir / f"step_{steps[-1]}" / family / "model.safetensors"))
        assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors), family
