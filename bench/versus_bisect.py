"""Bisect a gap bench/versus.py found: specdraft's defaults plus one group of keys at a time,
trained to the same tokens and measured by the same decoder against speculators' run of that mode,
which bench/versus.py has already trained and measured (its parts under --out are read, never
written).

    python bench/versus.py --preset tiny --tokens 8k,16k,32k --max-prompts 8 --families dflash
    python bench/versus_bisect.py --preset tiny --tokens 32k --max-prompts 8 --family dflash \\
        --variant base= --variant batch1=per_device_batch_size=1 \\
        --variant run=per_device_batch_size=1,learning_rate=1e-3,warmup_steps=1

Each variant is a run of its own under --bisect-out/<family> (kept, with its greedy chain tau, as
parts: a rerun reuses them). Prints per variant its steps, tau, and the ratio to speculators' tau
with the paired-bootstrap 95% interval, and one summary line of key=value pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import versus  # noqa: E402
import versus_settings  # noqa: E402
from offline_parts import Assets, Parts, tau_ratio  # noqa: E402
from tokens_seen import parse_count  # noqa: E402
from versus_runs import Measure, judging_name, plan_family, set_threads, specdraft_tokens_per_step, train_specdraft  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--family", default="dflash")
    parser.add_argument("--mode", default="defaults", help="speculators' run to compare with (and the base recipe)")
    parser.add_argument("--tokens", default="32k", help="one count bench/versus.py measured")
    parser.add_argument("--max-prompts", type=int, default=8)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...")
    parser.add_argument("--out", default="runs/bench-versus", help="bench/versus.py's --out")
    parser.add_argument("--bisect-out", default="runs/bench-versus-bisect")
    args = parser.parse_args(argv)
    # the measure of bench/versus.py's parts, greedy chain only
    judged = versus.parse_args(["--preset", args.preset, "--max-prompts", str(args.max_prompts)])
    return args, judged


def main(argv=None) -> dict:
    args, judged = parse_args(argv)
    set_threads()
    count = parse_count(args.tokens)
    out = Path(args.out) / args.preset
    assets = Assets(judged, out)
    parts = Parts(Path(args.bisect_out) / args.preset / args.family)
    plan = plan_family(args.family, assets.target, args.preset)
    features = json.loads((out / "parts" / f"{plan.features_name}.json").read_text())
    theirs_name = f"{args.family}-{args.mode}-{versus_settings.recipe_digest(args.family, args.mode)}"
    runs = [json.loads(p.read_text()) for p in sorted((out / "parts").glob(f"{theirs_name}-speculators-s*of*.json"))]
    if not runs:
        sys.exit(
            f"bench/versus_bisect.py: {out / 'parts'}: no speculators run {theirs_name}; run bench/versus.py first"
        )
    # the count bench/versus.py rounded --tokens to (versus_runs.exact_counts)
    theirs_run = min(runs, key=lambda r: abs(r["count"] - parse_count(args.tokens)))
    count = theirs_run["count"]
    theirs = json.loads((out / "parts" / f"tau-{theirs_run['name']}-{judging_name(judged)}.json").read_text())["chain"]
    print(f"[bisect] speculators {args.mode}: tau {theirs['tau']:.3f} at {count} tokens", flush=True)
    measure, result = None, {}
    for variant in args.variant:
        name, _, keys = variant.partition("=")
        extra = [k for k in keys.split(",") if k]
        versus_settings.SPECDRAFT[name] = [*versus_settings.SPECDRAFT[args.mode], *extra]
        steps = count // specdraft_tokens_per_step(assets, plan, name, features)
        run_dir = parts.dir.parent / "runs" / name
        run = parts.get(
            f"train-{name}", lambda: train_specdraft(assets, plan, name, features, [count], [steps], run_dir)
        )

        def judged_tau(export=run["exports"][str(count)]):
            nonlocal measure
            measure = measure or Measure(assets)
            return measure.taus(export)["chain"]

        tau = parts.get(f"tau-{name}-{judging_name(judged)}", judged_tau)
        ratio = tau_ratio(tau, theirs)
        result[name] = dict(keys=extra, steps=steps, tau=tau["tau"], ratio=ratio)
        print(
            f"[bisect] {name}: {steps} steps, tau {tau['tau']:.3f}, specdraft / speculators {ratio['ratio']:.3f} "
            f"({ratio['low']:.3f}-{ratio['high']:.3f}) {' '.join(extra)}",
            flush=True,
        )
    print(
        " ".join(
            [
                f"speculators_tau={theirs['tau']:.3f}",
                *(f"{n}_ratio={r['ratio']['ratio']:.3f}" for n, r in result.items()),
            ]
        )
    )
    return result


if __name__ == "__main__":
    main()
