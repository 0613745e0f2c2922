"""Offline training from a feature cache against the same training with the target live, per family.

    python bench/offline.py                        # the tiny target, every family it has (~6 minutes)
    python bench/offline.py --preset demo --families glide,eagle3,dflash --tau-family ""
                                                   # the demo target: capture, bytes, steps, sha256
    python bench/offline.py --quick                # a few steps: the structure, not the figures
    python bench/offline.py --out runs/bench-offline --families eagle3,glide --epochs 1,2,4,6,8

Every ratio comes from this one run (a part an earlier run of the same --out finished is reused and
named as such: delete --out/<preset>/parts/ to measure everything again). Per family:

  capture     `specdraft capture` in fp32, bf16, fp8 (token) and fp8 (token_layer): tokens/s
              (wall of the whole command: data, target load, target passes, encode, sha256,
              write), and bytes per token read from the manifest's shards, against speculators'
              bf16 layout `(n_aux+1)*H*2+8` (its 3 auxiliary layers + last hidden, int64 ids) at the
              target's H: what storing only what the family reads saves
  step        the same run live and from the (bf16) cache, --steps steps each: per step, the
              draft's own forward+backward+step on features already in memory, and the cached
              step (read + assemble + that); medians over the steps after --warmup
              -> cached step / draft fwd+bwd (goal <= 1.1), online step / cached step
  sha256      each shard of the family's bf16 cache hashed again, page cache warm and cold (its
              pages evicted by posix_fadvise first): MB/s, and the open of a ShardReader with and
              without the check (and with it, cold)

and for --tau-family (EAGLE-3 by default), every draft trained on the same rows, seed and steps
(equal tokens) then measured greedy with a chain of --gamma by the code bench/acceptance.py uses
(specdraft/decode/measure.py compare): tau live vs from the fp32 / bf16 / fp8 caches (fp8 goal:
within 1% of bf16), and tau against epochs over one fixed bf16 cache (DeepSpec #84: EAGLE-3 from a
fixed cache peaked near 4.6 epochs). Ends with one line of key=value pairs (bench/summary.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from acceptance_runs import CONFIGS, LABELS, slug  # noqa: E402
from bench_cli import run_or_exit  # noqa: E402
from bench_out import check_bench_out, mark_bench_out  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402
from specdraft.demo.presets import PRESETS  # noqa: E402
from offline_parts import (  # noqa: E402
    cannot_draft,
    tau_ratio,
    PRECISIONS,
    QUICK,
    SPECULATORS_AUX,
    Parts,
    Assets,
    run_capture,
    hidden_size,
    preset_batch,
    time_steps,
    verify_cost,
    steps_per_epoch,
    train_export,
    Judge,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="demo assets to use (default tiny: minutes on 2 cores)",
    )
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--data", help="training data glob (default: the preset's demo data)")
    parser.add_argument("--families", default="glide,eagle3,peagle,dflash,dspark", help="families to measure")
    parser.add_argument("--tau-family", default="eagle3", help="the family whose tau is measured ('' for none)")
    parser.add_argument(
        "--set",
        dest="shared",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run key every run takes (repeatable)",
    )
    parser.add_argument(
        "--batch", type=int, help="per_device_batch_size of every run (default: the preset's CPU budget, else 2)"
    )
    parser.add_argument("--steps", type=int, default=20, help="steps of each timed run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of a timed run left out")
    parser.add_argument("--train-steps", type=int, default=60, help="steps of each tau run (equal tokens)")
    parser.add_argument(
        "--epochs", default="1,2,3,4,5,6,8,12,16", help="epochs over one cache at which tau is measured"
    )
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--max-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a few steps of everything (tests)")
    parser.add_argument("--out", default="runs/bench-offline", help="runs, caches and finished parts")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.batch is None:
        args.batch = preset_batch(args.preset, default=2)
    return args


# -- parts: each finished measurement kept in --out, reused by a later run -----------------------


def main(argv=None) -> dict:
    return run_or_exit("bench/offline.py", run_bench, parse_args(argv))


def run_bench(args) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(CONFIGS))
    if unknown:
        sys.exit(f"--families: unknown {unknown}; choose from {sorted(CONFIGS)}")
    epochs = sorted({float(e) for e in args.epochs.split(",") if e.strip()})
    out = Path(args.out) / args.preset
    check_bench_out(out)
    mark_bench_out(out, "bench/offline.py")
    assets = Assets(args, out)
    skipped = {f: why for f in families if (why := cannot_draft(f, assets.target))}
    families = [f for f in families if f not in skipped]
    parts = Parts(out)
    print(machine_line(), flush=True)
    print(f"[bench] target {assets.target}, data {assets.data}", flush=True)
    captures, timing, verify = measure_storage(args, assets, parts, families)
    tau_family = args.tau_family if args.tau_family in families else None
    taus, curve, per_epoch = measure_tau(args, assets, parts, tau_family, epochs) if tau_family else ({}, {}, None)

    # -- report ---------------------------------------------------------------------------------
    H = hidden_size(assets.target)
    speculators = (SPECULATORS_AUX + 1) * H * 2 + 8
    headline = []
    lines = [machine_line(), ""]
    lines += storage_lines(args, assets.target, families, captures, H, speculators, headline)
    lines += step_lines(families, timing, verify, headline)
    ratios = {}
    if tau_family:
        ratios = tau_ratios(taus)
        lines += tau_lines(args, tau_family, taus, ratios, headline)
    if curve:
        lines += epoch_lines(curve, per_epoch, headline)
    for family, why in skipped.items():
        lines.append(f"\n{LABELS[family]}: not measured: {why}")
    if parts.reused:
        lines.append(f"\nreused from an earlier run of this --out: {', '.join(parts.reused)}")
    total = time.perf_counter() - started
    lines.append(f"\nbench wall time {total:.0f}s")
    text = "\n".join(lines)
    print(text)
    print(" ".join(headline))
    results = dict(
        captures=captures,
        timing=timing,
        verify=verify,
        tau=taus,
        tau_ratios=ratios,
        epochs=curve,
        steps_per_epoch=per_epoch,
        speculators_bytes_per_token=speculators,
        hidden_size=H,
        skipped=skipped,
        reused=parts.reused,
        headline=headline,
        wall_seconds=total,
    )
    (out / "offline.json").write_text(json.dumps(results, indent=2))
    (out / "offline.md").write_text(text + "\n" + " ".join(headline) + "\n")
    return results


def measure_storage(args, assets, parts, families):
    """Per family: its captures at every precision, its steps live and cached, and the sha256
    checks of its bf16 cache; (captures, timing, verify), each family -> its part."""
    captures: Dict[str, Dict[str, dict]] = {}
    timing, verify = {}, {}
    for family in families:
        captures[family] = {}
        for precision in PRECISIONS:
            captures[family][precision] = parts.get(
                f"capture-{family}-{precision}-b{args.batch}", lambda: run_capture(assets, family, precision)
            )
        print(f"[bench] {family}: captured {captures[family]['bf16']['tokens']:,} tokens", flush=True)
        timing[family] = parts.get(
            f"time-{family}-s{args.steps}w{args.warmup}b{args.batch}", lambda: time_steps(assets, family)
        )
        verify[family] = parts.get(f"sha256-cold-{family}", lambda: verify_cost(assets, family))
    return captures, timing, verify


def measure_tau(args, assets, parts, tau_family, epochs):
    """--tau-family trained live and from each cache for --train-steps, then over one bf16 cache to
    each of --epochs, every export judged on the same prompts: (taus, curve, steps an epoch)."""
    judge = None

    def judged(export):
        nonlocal judge
        judge = judge or Judge(assets)
        return judge.tau(export)

    steps = args.train_steps
    # a part measured with other settings is not reused: they are in its name
    judging = f"g{args.gamma}-p{args.max_prompts}x{args.max_new_tokens}-b{args.batch}-per-prompt"

    def trained_and_judged(mode, extra):
        export, loss = train_export(assets, tau_family, f"tau-{tau_family}-{mode}", steps, *extra)
        return dict(judged(export), steps=steps, loss=loss)

    taus, curve = {}, {}
    for mode in ["online", *PRECISIONS]:
        extra = [] if mode == "online" else assets.cache(tau_family, mode)
        taus[mode] = parts.get(f"tau-{tau_family}-{mode}-s{steps}-{judging}", lambda: trained_and_judged(mode, extra))
    per_epoch = steps_per_epoch(assets, tau_family) if epochs else None
    points = {e: max(1, round(e * per_epoch)) for e in epochs}

    def epoch_curve():
        from math import gcd

        every = gcd(*points.values())
        run, _ = train_export(
            assets,
            tau_family,
            f"epochs-{tau_family}",
            max(points.values()),
            *assets.cache(tau_family, "bf16"),
            save_steps=every,
        )
        run_dir = Path(run).parent
        return {str(e): dict(judged(str(run_dir / f"step_{s}")), steps=s) for e, s in points.items()}

    if epochs:  # --epochs "": no curve
        curve = parts.get(f"epochs-{tau_family}-{per_epoch}x{args.epochs.replace(',', '_')}-{judging}", epoch_curve)
    return taus, curve, per_epoch


def storage_lines(args, target, families, captures, H: int, speculators: int, headline: list) -> list:
    """The capture table: tokens/s and bytes a token per precision against speculators' layout."""
    lines = [
        f"target {target} (H={H}); {args.batch} sequences a step, packing whole; "
        f"timed runs {args.steps} steps (first {args.warmup} left out)",
        "",
        "| family | kinds stored | capture tok/s (fp32 / bf16) | bytes/token fp32 | bf16 | fp8 token | "
        f"fp8 token_layer | bf16 / speculators' {speculators} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in families:
        c = captures[family]
        ratio = c["bf16"]["bytes_per_token"] / speculators
        lines.append(
            f"| {LABELS[family]} | {', '.join(c['bf16']['kinds'])} | {c['fp32']['tokens_per_second']:,.0f} / "
            f"{c['bf16']['tokens_per_second']:,.0f} | "
            + " | ".join(f"{c[p]['bytes_per_token']:,.0f} ({c[p]['formula_bytes_per_token']:,})" for p in PRECISIONS)
            + f" | {ratio:.2f} |"
        )
        headline += [
            f"capture_tps_{slug(family)}={c['bf16']['tokens_per_second']:.0f}",
            f"bytes_bf16_{slug(family)}={c['bf16']['bytes_per_token']:.0f}",
            f"bytes_vs_speculators_{slug(family)}={ratio:.2f}",
        ]
    return lines


def step_lines(families, timing, verify, headline: list) -> list:
    """The step table (online, cached, the draft alone) and the sha256 checks, per family."""
    lines = [
        "",
        "bytes/token: shard files / tokens (formula: features + int32 id + fp8 scales, no header)",
        "",
        "step medians, CPU seconds of the process (wall seconds in brackets):",
        "",
        "| family | online step | cached step = read + draft fwd/bwd | cached / draft fwd/bwd | "
        "online / cached | sha256 MB/s warm / cold | open checked / unchecked / checked cold s |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in families:
        t, v = timing[family], verify[family]
        on, ca = t["online"], t["cached"]
        lines.append(
            f"| {LABELS[family]} | {on['total_cpu']:.4f} ({on['total']:.4f}) | {ca['total_cpu']:.4f} = "
            f"{ca['read_cpu']:.4f} + {ca['forward_backward_cpu']:.4f} ({ca['total']:.4f} = {ca['read']:.4f} + "
            f"{ca['forward_backward']:.4f}) | {t['cached_over_draft_cpu']:.3f} ({t['cached_over_draft']:.3f}) | "
            f"{t['online_over_cached_cpu']:.2f} ({t['online_over_cached']:.2f}) | "
            f"{v['sha256_mb_per_s']:,.0f} / {v['sha256_cold_mb_per_s']:,.0f} ({v['bytes'] / 1e6:.1f} MB) | "
            f"{v['open_verified_seconds']:.4f} / {v['open_unverified_seconds']:.4f} / "
            f"{v['open_verified_cold_seconds']:.4f} |"
        )
        headline += [
            f"cached_over_draft_{slug(family)}={t['cached_over_draft_cpu']:.3f}",
            f"online_over_cached_{slug(family)}={t['online_over_cached_cpu']:.2f}",
        ]
    if verify:
        headline.append(f"sha256_mbps={min(v['sha256_mb_per_s'] for v in verify.values()):.0f}")
        headline.append(f"sha256_cold_mbps={min(v['sha256_cold_mb_per_s'] for v in verify.values()):.0f}")
    return lines


def tau_ratios(taus: dict) -> dict:
    """Each cache's τ against the live target's (fp32, bf16) and fp8's against bf16."""
    return {
        "offline_over_online": tau_ratio(taus["fp32"], taus["online"]),
        "bf16_over_online": tau_ratio(taus["bf16"], taus["online"]),
        "fp8_token_over_bf16": tau_ratio(taus["fp8_token"], taus["bf16"]),
        "fp8_token_layer_over_bf16": tau_ratio(taus["fp8_token_layer"], taus["bf16"]),
    }


def tau_lines(args, tau_family, taus, ratios, headline: list) -> list:
    """--tau-family's τ per way of training it, then the ratios with their intervals."""
    label = LABELS[tau_family]
    lines = [
        "",
        f"{label}, {args.train_steps} steps each (equal tokens, same rows and seed), greedy chain "
        f"γ={args.gamma}, {args.max_prompts} prompts x {args.max_new_tokens} tokens:",
        "",
        "| training | last loss | τ | lossless |",
        "|---|---|---|---|",
    ]
    for mode, r in taus.items():
        lines.append(
            f"| {'live target' if mode == 'online' else 'cache ' + mode} | {r['loss']:.4f} | {r['tau']:.3f} | "
            f"{'yes' if r['lossless'] else 'NO'} |"
        )
    lines += [
        "",
        "τ ratios on the same prompts, with a 95% interval from a paired bootstrap over the prompts:",
        "",
        "| ratio | value | 95% interval |",
        "|---|---|---|",
    ]
    for name, r in ratios.items():
        lines.append(f"| {name.replace('_', ' ')} | {r['ratio']:.3f} | {r['low']:.3f}–{r['high']:.3f} |")
    headline += [f"tau_{name}={r['ratio']:.3f}" for name, r in ratios.items()]
    return lines


def epoch_lines(curve, per_epoch, headline: list) -> list:
    """τ against epochs over one bf16 cache, and the epochs at its peak."""
    lines = [
        "",
        f"τ against epochs over one bf16 cache ({per_epoch} steps an epoch; one run, its cosine schedule "
        f"ending at the last point, an export at each):",
        "",
        "| epochs | steps | τ |",
        "|---|---|---|",
    ]
    lines += [f"| {e} | {r['steps']} | {r['tau']:.3f} |" for e, r in curve.items()]
    peak = max(curve, key=lambda e: curve[e]["tau"])
    headline.append(f"tau_peak_epochs={float(peak):g}")
    return lines


if __name__ == "__main__":
    main()
