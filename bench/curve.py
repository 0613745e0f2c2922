"""Tau against tokens seen, every family, beside prompt lookup: the tokens at which each family's
draft passes it. Long (hours on 2 CPU cores), so it runs in sittings.

    python bench/curve.py                          # smollm2: every family but MTP, 64k ... 1M tokens, 32 prompts
    python bench/curve.py --tokens 64k,128k --families glide,eagle3
    python bench/curve.py --quick                  # a few steps on the tiny preset (tests)

Training: one run of several drafts (`drafts:`, the target's forward shared) to the largest count,
each family with bench/acceptance.py's demo config and the preset's CPU budget (PRESET_OVERRIDES:
one sequence of 256 tokens a step on smollm2), an export of every draft at each count. The counts
are rounded to multiples of the first (in whole steps) so the one run exports at every one.

Measuring: every export and prompt lookup, greedy with a chain of --gamma on the preset's held-out
prompts (smollm2: 32 code-completion prompts) by specdraft's decoder, per prompt too: the ratio to
prompt lookup with its paired-bootstrap 95% interval (bench/offline_parts.py tau_ratio). The report
gives, per family, tau at each count, its acceptance per chain position at the largest count, and
the first count at which its tau passes prompt lookup's.

Resumable: the run trains with resume=auto, so a rerun continues from its newest committed slot
(it saves at every count); every measured export is kept under --out/<preset>/parts and reused.
Writes curve.md and curve.json to --out/<preset> and ends with one line of key=value pairs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from acceptance_runs import LABELS, PRESET_FAMILIES, PRESET_OVERRIDES, several_drafts_config, tokens_per_step  # noqa: E402
from bench_out import check_bench_out, mark_bench_out  # noqa: E402
from bench_cli import assets_parser, parse_measuring, run_or_exit  # noqa: E402
from offline_parts import Assets, Judge, Parts, tau_ratio  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from tokens_seen import parse_count  # noqa: E402

QUICK = dict(preset="tiny", families="glide,dflash", tokens="2k,4k", max_prompts=2, max_new_tokens=8, gamma=3)


def parse_args(argv=None):
    parser = assets_parser(__doc__)
    parser.add_argument("--families", help="families to train (default: the preset's, smollm2: every family but MTP)")
    parser.add_argument("--tokens", default="64k,128k,256k,512k,1M", help="token counts of the exports")
    args = parse_measuring(parser, argv, "runs/bench-curve", QUICK)
    args.families = args.families or PRESET_FAMILIES.get(args.preset, "glide,eagle3,dflash")
    return args


def budget(preset: str):
    """The preset's shared keys and each family's draft keys (bench/acceptance.py's CPU budget)."""
    keys = PRESET_OVERRIDES.get(preset, {})
    return [k for k in keys.get("*", []) if not k.startswith("logging_steps=")], keys


def step_counts(counts, per_step: int):
    """Each count in whole steps, every one a multiple of the first (the run saves every first)."""
    first = max(1, -(-counts[0] // per_step))
    steps = [first * max(1, round(c / per_step / first)) for c in counts]
    if steps != sorted(set(steps)):
        raise SpecdraftError(f"--tokens: {counts} in steps of {first} are {steps}; give counts further apart")
    return steps


def train_curve(assets: Assets, families, steps, run_dir: Path):
    """The one run of every family to steps[-1], resumed where an earlier sitting stopped."""
    from specdraft.train.loop import train

    shared, per_family = budget(assets.args.preset)
    cfg = several_drafts_config(
        families,
        assets.target,
        assets.data,
        assets.prompts,
        run_dir,
        steps[-1],
        shared=[*shared, "resume=auto", f"logging_steps={steps[0]}"],
        per_family={f: per_family.get(f, []) for f in families},
        save_steps=steps[0],
    )
    train(cfg)
    return cfg


def passes_lookup(taus: dict, lookup: dict, counts):
    """The first count whose tau is above prompt lookup's (None: not within the curve)."""
    return next((c for c in counts if taus[c]["tau"] > lookup["tau"]), None)


def main(argv=None) -> dict:
    return run_or_exit("bench/curve.py", run_bench, parse_args(argv))


def run_bench(args) -> dict:
    started = time.perf_counter()
    out = Path(args.out) / args.preset
    check_bench_out(out)
    mark_bench_out(out, "bench/curve.py")
    families = [f for f in args.families.split(",") if f]
    assets, parts = Assets(args, out), Parts(out)
    print(machine_line(), flush=True)
    shared, _ = budget(args.preset)
    per_step = tokens_per_step(
        several_drafts_config(families, assets.target, assets.data, assets.prompts, out / "plan", 1, shared=shared)
    )
    steps = step_counts([parse_count(c) for c in args.tokens.split(",") if c.strip()], per_step)
    counts = [s * per_step for s in steps]
    print(f"[bench] {len(families)} drafts to {counts[-1]} tokens ({steps[-1]} steps of {per_step})", flush=True)
    run_dir = out / "runs" / f"{'-'.join(families)}-s{steps[-1]}e{steps[0]}"
    done = run_dir / f"step_{steps[-1]}"
    if not done.is_dir():
        train_curve(assets, families, steps, run_dir)

    judge = None

    def measured(export):
        nonlocal judge
        judge = judge or Judge(assets)
        return judge.tau(export)

    judging = f"g{args.gamma}-p{args.max_prompts}x{args.max_new_tokens}"
    lookup = parts.get(f"tau-lookup-{judging}", lambda: measured(None))
    taus = {}
    for family in families:
        for count, step in zip(counts, steps):
            export = run_dir / f"step_{step}" / family
            taus[family, count] = parts.get(
                f"tau-{run_dir.name}-{family}-{step}-{judging}", lambda e=export: measured(str(e))
            )
    report = write_report(args, out, families, counts, taus, lookup, time.perf_counter() - started)
    print(" ".join(f"{k}={v}" for k, v in report["summary"].items()), flush=True)
    return report


def write_report(args, out: Path, families, counts, taus, lookup, seconds) -> dict:
    lines = [
        f"# tau against tokens seen ({args.preset})",
        "",
        machine_line(),
        f"greedy chain gamma {args.gamma}, {args.max_prompts} prompts x {args.max_new_tokens} new tokens; "
        f"prompt lookup tau {lookup['tau']:.3f}; {seconds:.0f} s this sitting",
        "",
        "| family | " + " | ".join(f"{c:,}" for c in counts) + " | passes lookup at | / lookup at the last (95%) |",
        "|---|" + "---|" * (len(counts) + 2),
    ]
    summary, result = {"tau_lookup": f"{lookup['tau']:.3f}"}, {}
    for family in families:
        first = passes_lookup({c: taus[family, c] for c in counts}, lookup, counts)
        ratio = tau_ratio(taus[family, counts[-1]], lookup)
        cells = " | ".join(f"{taus[family, c]['tau']:.3f}" for c in counts)
        lines.append(
            f"| {LABELS.get(family, family)} | {cells} | {first or 'not yet'} | "
            f"{ratio['ratio']:.3f} ({ratio['low']:.3f}-{ratio['high']:.3f}) |"
        )
        per_position = taus[family, counts[-1]].get("per_position")
        if per_position:
            lines.append(
                f"| ... its acceptance per position at the last | {' '.join(f'{p:.2f}' for p in per_position)} |"
            )
        result[family] = dict(
            taus={c: taus[family, c]["tau"] for c in counts}, passes_lookup_at=first, last_over_lookup=ratio
        )
        summary[f"tau_{family}"] = f"{taus[family, counts[-1]]['tau']:.3f}"
        summary[f"passes_{family}"] = first or 0
    (out / "curve.md").write_text("\n".join(lines) + "\n")
    report = dict(counts=counts, lookup=lookup["tau"], families=result, summary=summary)
    (out / "curve.json").write_text(json.dumps(report, indent=1))
    print("\n".join(lines), flush=True)
    return report


if __name__ == "__main__":
    main()
