"""Acceptance statistics of speculative runs: the report dict, its terminal table, its plot.

tau = (accepted draft tokens + target forwards) / target forwards: the mean number of tokens each
verification pass produces (the prefill pass is not counted).
acceptance_per_position[j-1]: the fraction of passes that accepted at least j draft tokens.
mean_tv (when recorded, chains): TV(target p, draft q) averaged over the positions the target
checked; 1 - mean_tv is the acceptance rate speculative sampling expects there.
conditional_acceptance_per_position[j-1]: of the passes that accepted j - 1, the fraction that
also accepted the j-th (the usual per-position acceptance rate).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from specdraft.decode.speculative import Generation
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import PLOT_SOFTWARE


def acceptance_stats(generations: Sequence[Generation], depth: int) -> Dict[str, Any]:
    """Pool the verification passes of several generations; depth = gamma or len(tree)."""
    accepted: List[int] = [a for g in generations for a in g.accepted]
    forwards = len(accepted)
    drafted = sum(d for g in generations for d in g.drafted)
    reached = [sum(a >= j for a in accepted) for j in range(depth + 1)]  # reached[0] = forwards
    return {
        "tau": (sum(accepted) + forwards) / forwards if forwards else 0.0,
        "target_forwards": forwards,
        "accepted_tokens": sum(accepted),
        "drafted_tokens": drafted,
        # per verification round: tokens proposed, and the share of them the target kept
        "proposed_per_round": drafted / forwards if forwards else 0.0,
        "accepted_per_proposed": sum(accepted) / drafted if drafted else 0.0,
        "acceptance_per_position": [reached[j] / forwards if forwards else 0.0 for j in range(1, depth + 1)],
        "conditional_acceptance_per_position": [
            reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, depth + 1)
        ],
        "accepted_length_histogram": [sum(a == k for a in accepted) for k in range(depth + 1)],
        **tv_stats(generations),
    }


def tv_stats(generations: Sequence[Generation]) -> Dict[str, Any]:
    tv = [t for g in generations for t in g.tv]
    return {"mean_tv": sum(tv) / len(tv) if tv else None, "tv_positions": len(tv)}


def timing_stats(generations: Sequence[Generation], baseline: Optional[Sequence[Generation]]) -> Dict[str, Any]:
    """Tokens per second, and beside the target alone (baseline None: not measured)."""
    tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(g.seconds for g in generations)
    speed = tokens / seconds if seconds else 0.0
    if baseline is None:
        return {
            "generated_tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": speed,
            "baseline_tokens_per_second": None,
            "speedup": None,
        }
    base_tokens = sum(len(g.tokens) for g in baseline)
    base_seconds = sum(g.seconds for g in baseline)
    base_speed = base_tokens / base_seconds if base_seconds else 0.0
    return {
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": speed,
        "baseline_tokens_per_second": base_speed,
        "speedup": speed / base_speed if base_speed else 0.0,
    }


def format_report(report: Dict[str, Any]) -> str:
    """The terminal table of one evaluation report."""
    shape = f"tree {report['tree']}" if report.get("tree") else f"chain gamma={report.get('gamma')}"
    lines = [
        f"specdraft eval: {report.get('method')} ({report.get('drafter')}), {shape}, "
        f"temperature {report.get('temperature')}, {report.get('prompts')} prompts, "
        f"max {report.get('max_new_tokens')} new tokens",
        f"  draft:  {report.get('draft') or '-'}",
        f"  target: {report.get('target')}",
        "",
        f"  {'tau (tokens / target forward)':<34}{report['tau']:>10.3f}",
        f"  {'target forwards':<34}{report['target_forwards']:>10d}",
        f"  {'accepted draft tokens':<34}{report['accepted_tokens']:>10d}",
        f"  {'proposed tokens / round':<34}{report['proposed_per_round']:>10.3f}",
        f"  {'accepted / proposed':<34}{report['accepted_per_proposed']:>10.3f}",
        f"  {'generated tokens':<34}{report['generated_tokens']:>10d}",
        f"  {'tokens/s (speculative)':<34}{report['tokens_per_second']:>10.1f}",
    ]
    if report.get("speedup") is None:
        lines.append(f"  {'speedup':<34}{'not measured (--no-baseline)':>10}")
    else:
        lines += [
            f"  {'tokens/s (target alone)':<34}{report['baseline_tokens_per_second']:>10.1f}",
            f"  {'speedup':<34}{report['speedup']:>9.2f}x",
        ]
    if report.get("mean_tv") is not None:
        lines.append(f"  {'mean TV(p, q), checked positions':<34}{report['mean_tv']:>10.3f}")
    if report.get("matches_target") is not None:
        lines.append(f"  {'output == target greedy':<34}{'yes' if report['matches_target'] else 'NO':>10}")
    lines += ["", f"  {'position':>8}  {'P(accepted >= pos)':>18}  {'P(pos | pos-1)':>14}"]
    for j, (a, c) in enumerate(
        zip(report["acceptance_per_position"], report["conditional_acceptance_per_position"]), start=1
    ):
        lines.append(f"  {j:>8}  {a:>18.3f}  {c:>14.3f}")
    if report.get("plot"):
        lines += ["", f"  plot: {report['plot']}"]
    return "\n".join(lines)


def format_comparison(reports: Dict[str, Dict[str, Any]]) -> str:
    """Several drafts' reports (by name) side by side: one row per draft."""
    first = next(iter(reports.values()))
    lines = [
        f"specdraft eval: {len(reports)} drafts, temperature {first.get('temperature')}, "
        f"{first.get('prompts')} prompts, max {first.get('max_new_tokens')} new tokens",
        f"  target: {first.get('target')}",
        "",
        f"  {'draft':<16}{'drafter':<22}{'shape':<18}{'tau':>8}{'accepted/proposed':>19}{'speedup':>9}",
    ]
    for name, report in reports.items():
        shape = f"tree {report['tree']}" if report.get("tree") else f"gamma={report.get('gamma')}"
        lines.append(
            f"  {name:<16}{str(report.get('drafter')):<22}{shape:<18}{report['tau']:>8.3f}"
            f"{report['accepted_per_proposed']:>19.3f}"
            + (f"{'-':>9}" if report.get("speedup") is None else f"{report['speedup']:>8.2f}x")
        )
    return "\n".join(lines)


def require_matplotlib(flag: str = "--plot") -> None:
    """A plot asked for without matplotlib (an optional extra): one line, before any work is done."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecdraftError(f"{flag}: matplotlib is not installed; pip install specdraft[plots]") from None


def acceptance_figure(reports: Sequence[Tuple[str, Dict[str, Any]]], title: Optional[str] = None):
    """Two bar charts of (label, report) pairs: acceptance per draft position of each drafter
    (P(accepted length >= position)), and each drafter's tau beside the target alone (1)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_position, by_drafter) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(reports)
    depth = max(len(report["acceptance_per_position"]) for _, report in reports)
    for i, (label, report) in enumerate(reports):
        acceptance = report["acceptance_per_position"]
        by_position.bar(
            [j + 1 - 0.4 + width * (i + 0.5) for j in range(len(acceptance))],
            acceptance,
            width,
            label=label,
            color=f"C{i}",
        )
    by_position.set(
        xlabel="draft position (tree depth)",
        ylabel="P(accepted length >= position)",
        ylim=(0, 1.05),
        xticks=range(1, depth + 1),
    )
    by_position.legend(fontsize=7)
    labels = [label for label, _ in reports] + ["target alone"]
    taus = [report["tau"] for _, report in reports] + [1.0]
    by_drafter.bar(range(len(labels)), taus, color=[f"C{i}" for i in range(len(reports))] + ["grey"])
    by_drafter.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    by_drafter.set_ylabel("tau (tokens per target forward)")
    for x, tau in enumerate(taus):
        by_drafter.text(x, tau, f"{tau:.2f}", ha="center", va="bottom", fontsize=7)
    fig.suptitle(title or "acceptance per draft position, tau per drafter")
    fig.tight_layout()
    return fig


def plot_acceptance(reports: Sequence[Tuple[str, Dict[str, Any]]], path, title: Optional[str] = None) -> None:
    """acceptance_figure as a PNG (matplotlib, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = acceptance_figure(reports, title)
    fig.savefig(path, dpi=100, format="png", metadata={"Software": PLOT_SOFTWARE})  # ours to replace
    plt.close(fig)
