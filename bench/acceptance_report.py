"""bench/acceptance.py's report: the markdown table of every drafter, the τ ratios, the τ against
tokens seen, and the last line of key=value pairs (bench/summary.py); written beside the runs as
acceptance.md and acceptance.json (and --plot's bar charts)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance_runs import LABELS  # noqa: E402
from bench_out import mark_bench_out  # noqa: E402
from specdraft.decode.report import plot_acceptance  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402

TABLE_HEAD = [
    "| drafter | shape | T | τ | acceptance per position | mean TV | draft fwd / token | proposed / round "
    "| accepted ÷ proposed | tok/s | speedup | lossless |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def report(args, plan, trained, measured, started: float) -> dict:
    """Prints the report and its last line, writes acceptance.md and acceptance.json under the
    bench's --out (and the plot); returns what acceptance.json holds."""
    rows, steps = measured.rows, trained.steps
    lines = [*summary_lines(args, plan, trained, measured), "", *TABLE_HEAD]
    lines += [row_line(r) for r in rows]
    comparisons, headline = compared(args, plan, trained, rows)
    if measured.learning:
        lines += curve_lines(args, plan, trained, measured, headline)
    total = time.perf_counter() - started
    training = sum(trained.train_seconds.values())
    lines += ["", f"bench wall time {total:.0f}s: training {training:.0f}s, the rest {total - training:.0f}s"]
    lines.append("")
    lines += [f"τ {what}: {ours:.2f} / {ref:.2f} = {ours / ref:.2f}" for what, ours, ref in comparisons]
    ratios = {what: ours / ref for what, ours, ref in comparisons}
    text = "\n".join(lines)
    print(text)
    print(" ".join(headline))
    mark_bench_out(plan.out)
    results = {
        "rows": rows,
        "ratios": ratios,
        "answer_quality": dataclasses.asdict(measured.quality),
        "exports": {k: str(v) for k, v in trained.exports.items()},
        "target": str(plan.target_dir),
        "data": plan.data_glob,
        "train_seconds": trained.train_seconds,
        "wall_seconds": total,
        "tokens_seen": {
            label: {str(c): r["tau"] for c, r in reports.items()} for label, reports in measured.learning.items()
        },
        "steps": steps,
    }
    (plan.out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (plan.out / "acceptance.md").write_text(text + "\n")
    if args.plot:
        plot_acceptance([(plot_label(r), r) for r in rows], args.plot)
        print(f"[bench] plot: {args.plot}")
    return results


def summary_lines(args, plan, trained, measured) -> list:
    """The machine, the target, the prompts, how the drafts came about, plain decoding's speed,
    and the target's own answers rated."""
    trained_for = ", ".join(f"{label} {s:.0f}s" for label, s in trained.train_seconds.items())
    return [
        machine_line(),
        f"target {plan.target_dir} ({measured.target_params / 1e6:.1f}M params), "
        f"{measured.prompts} prompts x {args.max_new_tokens} new tokens; "
        + (f"prompts padded to {args.context} tokens with earlier conversations; " if args.context else "")
        + (
            f"drafts trained {trained.steps[-1]} steps on {plan.data_glob} ({trained_for}); "
            if trained_for
            else "drafts: " + ", ".join(f"{label}: {export}" for label, export in trained.exports.items()) + "; "
        )
        + "plain decoding "
        + ", ".join(f"{s:.1f} tok/s at T={t:g}" for t, s in measured.plain_speed.items()),
        f"target's greedy answers: {measured.quality.line()}",
    ]


def row_line(r: dict) -> str:
    """One drafter x shape x temperature of the main table."""
    shape = (
        f"tree {','.join(map(str, r['tree']))}"
        if r["tree"]
        else f"chain γ={r['gamma']}" + (" (its whole block)" if r["whole_block"] else "")
    )
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
    tv = "-" if r.get("mean_tv") is None else f"{r['mean_tv']:.3f}"
    lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
    return (
        f"| {r['label']} | {shape} | {r['temperature']:g} | {r['tau']:.2f} | {acc} | {tv} | "
        f"{r['draft_forwards_per_token']:.2f} | {r['proposed_per_round']:.2f} | "
        f"{r['accepted_per_proposed']:.3f} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x "
        f"| {lossless} |"
    )


def tau_of(rows, gamma):
    """tau(label, temperature, is_tree=False): τ of a drafter's chain γ (or its tree) at a temperature."""

    def tau(label, temperature, is_tree=False):
        return next(
            r["tau"]
            for r in rows
            if r["label"] == label
            and r["temperature"] == temperature
            and bool(r["tree"]) == is_tree
            and r["gamma"] in (gamma, None)
        )

    return tau


def compared(args, plan, trained, rows):
    """The ratios: each draft ÷ prompt lookup (greedy), each GLIDE objective ÷ the first one
    (per T), each confidence stop ÷ no stop; (what, τ, reference τ) each, and the last line's pairs."""
    tau, temperatures, keys, exports = tau_of(rows, args.gamma), plan.temperatures, trained.keys, trained.exports
    comparisons, headline = [], []
    for label in exports:
        headline += [f"tau_{keys[label]}_T{t:g}".replace(".", "") + f"={tau(label, t):.2f}" for t in temperatures]
        if 0.0 in temperatures:
            for is_tree in (False, True)[: 2 if plan.tree else 1]:
                shape = "tree" if is_tree else f"chain γ={args.gamma}"
                comparisons.append(
                    (
                        f"{label} ÷ prompt lookup ({shape}, T=0)",
                        tau(label, 0.0, is_tree),
                        tau("prompt lookup", 0.0, is_tree),
                    )
                )
            headline.append(f"lookup_ratio_{keys[label]}={tau(label, 0.0) / tau('prompt lookup', 0.0):.2f}")
    for family in plan.families if len(plan.objectives) > 1 else []:  # each objective ÷ the family's first
        same_family = [label for label in exports if label.startswith(LABELS[family] + " ")]
        for label in same_family[1:]:
            for t in temperatures:
                ours, ref = tau(label, t), tau(same_family[0], t)
                comparisons.append((f"{label} ÷ {same_family[0]} (chain γ={args.gamma}, T={t:g})", ours, ref))
                headline.append(f"ratio_{keys[label]}_T{t:g}".replace(".", "") + f"={ours / ref:.2f}")
    for label, c in ((label, c) for label in exports for c in plan.thresholds):  # each stop vs no stop
        stopped = f"{label} (stop c={c:g})"
        for t in temperatures if any(r["label"] == stopped for r in rows) else []:
            comparisons.append((f"{stopped} ÷ {label} (chain γ={args.gamma}, T={t:g})", tau(stopped, t), tau(label, t)))
            headline.append(
                f"stop_ratio_{keys[label]}_c{c:g}_T{t:g}".replace(".", "") + f"={tau(stopped, t) / tau(label, t):.2f}"
            )
    return comparisons, headline


def curve_lines(args, plan, trained, measured, headline: list) -> list:
    """The τ against tokens seen table (its pairs added to `headline`); prompt lookup does not
    learn: its greedy chain τ stands beside every count."""
    rows, counts, steps = measured.rows, plan.counts, trained.steps
    lookup = tau_of(rows, args.gamma)("prompt lookup", 0.0) if 0.0 in plan.temperatures else None
    lines = [
        "",
        f"τ against tokens seen (greedy, chain γ={args.gamma}; each family's exports of one run, "
        f"{steps[-1]} steps in all):",
        "",
        "| drafter | " + " | ".join(f"{c:,} tokens ({s} steps)" for c, s in zip(counts, steps)) + " | lossless |",
        "|---|" + "---|" * (len(counts) + 1),
    ]
    for label, reports in measured.learning.items():
        lossless = all(r["matches_target"] for r in reports.values())
        lines.append(
            f"| {label} | "
            + " | ".join(f"{reports[c]['tau']:.2f}" for c in counts)
            + f" | {'yes' if lossless else 'NO'} |"
        )
        headline += [f"curve_{trained.keys[label]}_{c}={reports[c]['tau']:.2f}" for c in counts]
    if lookup is not None:
        same = next(
            r for r in rows if r["label"] == "prompt lookup" and r["temperature"] == 0.0 and r["gamma"] == args.gamma
        )["matches_target"]
        lines.append(
            "| prompt lookup | " + " | ".join(f"{lookup:.2f}" for _ in counts) + f" | {'yes' if same else 'NO'} |"
        )
    return lines


def plot_label(r: dict) -> str:
    return f"{r['label']}, {'tree' if r['tree'] else 'γ=' + str(r['gamma'])}, T={r['temperature']:g}"
