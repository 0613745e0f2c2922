"""bench/acceptance.py end to end on the tiny demo: it trains one GLIDE per --objectives entry with
that entry's keys, measures every drafter greedy and sampled, and writes its results. A small run
keeps the script from rotting between the long runs whose figures docs/benchmarks/ quotes."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import launch_env, load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_split_objective_gives_the_config_keys_and_refuses_in_one_line(capsys):
    runs, bench = load_bench("acceptance_runs"), load_bench("acceptance")
    assert runs.split_objective("0.9*tv + 0.1*ce@0.7:all") == (
        ["draft.loss=0.9*tv + 0.1*ce", "draft.distill_temperature=0.7", "draft.distill_tokens=all"],
        "0.1*ce + 0.9*tv (T=0.7, all tokens)",
    )
    assert runs.split_objective("ce")[1] == "ce"
    for bad, message in (
        ("kl@warm", "the temperature after '@' must be a number"),
        ("ce:all", "'all' needs a teacher term"),
        ("kl:prompts", "must be one of answers, all"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(["--objectives", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err


def test_acceptance_bench_trains_each_objective_and_reports_every_drafter(tiny_target_dir, tiny_data, tmp_path):
    bench = load_bench("acceptance")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    results = bench.main(
        [
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(tiny_data.prompts_file),
            "--data",
            data_glob,
            "--families",
            "glide",
            "--objectives",
            "ce",
            "tv@0.7:all",
            "--train-steps",
            "3",
            "--temperatures",
            "0,0.7",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--gamma",
            "3",
            "--tree",
            "",
            "--out",
            str(tmp_path),
        ]
    )
    labels = ["GLIDE ce", "GLIDE tv (T=0.7, all tokens)", "prompt lookup"]
    rows = {(row["label"], row["temperature"]): row for row in results["rows"]}
    assert set(rows) == {(label, t) for label in labels for t in (0.0, 0.7)}
    assert all(rows[label, 0.0]["matches_target"] for label in labels)  # greedy output is the target's
    assert all(rows[label, 0.0]["mean_tv"] is None for label in labels)  # greedy: no TV to record
    assert all(0.0 <= rows[label, 0.7]["mean_tv"] <= 1.0 and rows[label, 0.7]["tv_positions"] > 0 for label in labels)
    # each GLIDE trained with its own entry's keys: only the distilled one logged a TV term
    logged = {}
    for run in ("glide", "glide-1"):
        lines = (tmp_path / "demo" / run / "metrics.jsonl").read_text().splitlines()
        logged[run] = any("objective/tv" in json.loads(line) for line in lines)
    assert logged == {"glide": False, "glide-1": True}
    assert set(results["ratios"]) >= {"GLIDE tv (T=0.7, all tokens) ÷ GLIDE ce (chain γ=3, T=0.7)"}
    assert json.loads((tmp_path / "demo" / "acceptance.json").read_text())["ratios"] == results["ratios"]
    quality = results["answer_quality"]  # the target's own answers rated first, on the same prompts
    assert quality["answers"] == 2 and 0.0 < quality["distinct_2"] <= 1.0 and quality["lookup_tau"] >= 1.0
    assert "target's greedy answers: 2 answers" in (tmp_path / "demo" / "acceptance.md").read_text()


def test_tokens_seen_are_counted_in_steps_of_the_shared_batch(capsys):
    tokens = load_bench("tokens_seen")
    assert [tokens.parse_count(c) for c in ("30k", "0.3M", "2048", "1.5k")] == [30_000, 300_000, 2048, 1500]
    assert tokens.steps_for_tokens([1000, 2048, 4097], 1024) == [1, 2, 5]  # each count at least seen
    with pytest.raises(tokens.SpecdraftError, match="at least one step apart"):
        tokens.steps_for_tokens([1000, 1024], 1024)  # both one step
    # 118, 391, 1172 steps share no divisor: the run would export every step; the error offers
    # counts whose steps are multiples of the first, and those pass
    with pytest.raises(tokens.SpecdraftError, match=r"save 1172 exports.*e\.g\. 30\.208k,120\.832k,302\.08k"):
        tokens.steps_for_tokens([30_000, 100_000, 300_000], 256)
    assert tokens.steps_for_tokens([30_208, 120_832, 302_080], 256) == [118, 472, 1180]
    assert tokens.steps_for_tokens([30_720, 61_440, 92_160, 122_880], 256) == [120, 240, 360, 480]  # the preset's
    with pytest.raises(SystemExit) as exit_info:
        load_bench("acceptance").main(["--tokens-seen", "30k,lots"])
    assert exit_info.value.code == 2 and "a count such as 30k" in capsys.readouterr().err


@pytest.mark.parametrize(
    "item, message",
    [
        ("lerning_rate=1e-3", "unknown key 'lerning_rate' (did you mean 'learning_rate'?)"),
        ("learning_rate=fast", "key 'learning_rate': value 'fast' is not a valid float"),
        ("max_steps=3", "the bench sets max_steps for every run"),
        ("draft.ttt_steps=2", "a draft key differs by family"),
    ],
)
def test_a_bad_set_is_refused_in_one_line_before_any_asset_is_built(item, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    bench = load_bench("acceptance")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--set", item, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "home").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["acceptance", "regenerate"])
def test_an_out_the_bench_did_not_write_is_refused_and_its_runs_kept(script, capsys, tmp_path, monkeypatch):
    """The bench retrains the runs under --out/<preset> (rmtree of a run dir): a user's own run
    there (here runs/tiny/glide, a real run directory) is never deleted: one line, exit 2, before
    any asset is built; the bench's own directory (its marker) is taken again."""
    from specdraft.rundir.ownership import start_run_dir

    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    users_run = tmp_path / "runs" / "tiny" / "glide"
    start_run_dir(users_run)
    (users_run / "weeks_of_training.txt").write_text("kept")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "runs").rglob("*"))
    bench = load_bench(script)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--preset", "tiny", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert f"--out: {tmp_path / 'runs' / 'tiny'} exists, is not empty and was not written by this bench" in err
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "runs").rglob("*")) == before
    assert not (tmp_path / "home").exists()
    bench_out = load_bench("bench_out")
    bench_out.mark_bench_out(tmp_path / "ours")
    (tmp_path / "ours" / "glide").mkdir()
    bench_out.check_bench_out(tmp_path / "ours")  # the bench's own: no refusal


def test_a_bad_key_found_where_a_run_is_configured_is_one_line_from_the_command_line(tiny_data, tmp_path):
    """A SpecdraftError raised while the script builds a run's config (here the target's directory,
    checked by load_config) ends the script in one line with exit 2, not a traceback."""
    import subprocess
    import sys

    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    missing = tmp_path / "no-target"
    args = ["--target", str(missing), "--prompts", str(tiny_data.prompts_file), "--data", data_glob]
    args += ["--families", "glide", "--tokens-seen", "2048", "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "acceptance.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        == f"bench/acceptance.py: override 'target={missing}': key 'target': directory not found: {missing}"
    )
    assert not (tmp_path / "out").exists()


def test_acceptance_bench_measures_tau_against_tokens_seen(tiny_target_dir, tiny_data, tmp_path):
    """One run of every family to the largest count (one target pass a step), each family's export at
    each count measured greedy: the last point is the main table's chain row, each earlier one the
    export written at its step."""
    bench = load_bench("acceptance")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    per_step = 8 * 256  # the tiny demo configs' per_device_batch_size x max_seq_length
    results = bench.main(
        [
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(tiny_data.prompts_file),
            "--data",
            data_glob,
            "--families",
            "glide,eagle3",
            "--tokens-seen",
            f"{per_step},{3 * per_step}",
            "--temperatures",
            "0",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--gamma",
            "3",
            "--tree",
            "",
            "--set",
            "learning_rate=0.0123",
            "--out",
            str(tmp_path),
        ]
    )
    assert results["steps"] == [1, 3]
    run = tmp_path / "demo" / "together"  # both families in one run of several drafts
    assert OmegaConf.load(run / "config.yaml").learning_rate == 0.0123  # --set reaches the run
    assert sorted(p.name for p in run.glob("step_*")) == ["step_1", "step_2", "step_3"]
    assert list(results["train_seconds"]) == ["all in one run"]
    for family, label in (("glide", "GLIDE"), ("eagle3", "EAGLE-3")):
        assert results["exports"][label] == str(run / "step_3" / family)
        last = next(r for r in results["rows"] if r["label"] == label and r["gamma"] == 3)
        assert results["tokens_seen"][label][str(3 * per_step)] == last["tau"]
        # the first point is the step-1 export's own tau, measured as eval measures it
        first = evaluate_export(run / "step_1" / family, tiny_data.prompts_file)
        assert results["tokens_seen"][label][str(per_step)] == first["tau"]
    table = (tmp_path / "demo" / "acceptance.md").read_text()
    assert f"| GLIDE | {results['tokens_seen']['GLIDE'][str(per_step)]:.2f} |" in table
    assert "| prompt lookup |" in table.split("τ against tokens seen")[1]


def test_acceptance_bench_on_text_generates_no_answers(tiny_assets, tmp_path, monkeypatch):
    """--data-source text reads the target, its held-out prompts and the stdlib text: in a home
    holding only the target nothing is regenerated (no data/), and GLIDE learns the text by KL."""
    import shutil

    bench = load_bench("acceptance")
    home = tmp_path / "home"
    shutil.copytree(tiny_assets[0], home / "tiny" / "target")
    monkeypatch.setenv("SPECDRAFT_HOME", str(home))
    results = bench.main(
        ["--preset", "tiny", "--data-source", "text", "--families", "glide", "--train-steps", "1"]
        + ["--temperatures", "0", "--max-prompts", "1", "--max-new-tokens", "4", "--tree", ""]
        + ["--out", str(tmp_path / "out")]
    )
    assert sorted(p.name for p in (home / "tiny").iterdir()) == ["prompts", "target", "text"]
    assert results["data"] == str(home / "tiny" / "text" / "shard-*.jsonl")
    config = (tmp_path / "out" / "tiny" / "glide" / "config.yaml").read_text()
    assert "loss: kl" in config and f"eval_prompts: {home}/tiny/prompts/prompts.jsonl" in config


def evaluate_export(export, prompts_file):
    from specdraft.commands.evaluate import evaluate

    return evaluate(export, prompts_file, gamma=3, max_new_tokens=8, max_prompts=2, device="cpu", baseline=False)


def test_acceptance_bench_measures_a_confidence_drafter_at_each_stop(tiny_target_dir, tiny_data, tmp_path):
    """DSpark is measured without a stop and once per --confidence-threshold; c = 1 stops before
    every slot (a confidence is a sigmoid, below 1): nothing is proposed, τ is exactly 1."""
    bench = load_bench("acceptance")
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    results = bench.main(
        [
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(tiny_data.prompts_file),
            "--data",
            data_glob,
            "--families",
            "dspark",
            "--train-steps",
            "2",
            "--temperatures",
            "0",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--gamma",
            "3",
            "--tree",
            "",
            "--confidence-threshold",
            "0,1",
            "--out",
            str(tmp_path),
            "--plot",
            str(tmp_path / "acceptance.png"),
        ]
    )
    rows = {(row["label"], row["gamma"]): row for row in results["rows"]}
    assert {label for label, _ in rows} == {"DSpark", "DSpark (stop c=0)", "DSpark (stop c=1)", "prompt lookup"}
    assert all(row["matches_target"] for row in rows.values())  # lossless at every stop
    # the chain, and the whole block: demo-dspark's 8 slots, every one predicting (sample_from_anchor)
    assert sorted(g for label, g in rows if label == "DSpark") == [3, 8]
    for gamma in (3, 8):
        never, always = rows["DSpark (stop c=0)", gamma], rows["DSpark (stop c=1)", gamma]
        assert never["proposed_per_round"] == gamma and never["tau"] == rows["DSpark", gamma]["tau"]
        assert always["proposed_per_round"] == 0 and always["tau"] == 1.0
    assert set(results["ratios"]) >= {"DSpark (stop c=1) ÷ DSpark (chain γ=3, T=0)"}
    assert (tmp_path / "acceptance.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # every row's bars
    with pytest.raises(SystemExit):
        bench.main(["--confidence-threshold", "1.5", "--draft", str(tmp_path)])


def test_acceptance_bench_offers_every_preset():
    bench = load_bench("acceptance")
    assert bench.parse_args(["--preset", "bench"]).preset == "bench"
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "huge"])


def test_regenerate_bench_times_both_backends_and_trains_on_each_answer_set(
    tiny_target_dir, tiny_data, tmp_path, capsys
):
    """bench/regenerate.py on the tiny demo: both backends regenerate the same prompts (the same
    greedy answers), and one GLIDE is trained on each of the human, greedy and sampled answers."""
    bench = load_bench("regenerate")
    results = bench.main(
        [
            "--preset",
            "tiny",
            "--home",
            str(Path(tiny_target_dir).parents[1]),
            "--train-steps",
            "2",
            "--throughput-prompts",
            "3",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--out",
            str(tmp_path),
        ]
    )
    t = results["throughput"]
    assert t["identical_answers"] == 3 and t["hf"]["tokens"] == t["openai"]["tokens"] > 0
    assert t["hf"]["rows"] == t["openai"]["rows"] == 3 and t["hf"]["errors"] == t["openai"]["errors"] == 0
    # the human set: the same prompts as the greedy data, each answered by its function body
    human = [json.loads(line) for line in Path(results["value"]["data"]["human"]).read_text().splitlines()]
    greedy = [json.loads(line) for path in tiny_data.train_files for line in Path(path).read_text().splitlines()]
    assert sorted(r["conversations"][0]["content"] for r in human) == sorted(
        r["conversations"][0]["content"] for r in greedy
    )
    answers = {r["conversations"][0]["content"]: r["conversations"][1]["content"] for r in human}
    assert answers != {r["conversations"][0]["content"]: r["conversations"][-1]["content"] for r in greedy}
    from specdraft.demo.corpus import extract_functions, read_corpus
    from specdraft.demo.presets import get_preset

    bodies = {f.prompt: f.answer for f in extract_functions(read_corpus(get_preset("tiny").corpus_bytes, 0))}
    assert all(bodies[prompt] == answer for prompt, answer in answers.items())
    taus = {(r["label"], r["temperature"]) for r in results["value"]["rows"]}
    assert taus == {(label, t) for label in ("human", "greedy", "sampled", "prompt lookup") for t in (0.0, 0.7)}
    last = dict(item.split("=") for item in capsys.readouterr().out.strip().splitlines()[-1].split())
    assert {"hf_openai_ratio", "tau_human_T0", "tau_sampled_T07", "ratio_sampled_human_T07"} <= set(last)


def test_step_efficiency_bench_runs_every_family(tmp_path):
    """A smoke run (it was broken for a whole session once): every registered family's step, with
    its default objective and a distillation objective, on the tiny shape; one round each."""
    import math
    import subprocess
    import sys

    from specdraft.drafts.registry import FAMILIES

    families = sorted(FAMILIES)  # a new family without bench settings fails here
    env = launch_env(one_rank=True)
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "step_efficiency.py"),
            "--families",
            ",".join(families),
            "--shapes",
            "tiny",
            "--zero",
            "2",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--objectives",
            "kl:all",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[1:2] == ["tiny"]]
    # per family: its default objective, then kl on every token (a family without draft.loss: its own only)
    from specdraft.drafts import family_keys

    distilled = [family for family in families if "loss" in family_keys(FAMILIES[family])]
    assert [r[0] for r in rows] == [family for family in families for _ in range(2 if family in distilled else 1)]
    assert [" ".join(r[-4:]) for r in rows if " ".join(r[-4:]) == "kl (T=1, all tokens)"] == [
        "kl (T=1, all tokens)"
    ] * len(distilled)
    assert all(float(r[8]) > 0 for r in rows)  # (c)/(a+b): every step ran and was timed
    last = dict(item.split("=") for item in run.stdout.strip().splitlines()[-1].split())
    assert set(last) == {
        "ratio",
        "distill_ratio",
        "distill_step_ratio",
        "distill_draft_ratio",
        *(f"ratio_{family}" for family in families),
    }
    assert all(math.isfinite(float(value)) for value in last.values())


def test_gpu_step_bench_runs_every_family_on_the_cpu_preset():
    """bench/gpu_step.py --device cpu: the GPU twin's code (target built on the device, capture,
    draft alone, engine step, clocks, peaks, dynamo counters) on the tiny preset, every registered
    family (a new one without bench support fails here). Each training step counts exactly the
    batch's B x T tokens, and every case's ratio, tokens/s and peak are finite and positive."""
    import math
    import re
    import subprocess
    import sys

    from specdraft.drafts.registry import FAMILIES

    families = sorted(FAMILIES)
    env = launch_env(one_rank=True)
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_step.py"),
            "--device",
            "cpu",
            "--families",
            ",".join(families),
            "--steps",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert re.match(r"^(\w+=\S+)(\s+\w+=\S+)*\s*$", lines[-1])  # what bench/summary.py reads
    last = dict(item.split("=") for item in lines[-1].split())
    shapes = {"64x2": (64, 2), "128x1": (128, 1)}  # the CPU preset: T x B
    keys = ("ratio", "tokens_per_s", "peak_gb", "step_ms", "first_s", "recompiles", "tokens")
    assert set(last) == {f"{family}_{shape}_{key}" for family in families for shape in shapes for key in keys}
    for family in families:
        for shape, (seq, batch) in shapes.items():
            case = {key: last[f"{family}_{shape}_{key}"] for key in keys}
            assert int(case["tokens"]) == seq * batch, (family, shape, case)  # counted per step, as the loop does
            for key in ("ratio", "tokens_per_s", "peak_gb", "step_ms", "first_s"):
                assert math.isfinite(float(case[key])) and float(case[key]) > 0, (family, shape, key, case)
            assert int(case["recompiles"]) >= 0
    # one table row per case, each measured (none oom, skipped or failed)
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in families]
    assert sorted((r[0], r[1]) for r in rows) == sorted((f, s) for f in families for s in shapes)
    assert all(float(r[6]) > 0 for r in rows)  # c/(a+b)


def test_several_drafts_bench_times_the_shared_step_against_each_run_alone():
    """A smoke run: every registered family together and alone on the tiny shape, one round."""
    import math
    import subprocess
    import sys

    from specdraft.drafts.registry import FAMILIES

    # the bench's targets are Llamas: the families that draft for them (not MTP, a target's own layer)
    families = sorted(family for family, cls in FAMILIES.items() if cls.target_model_types is None)
    env = launch_env(one_rank=True)
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "several_drafts.py"),
            "--families",
            ",".join(families),
            "--shapes",
            "tiny",
            "--rounds",
            "1",
            "--warmup",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] and line.split()[0] in families]
    assert [r[0] for r in rows] == families and all(0 < float(r[3]) < 1 for r in rows)  # the target's share
    last = dict(item.split("=") for item in run.stdout.strip().splitlines()[-1].split())
    assert set(last) == {"ratio", "step_ratio", "target_share"}
    assert all(math.isfinite(float(value)) and float(value) > 0 for value in last.values())


def test_acceptance_context_pads_each_prompt_with_whole_earlier_conversations_of_the_data(tiny_target_dir, tiny_data):
    """--context N: every prompt is N tokens, its own tokens last, after rendered conversations of
    --data (each whole but the oldest, cut from its start); another prompt gets another history."""
    from transformers import AutoTokenizer

    from specdraft.decode.prompts import read_prompts

    measuring = load_bench("acceptance_measure")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    prompts = read_prompts(tiny_data.prompts_file, tokenizer, 2)
    data_glob = str(Path(tiny_data.train_files[0]).parent / "shard-*.jsonl")
    padded = measuring.padded_to_context(prompts, data_glob, tokenizer, 300)
    assert [len(p) for p in padded] == [300, 300]
    assert all(p[-len(prompt) :] == prompt for p, prompt in zip(padded, prompts))
    assert padded[0][: -len(prompts[0])] != padded[1][: -len(prompts[1])]
    with pytest.raises(measuring.SpecdraftError, match="--context needs --data"):
        measuring.padded_to_context(prompts, None, tokenizer, 300)
