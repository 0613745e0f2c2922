"""Acceptance benchmark: draft families and training objectives trained the same way, side by side,
against prompt lookup (no model), greedy and sampled.

    python bench/acceptance.py                                  # demo preset: GLIDE, EAGLE-3, DFlash
    python bench/acceptance.py --preset tiny                    # a quick run
    python bench/acceptance.py --preset bench                   # the bench target (~15 CPU-minute build, cached)
    python bench/acceptance.py --families glide --objectives ce "0.9*tv + 0.1*ce@0.7" "kl@1.0:all" \\
        --gamma 4 --tree ""                                     # one GLIDE per objective
    python bench/acceptance.py --draft GLIDE=runs/demo --draft runs/demo-eagle3   # existing runs / exports
    python bench/acceptance.py --preset smollm2 --tokens-seen 30.72k,92.16k,122.88k \\
        --max-prompts 8 --max-new-tokens 48 --tree 3,6,6,6,6 --confidence-threshold ""
                                            # a real chat model, every family: tau against tokens seen
                                            # (steps 120, 360, 480 of one sequence: see PRESET_OVERRIDES)

--tokens-seen: each family trains once, to the largest count, on the same batches (same seed, the
same max_seq_length x per_device_batch_size tokens a step); its exports at each count are measured
greedy with a chain (the learning curve: what more data buys), the last one also as below. A
preset's CPU budget (PRESET_OVERRIDES) sets what every family shares and each family's cheaper
shape (EAGLE-3 / P-EAGLE draft vocab, DFlash / DSpark anchors and layers).

Training: every family in one run of several drafts (`drafts:`: the target's forward once a step
for all of them; bench/several_drafts.py measures what that saves), or with --apart (and always
with several --objectives) a run each; each family with its demo config (configs/demo.yaml,
demo-eagle3.yaml, demo-dflash.yaml) for --train-steps on the same data with the same seed, with
its default objective or once per --objectives entry ('SPEC[@T][:all]': a draft.loss value, its draft.distill_temperature and, with
':all', draft.distill_tokens=all: the teacher terms on every token). The data is the preset's demo
set: the target's greedy answers, or with --answer-temperature T its answers sampled at T (a
dataset of its own, cached beside the greedy one); the held-out eval prompts are the same.

First the target's own greedy answers to the prompts are rated (specdraft/demo/quality.py:
distinct-2, degenerate share, prompt lookup τ): a target that repeats itself flatters every drafter.
Every number comes from this one run. Per temperature, plain target decoding of the prompts is
measured once; then every drafter x shape (chain gamma; a block drafter's whole block as the chain;
tree) reports tau (tokens per target forward: accepted + 1), acceptance per position, mean TV(target
p, draft q) over the checked chain positions (T > 0), draft forward passes per generated token,
tok/s and speedup, and whether greedy output is token-identical to the target's ("lossless").
Prints a markdown table, tau ratios, and a last line of key=value pairs (bench/summary.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import List, Optional

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from acceptance_measure import measure_everything  # noqa: E402
from acceptance_report import report  # noqa: E402
from acceptance_runs import (  # noqa: E402
    CONFIGS,
    LABELS,
    PRESET_FAMILIES,
    PRESET_OVERRIDES,
    Trained,
    check_shared_overrides,
    family_config,
    slug,
    split_objective,
    tokens_per_step,
    train_draft,
    train_together,
)
from bench_cli import run_or_exit  # noqa: E402
from bench_out import check_bench_out, mark_bench_out  # noqa: E402
from specdraft.export.locate import resolve_export  # noqa: E402
from specdraft.decode.report import require_matplotlib  # noqa: E402
from specdraft.demo.presets import PRESETS  # noqa: E402
from specdraft.drafts.registry import draft_from_export_config  # noqa: E402
from specdraft.export.files import read_export_config  # noqa: E402
from tokens_seen import parse_count, steps_for_tokens  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    add_training_options(parser)
    add_measuring_options(parser)
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained drafts and results go")
    return parser.parse_args(argv)


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """What is trained, on what, for how long (or which drafts are given instead)."""
    parser.add_argument(
        "--families",
        default=None,
        help="draft families to train (default: glide,eagle3,dflash; the preset's own, e.g. "
        "smollm2: every family but MTP)",
    )
    parser.add_argument(
        "--objectives",
        nargs="+",
        default=[],
        help="train each family once per objective 'SPEC[@T][:all]', e.g. ce '0.9*tv + 0.1*ce@0.7' "
        "kl:all (default: once, with the family's default objective)",
    )
    parser.add_argument(
        "--draft",
        action="append",
        default=[],
        help="[LABEL=]run or export dir of an existing draft (repeatable; then nothing is trained)",
    )
    parser.add_argument("--data", help="training data glob (default: the preset's demo data)")
    parser.add_argument(
        "--data-source",
        choices=["answers", "text"],
        default=None,
        help="the preset's data: the target's regenerated answers, or stdlib text as written learnt by "
        "distillation (specdraft/demo/text_data.py); default: answers, which taught more a token "
        "(SmolLM2, 46k tokens: GLIDE tau 1.47 against 1.10)",
    )
    parser.add_argument(
        "--answer-temperature",
        type=float,
        default=0.0,
        help="train on the demo target's answers sampled at this temperature (default 0: greedy)",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="train each family in a run of its own (default: every family in one run of several "
        "drafts, the target's forward shared; always apart with several --objectives)",
    )
    parser.add_argument(
        "--set",
        dest="shared_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key every family's run takes, after the preset's (repeatable), e.g. "
        "learning_rate=3e-3 per_device_batch_size=1",
    )
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument(
        "--tokens-seen",
        default="",
        metavar="N,N,...",
        help="train to the largest count and measure the exports at each (e.g. 30.72k,92.16k,122.88k: "
        "steps 120, 360, 480 of 256 tokens, exported every 120): tau against tokens seen; overrides "
        "--train-steps",
    )


def add_measuring_options(parser: argparse.ArgumentParser) -> None:
    """How every drafter is measured: its shapes, the temperatures, the prompts, the device."""
    parser.add_argument("--gamma", type=int, default=5, help="chain length of every drafter")
    parser.add_argument("--tree", default="4,16,16,16,16", help="tree widths per depth ('' for chains only)")
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated sampling temperatures")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where target and drafts decode (cuda, cuda:1; the tables of docs/benchmarks/: cpu)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        metavar="N",
        help="pad each prompt to N tokens with earlier conversations of --data (long-context tau)",
    )
    parser.add_argument("--untrained", action="store_true", help="add the first draft, untrained (a floor)")
    parser.add_argument(
        "--confidence-threshold",
        default="0.5",
        help="drafters with a confidence head (DSpark) are measured again with each of these "
        "stops (comma-separated, e.g. 0.05,0.1,0.5)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="bar charts of acceptance per draft position and tau per drafter (specdraft[plots])",
    )


@dataclass
class Plan:
    """The command line read and checked before any asset is built; then the assets' paths."""

    tree: Optional[List[int]]  # widths per depth, None: chains only
    temperatures: List[float]
    thresholds: List[float]  # --confidence-threshold stops
    objectives: list  # (draft.* overrides, label) per --objectives entry
    families: List[str]
    counts: List[int]  # --tokens-seen
    budget: dict  # "*" (every run) and each family -> the preset's CPU budget, --set after it
    out: Path  # --out/<preset>
    target_dir: Optional[str] = None
    prompts_file: Optional[str] = None
    data_glob: Optional[str] = None


def main(argv=None) -> dict:
    """The bench; a SpecdraftError (bad input, found early or where a run's config is built) ends
    it in one line, exit 2."""
    return run_or_exit("bench/acceptance.py", run_bench, parse_args(argv))


def run_bench(args) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    plan = read_plan(args)
    resolve_assets(args, plan)
    trained = Trained(steps=[args.train_steps])
    add_given_drafts(args.draft, trained)
    if not args.draft:
        train_families(args, plan, trained)
    measured = measure_everything(args, plan, trained)
    return report(args, plan, trained, measured, started)


def read_plan(args) -> Plan:
    """Every setting checked (one line on a bad one) before anything is built or written."""
    tree = [int(w) for w in args.tree.split(",")] if args.tree else None
    temperatures = [float(t) for t in args.temperatures.split(",")]
    thresholds = [float(c) for c in args.confidence_threshold.split(",") if c.strip()]
    if any(not 0.0 <= c <= 1.0 for c in thresholds):
        sys.exit(f"--confidence-threshold {args.confidence_threshold}: each stop must lie in [0, 1]")
    if args.plot:
        require_matplotlib()
    objectives = [split_objective(text) for text in args.objectives]
    families = [f for f in (args.families or PRESET_FAMILIES.get(args.preset, "glide,eagle3,dflash")).split(",") if f]
    counts = [parse_count(c) for c in args.tokens_seen.split(",") if c.strip()]
    check_shared_overrides(args.shared_overrides)
    budget = PRESET_OVERRIDES.get(args.preset, {})
    budget = {**budget, "*": [*budget.get("*", []), *args.shared_overrides]}
    unknown = sorted(set(families) - set(CONFIGS))
    if unknown:
        sys.exit(f"--families: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if args.data and args.answer_temperature > 0:
        sys.exit("--data and --answer-temperature: give one (the latter builds its own data set)")
    out = Path(args.out) / (
        args.preset if args.answer_temperature <= 0 else f"{args.preset}-answers-T{args.answer_temperature:g}"
    )
    check_bench_out(out)
    return Plan(tree, temperatures, thresholds, objectives, families, counts, budget, out)


def resolve_assets(args, plan: Plan) -> None:
    """The target, prompts and data given, else the preset's demo assets; with --data-source text
    the preset's stdlib text (no answers generated) and every family's teacher terms."""
    target_dir, prompts_file, data_glob = args.target, args.prompts, args.data
    # text as written teaches the target's distribution only through a teacher term
    distilled = args.data_source == "text"
    if distilled and args.data is None and args.answer_temperature > 0:
        sys.exit("--answer-temperature: the answers' temperature; the text data generates none (--data-source answers)")
    if distilled and args.data is None:  # the preset's text needs no answers: none are generated
        from specdraft.demo.assets import SEED, ensure_held_out_prompts
        from specdraft.demo.text_data import ensure_text_data
        from specdraft.paths import specdraft_home

        demo_target, demo_prompts = ensure_held_out_prompts(preset=args.preset)
        target_dir, prompts_file = target_dir or str(demo_target), prompts_file or str(demo_prompts)
        text = ensure_text_data(specdraft_home(), args.preset, demo_prompts, SEED)
        data_glob = str(text[0].parent / "shard-*.jsonl")
    if target_dir is None or prompts_file is None or (not args.draft and data_glob is None):
        from specdraft.demo.assets import ensure_demo_assets

        demo_target, demo_data = ensure_demo_assets(preset=args.preset, answer_temperature=args.answer_temperature)
        target_dir = target_dir or str(demo_target)
        prompts_file = prompts_file or str(demo_data.prompts_file)
        data_glob = data_glob or str(Path(demo_data.train_files[0]).parent / "shard-*.jsonl")
    plan.target_dir, plan.prompts_file, plan.data_glob = target_dir, prompts_file, data_glob
    if distilled:
        from specdraft.demo.text_data import distillation_overrides

        budget = plan.budget
        plan.budget = {
            **budget,
            **{f: [*budget.get(f, []), *distillation_overrides(CONFIGS[f])] for f in plan.families},
        }


def add_given_drafts(items: List[str], trained: Trained) -> None:
    """--draft [LABEL=]DIR: an existing run or export, labelled by its family unless named."""
    for item in items:
        label, _, path = item.rpartition("=")
        export = resolve_export(path)[0]
        label = label or LABELS[draft_from_export_config(read_export_config(export)).family]
        trained.exports[label], trained.keys[label] = export, slug(label)


def train_families(args, plan: Plan, trained: Trained) -> None:
    """Every family (once per --objectives entry) for --train-steps, or to the largest
    --tokens-seen count with an export at each: in one run of several drafts (`drafts:`, the
    target's forward once a step for all), or a run each (--apart, several --objectives)."""
    if plan.counts:  # every family reads the same tokens a step: one count of steps for all
        trained.steps = steps_for_tokens(plan.counts, shared_tokens_per_step(plan))
    save_every = gcd(*trained.steps) if plan.counts else None  # every point of the curve is an export
    mark_bench_out(plan.out)
    if len(plan.families) > 1 and len(plan.objectives) <= 1 and not args.apart:
        train_in_one_run(plan, trained, save_every)
    else:
        train_apart(plan, trained, save_every)


def shared_tokens_per_step(plan: Plan) -> int:
    """The tokens a step every family reads (--tokens-seen counts them); differing ones: one line."""
    budget = plan.budget
    per_step = {
        tokens_per_step(
            family_config(
                f,
                plan.target_dir,
                plan.data_glob,
                plan.prompts_file,
                plan.out / f,
                1,
                budget.get("*", []) + budget.get(f, []),
            )
        )
        for f in plan.families
    }
    if len(per_step) != 1:
        sys.exit(
            f"--tokens-seen: the families read {sorted(per_step)} tokens a step; give them one "
            f"max_seq_length x per_device_batch_size"
        )
    return per_step.pop()


def train_in_one_run(plan: Plan, trained: Trained, save_every: Optional[int]) -> None:
    """One run, one target pass a step for every family (`drafts:`)."""
    overrides, name = plan.objectives[0] if plan.objectives else ([], None)
    steps, budget = trained.steps, plan.budget
    t0 = time.perf_counter()
    run_dir = plan.out / "together"
    last = train_together(
        plan.families,
        plan.target_dir,
        plan.data_glob,
        plan.prompts_file,
        run_dir,
        steps[-1],
        shared=budget.get("*", []),
        per_family={f: [*budget.get(f, []), *overrides] for f in plan.families},
        save_steps=save_every,
    )
    seconds = time.perf_counter() - t0
    for family in plan.families:
        label = LABELS[family] + (f" {name}" if name else "")
        trained.keys[label], trained.exports[label] = family, last / family
        if plan.counts:
            trained.curve[label] = {count: run_dir / f"step_{s}" / family for count, s in zip(plan.counts, steps)}
    trained.train_seconds["all in one run"] = seconds
    print(f"[bench] trained {', '.join(plan.families)} together for {steps[-1]} steps in {seconds:.0f}s", flush=True)


def train_apart(plan: Plan, trained: Trained, save_every: Optional[int]) -> None:
    """A run per family and objective, each in its own directory under --out."""
    steps, budget = trained.steps, plan.budget
    for family in plan.families:
        variants = plan.objectives or [([], None)]
        for i, (overrides, name) in enumerate(variants):
            label = LABELS[family] + (f" {name}" if name else "")
            trained.keys[label] = family + (f"_objective{i}" if i else "")
            t0 = time.perf_counter()
            run_dir = plan.out / (family + (f"-{i}" if i else ""))
            trained.exports[label] = train_draft(
                family,
                plan.target_dir,
                plan.data_glob,
                plan.prompts_file,
                run_dir,
                steps[-1],
                [*budget.get("*", []), *budget.get(family, []), *overrides],
                save_every,
            )
            if plan.counts:
                trained.curve[label] = {count: run_dir / f"step_{s}" for count, s in zip(plan.counts, steps)}
            trained.train_seconds[label] = time.perf_counter() - t0
            print(
                f"[bench] trained {label} for {steps[-1]} steps in {trained.train_seconds[label]:.0f}s: "
                f"{trained.exports[label]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
