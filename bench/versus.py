"""specdraft against speculators' own trainer (`speculators train`, 0.9.0), side by side: the same
target, rows, max_seq_length, target layer ids, draft vocabulary and tokens seen, each draft
measured by the same decoder.

    python bench/versus.py                                # smollm2: EAGLE-3, DFlash, DSpark at 16k, 64k, 256k tokens
    python bench/versus.py --preset tiny --tokens 8k,16k,32k --max-prompts 8    # minutes on 2 cores
    python bench/versus.py --quick                        # a few steps of everything on tiny (tests)

Per family (EAGLE-3, DFlash, DSpark: both trainers train them on a CPU and both drafts load in our
decoder; versus_settings.NOT_COMPARED says why P-EAGLE, MTP and GLIDE are not) and per mode
("defaults": each trainer as shipped; "matched": versus_settings' one recipe on both sides):

  features   the rows specdraft trains on (prepare_data, packing whole), written in speculators'
             offline layout with the shared draft vocabulary (bench/versus_features.py)
  specdraft  one run to the largest token count (the target live), an export at each count
  speculators one run per count on those features (bench/speculators_train.py on a CPU), each the
             first steps of the largest run's schedule; its checkpoint read back as our export
             (bench/versus_draft.py). bench/versus_runs.py says why this is exact.

Both trainers take the preset's CPU budget of bench/acceptance.py for the draft's shape
(PRESET_OVERRIDES: max_seq_length, EAGLE-3's draft vocab, DFlash / DSpark layers, anchors and Markov
rank; smollm2's for a preset without its own) and the target layers specdraft picks by default.
A token count is steps x max_seq_length x sequences a step: the first rounded so both trainers reach
it in whole steps, the others to multiples of it (bench/versus_runs.py exact_counts).

Every export, and prompt lookup (the baseline), is measured on the preset's held-out prompts by
specdraft's decoder (specdraft/decode/measure.py, as bench/acceptance.py): greedy with a chain of
--gamma, greedy with a --tree, and a chain sampled at --temperature. The report gives tau per
family x mode x trainer x token count, the ratio specdraft / speculators with a 95% interval from a
paired bootstrap over the prompts (bench/offline_parts.py tau_ratio), the training runs, and the
settings that differ (versus_settings.DIFFERENCES). It ends with one line of key=value pairs
(bench/summary.py) and writes versus.md and versus.json to --out/<preset>.

Resumable: every finished part (features, a training run, an imported checkpoint, a measured
export) is kept under --out/<preset>/parts and reused by a rerun of the same --out (delete parts/ to
measure again); an interrupted specdraft run resumes from its newest checkpoint slot, an interrupted
speculators run is trained again (it cannot resume on a CPU).
"""

from __future__ import annotations

import json
import sys
import time
from math import gcd
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from bench_cli import assets_parser, parse_measuring, run_or_exit  # noqa: E402
from acceptance_runs import LABELS, slug  # noqa: E402
from bench_out import check_bench_out, mark_bench_out  # noqa: E402
from offline_parts import Assets, Parts, tau_ratio  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from versus_runs import (  # noqa: E402
    Measure,
    exact_counts,
    import_speculators,
    judging_name,
    plan_family,
    set_threads,
    specdraft_tokens_per_step,
    speculators_runs,
    train_specdraft,
    train_speculators,
    write_features,
)
from versus_settings import FAMILIES, NOT_COMPARED, SPECULATORS, differences_table, recipe_digest  # noqa: E402
from tokens_seen import parse_count  # noqa: E402

import speculators_train  # noqa: E402

TRAINERS = ("specdraft", "speculators")
QUICK = dict(preset="tiny", tokens="512,1024,1536", max_prompts=2, max_new_tokens=8, gamma=3, tree="2,2")


def parse_args(argv=None):
    parser = assets_parser(__doc__)
    parser.add_argument("--families", default=",".join(FAMILIES), help="families to compare")
    parser.add_argument("--modes", default=",".join(SPECULATORS), help="defaults, matched, or both")
    parser.add_argument("--tokens", default="16k,64k,256k", help="token counts of the exports (the largest trained)")
    parser.add_argument("--tree", default="3,6,6,6,6", help="tree widths per depth ('' for none)")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled chain's temperature (0: none)")
    return parse_measuring(parser, argv, "runs/bench-versus", QUICK)


def main(argv=None) -> dict:
    return run_or_exit("bench/versus.py", run_bench, parse_args(argv))


def run_bench(args) -> dict:
    started = time.perf_counter()
    set_threads()
    families = [f for f in args.families.split(",") if f]
    for family in families:
        if family not in FAMILIES:
            why = NOT_COMPARED.get(family, f"unknown; choose from {', '.join(FAMILIES)}")
            raise SpecdraftError(f"--families {family}: not compared: {why}")
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(SPECULATORS):
        raise SpecdraftError(f"--modes {args.modes}: choose from {', '.join(SPECULATORS)}")
    requested = [parse_count(c) for c in args.tokens.split(",") if c.strip()]
    out = Path(args.out) / args.preset
    check_bench_out(out)
    mark_bench_out(out, "bench/versus.py")
    assets = Assets(args, out)
    parts = Parts(out)
    print(machine_line(), flush=True)
    print(f"[bench] target {assets.target}, data {assets.data}", flush=True)
    plans, features, counts = plan_runs(args, assets, parts, families, modes, requested)
    runs = train_runs(assets, parts, out, plans, features, counts, modes)
    lookup, taus = measure_runs(args, assets, parts, runs, counts)
    shapes = list(lookup)

    # -- report ----------------------------------------------------------------------------------
    ratios = {
        (f, m, c, s): tau_ratio(taus[f, m, "specdraft", c][s], taus[f, m, "speculators", c][s])
        for (f, m) in runs
        for c in counts
        for s in shapes
    }
    text, headline = report(args, assets, plans, features, counts, runs, taus, lookup, ratios, shapes, parts)
    total = time.perf_counter() - started
    text += f"\n\nbench wall time {total:.0f}s"
    print(text)
    print(" ".join(headline))
    results = dict(
        counts=counts,
        plans={f: vars(p) for f, p in plans.items()},
        features=features,
        runs={f"{f}/{m}": r for (f, m), r in runs.items()},
        tau={"/".join(map(str, k)): v for k, v in taus.items()},
        lookup=lookup,
        ratios={"/".join(map(str, k)): v for k, v in ratios.items()},
        reused=parts.reused,
        headline=headline,
        wall_seconds=total,
    )
    (out / "versus.json").write_text(json.dumps(results, indent=2))
    (out / "versus.md").write_text(text + "\n" + " ".join(headline) + "\n")
    return results


def plan_runs(args, assets, parts, families, modes, requested):
    """What each family trains on (its features written once, DFlash and DSpark sharing theirs),
    and the token counts every run reaches in whole steps: (plans, features, counts)."""
    plans = {f: plan_family(f, assets.target, args.preset) for f in families}
    written = {}  # features name -> summary: DFlash and DSpark read the same layers
    for plan in plans.values():
        if plan.features_name not in written:
            written[plan.features_name] = parts.get(plan.features_name, lambda: write_features(assets, plan))
    features = {f: written[plans[f].features_name] for f in families}
    per_step = {plans[f].seq_len for f in families}  # speculators: one packed sequence a step
    per_step |= {specdraft_tokens_per_step(assets, plans[f], m, features[f]) for f in families for m in modes}
    counts = exact_counts(requested, sorted(per_step))
    print(f"[bench] token counts {counts} (multiples of the first, in whole steps of every trainer)", flush=True)

    return plans, features, counts


def train_runs(assets, parts, out, plans, features, counts, modes) -> dict:
    """specdraft once per family x mode (an export at each count), speculators once per count:
    (family, mode) -> {"specdraft": part, "speculators": {count: part}}."""
    runs = {}
    counted = {}  # features name -> speculators' batches of each epoch
    for family in plans:
        plan, feat = plans[family], features[family]
        top = counts[-1] // plan.seq_len
        if plan.features_name not in counted:
            counted[plan.features_name] = parts.get(
                f"batches-{plan.features_name}-s{top}",
                lambda: speculators_train.epoch_batches(feat["path"], plan.seq_len, feat["train_data_ratio"], top),
            )
        batches = counted[plan.features_name]
        for mode in modes:
            window = specdraft_tokens_per_step(assets, plan, mode, feat)
            steps = [count // window for count in counts]  # exact: every count is a multiple of it
            name = f"{family}-{mode}-{recipe_digest(family, mode)}-specdraft-s{steps[-1]}e{gcd(*steps)}"
            ours = parts.get(
                name, lambda: train_specdraft(assets, plan, mode, feat, counts, steps, out / "runs" / name)
            )
            theirs = speculators_runs(assets, plan, mode, feat, counts, batches)
            train_speculators(
                [r for r in theirs if not (parts.dir / f"{r.name}.json").is_file()], out / "runs" / "logs"
            )
            runs[family, mode] = dict(
                specdraft=dict(ours, name=name),
                speculators={
                    r.count: parts.get(r.name, lambda r=r: import_speculators(assets, plan, r)) for r in theirs
                },
            )
            print(f"[bench] {LABELS[family]} {mode}: trained", flush=True)

    return runs


def measure_runs(args, assets, parts, runs, counts):
    """Every export and prompt lookup on the same prompts and decoder: (lookup, taus), taus keyed
    (family, mode, trainer, count) -> {shape: {tau, lossless, per_prompt}}."""
    measure = None

    def measured(export):
        nonlocal measure
        measure = measure or Measure(assets)
        return measure.taus(export)

    judging = judging_name(args)
    lookup = parts.get(f"tau-lookup-{judging}", lambda: measured(None))
    taus = {}
    for (family, mode), trained in runs.items():
        for count in counts:
            ours, theirs = trained["specdraft"], trained["speculators"][count]
            exports = {  # trainer -> (a name for the export, its path)
                "specdraft": (f"{ours['name']}-{Path(ours['exports'][str(count)]).name}", ours["exports"][str(count)]),
                "speculators": (theirs["name"], theirs["export"]),
            }
            for trainer, (name, export) in exports.items():
                taus[family, mode, trainer, count] = parts.get(
                    f"tau-{name}-{judging}", lambda export=export: measured(export)
                )
    return lookup, taus


def report(args, assets, plans, features, counts, runs, taus, lookup, ratios, shapes, parts):
    lines = [machine_line(), ""]
    shape_words = {
        "chain": f"greedy, chain γ={args.gamma}",
        "tree": f"greedy, tree {args.tree}",
        **{s: f"sampled at T={s[1:]}, chain γ={args.gamma}" for s in shapes if s.startswith("T")},
    }
    lines.append(
        f"target {assets.target}; {len(lookup['chain']['per_prompt'])} held-out prompts x {args.max_new_tokens} new "
        f"tokens ({assets.prompts}); data {assets.data}"
    )
    for family, plan in plans.items():
        feat = features[family]
        vocab = "the whole target vocab" if plan.draft_vocab_size is None else f"draft vocab {plan.draft_vocab_size}"
        shape = ", ".join(f"{k} {v}" for k, v in plan.shape.items()) or "the trainers' own"
        lines.append(
            f"{LABELS[family]}: {feat['rows']} rows, {feat['tokens']:,} tokens ({feat['loss_tokens']:,} trained), "
            f"max_seq_length {plan.seq_len}, target layers {plan.layers}, {vocab}, shape: {shape}"
        )
    header = "| family | mode | trainer | " + " | ".join(f"{c:,} tokens" for c in counts) + " |"
    rule = "|---|---|---|" + "---|" * len(counts)
    for shape in shapes:
        lines += ["", f"τ, {shape_words[shape]}:", "", header, rule]
        for family, mode in runs:
            for trainer in TRAINERS:
                cells = []
                for c in counts:
                    r = taus[family, mode, trainer, c][shape]
                    cells.append(f"{r['tau']:.3f}" + ("" if r["lossless"] in (None, True) else " (NOT lossless)"))
                lines.append(f"| {LABELS[family]} | {mode} | {trainer} | " + " | ".join(cells) + " |")
        lines.append("| prompt lookup | - | - | " + " | ".join(f"{lookup[shape]['tau']:.3f}" for _ in counts) + " |")
    lines += [
        "",
        "τ specdraft / speculators on the same prompts, with a 95% interval from a paired bootstrap over the prompts:",
        "",
        "| family | mode | measured | " + " | ".join(f"{c:,} tokens" for c in counts) + " |",
        rule,
    ]
    for family, mode in runs:
        for shape in shapes:
            cells = [
                f"{r['ratio']:.3f} ({r['low']:.3f}–{r['high']:.3f})"
                for r in (ratios[family, mode, c, shape] for c in counts)
            ]
            lines.append(f"| {LABELS[family]} | {mode} | {shape_words[shape]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "training (seconds of each run on this machine; speculators trains a run per count, each the "
        "first steps of the largest one's schedule):",
        "",
        "| family | mode | trainer | tokens a step | steps | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for (family, mode), r in runs.items():
        ours, theirs = r["specdraft"], r["speculators"]
        resumed = f" (resumed from {ours['resumed_from']})" if ours.get("resumed_from") else ""
        lines.append(
            f"| {LABELS[family]} | {mode} | specdraft | {ours['tokens_per_step']} | "
            f"{', '.join(map(str, ours['steps']))} | {ours['seconds']:.0f}{resumed} |"
        )
        lines.append(
            f"| {LABELS[family]} | {mode} | speculators | {plans[family].seq_len} | "
            f"{', '.join(str(theirs[c]['steps']) for c in counts)} (in {theirs[counts[-1]]['epochs']} epochs) | "
            + " + ".join(f"{theirs[c]['seconds']:.0f}" for c in counts)
            + " |"
        )
    for family in plans:
        lines += ["", f"{LABELS[family]}: the settings that differ (bench/versus_settings.py):", ""]
        lines += differences_table(family)
    others = {f: why for f, why in NOT_COMPARED.items() if f not in plans}
    lines += [""] + [f"{LABELS.get(f, f)}: not compared: {why}" for f, why in others.items()]
    if parts.reused:  # their names are in versus.json
        lines.append(
            f"\nreused from an earlier run of this --out: {len(parts.reused)} of {len(list(parts.dir.glob('*.json')))} parts"
        )

    top = counts[-1]
    headline = [f"tau_lookup_{slug(s)}={lookup[s]['tau']:.3f}" for s in shapes]
    for family, mode in runs:
        for trainer in TRAINERS:
            headline.append(f"tau_{family}_{mode}_{trainer}={taus[family, mode, trainer, top]['chain']['tau']:.3f}")
        headline += [f"ratio_{family}_{mode}_{slug(s)}={ratios[family, mode, top, s]['ratio']:.3f}" for s in shapes]
    return "\n".join(lines), headline


if __name__ == "__main__":
    main()
