"""Acceptance under sampling: one GLIDE per training objective (distillation, issue 13), greedy and
sampled.

    python bench/acceptance.py                      # demo preset (builds it the first time)
    python bench/acceptance.py --preset tiny        # a quick run
    python bench/acceptance.py --draft runs/glide   # an existing run / export instead of training
    python bench/acceptance.py --objectives "ce" "0.9*tv + 0.1*ce@0.7"   # one GLIDE per objective

Every number comes from this one run: tau, acceptance per position, mean TV(target p, draft q)
over the checked chain positions, and tokens/s of each drafter, chain (gamma) and tree, at each
temperature (default 0 and 0.7), against plain target decoding of the same prompts at that
temperature measured once here. Prints a markdown table, the ratio GLIDE tau / prompt-lookup tau
(greedy; the goal is >= 2) and, with several objectives, each one's tau / the first one's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdraft.decode.evaluate import (compare, load_tokenizer, make_drafter, read_prompts,  # noqa: E402
                                       resolve_export, run_plain, stop_tokens)
from specdraft.drafts import draft_from_export_config  # noqa: E402
from specdraft.drafts.io import load_exported_draft, read_export_config  # noqa: E402
from specdraft.drafts.objectives import parse_objective  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"], help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--draft", help="run or export dir of a GLIDE draft (default: train one now)")
    parser.add_argument("--data", help="training data glob for the draft (default: the preset's)")
    parser.add_argument("--objectives", nargs="+", default=["ce"],
                        help="train one GLIDE per objective, 'SPEC[@T]': a draft.loss value and its "
                             "draft.distill_temperature, e.g. ce '0.9*tv + 0.1*ce@0.7'")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tree", default="4,16,16,16,16", help="tree widths per depth ('' for chains only)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated sampling temperatures")
    parser.add_argument("--no-untrained", action="store_true", help="leave out the untrained GLIDE rows")
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained drafts and results go")
    return parser.parse_args(argv)


def split_objective(text: str):
    """'0.9*tv + 0.1*ce@0.7' -> (draft.loss, draft.distill_temperature); validated like the config."""
    spec, _, temperature = text.partition("@")
    objective = parse_objective(spec, float(temperature or 1.0), where=f"--objectives {text!r}")
    return spec.strip(), objective.temperature, str(objective)


def train_glide(target_dir, data_glob, out_dir: Path, steps: int, loss: str = "ce",
                distill_temperature: float = 1.0) -> Path:
    from specdraft.config import load_config
    from specdraft.train.loop import train

    cfg = load_config(None, [f"target={target_dir}", f"data_files={data_glob}", f"output_dir={out_dir}",
                             f"max_steps={steps}", "max_seq_length=256", "per_device_batch_size=8",
                             "learning_rate=2e-3", "warmup_steps=20", f"save_steps={steps}",
                             "logging_steps=25", "zero_stage=0", "resume=no", "seed=0",
                             "draft.sliding_window=128", "draft.max_lag=4", f"draft.loss={loss}",
                             f"draft.distill_temperature={distill_temperature}"])
    result = train(cfg)
    return Path(result.export_dir)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out) / args.preset
    tree = [int(w) for w in args.tree.split(",")] if args.tree else None
    temperatures = [float(t) for t in args.temperatures.split(",")]
    objectives = [split_objective(text) for text in args.objectives]

    # -- assets: target, prompts, trained drafts ------------------------------------------------
    target_dir, prompts_file, data_glob = args.target, args.prompts, args.data
    if target_dir is None or prompts_file is None or (args.draft is None and data_glob is None):
        from specdraft.demo import ensure_demo_assets

        demo_target, demo_data = ensure_demo_assets(preset=args.preset)
        target_dir = target_dir or str(demo_target)
        prompts_file = prompts_file or str(demo_data.prompts_file)
        data_glob = data_glob or str(Path(demo_data.train_files[0]).parent / "train-*.jsonl")
    exports = {}  # label -> export dir
    if args.draft is None:
        for i, (loss, distill_temperature, label) in enumerate(objectives):
            t0 = time.perf_counter()
            export_dir = train_glide(target_dir, data_glob, out / f"glide-{i}", args.train_steps, loss,
                                     distill_temperature)
            print(f"[bench] trained GLIDE ({label}) for {args.train_steps} steps in "
                  f"{time.perf_counter() - t0:.0f}s: {export_dir}")
            exports[f"GLIDE {label}" if len(objectives) > 1 else "GLIDE (trained)"] = export_dir
    else:
        exports["GLIDE (trained)"], _ = resolve_export(args.draft)
    first_export = next(iter(exports.values()))

    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32")
    tokenizer = load_tokenizer(first_export, Path(target_dir))
    prompts = read_prompts(prompts_file, tokenizer, args.max_prompts)
    stop = stop_tokens(target, tokenizer)
    drafters = {label: ("draft", load_exported_draft(export)[0]) for label, export in exports.items()}
    drafters["prompt lookup"] = ("prompt_lookup", None)
    if not args.no_untrained:
        drafters["GLIDE (untrained)"] = ("untrained", draft_from_export_config(read_export_config(first_export)).eval())
    shapes = [dict(gamma=args.gamma)] + ([dict(tree=tree)] if tree else [])

    # -- per temperature: one baseline, then every drafter x shape -------------------------------
    rows, baselines = [], {}
    for temperature in temperatures:
        settings = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, stop=stop)
        baseline = run_plain(target, prompts, **settings)
        baselines[temperature] = baseline
        for label, (method, draft) in drafters.items():
            for shape in shapes:
                report = compare(target, make_drafter(method, target, draft), prompts, baseline=baseline,
                                 record_tv="gamma" in shape, **shape, **settings)
                rows.append(dict(report, label=label, method=method))

    # -- report --------------------------------------------------------------------------------
    lines = [f"target {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params), "
             f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, drafts "
             + ", ".join(f"{label}: {export}" for label, export in exports.items()),
             "",
             "| drafter | shape | T | τ | acceptance per position | mean TV | tok/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"tree {','.join(map(str, r['tree']))}" if r["tree"] else f"chain γ={r['gamma']}"
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        tv = "-" if r.get("mean_tv") is None else f"{r['mean_tv']:.3f}"
        lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
        lines.append(f"| {r['label']} | {shape} | {r['temperature']:g} | {r['tau']:.2f} | {acc} | {tv} | "
                     f"{r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {lossless} |")
    by = {(r["label"], bool(r["tree"]), r["temperature"]): r for r in rows}
    first_label = next(iter(exports))
    ratios = {}
    lines.append("")
    if 0.0 in temperatures:
        for is_tree, name in ((False, "chain"), (True, "tree")):
            if (first_label, is_tree, 0.0) not in by:
                continue
            glide, lookup = by[(first_label, is_tree, 0.0)]["tau"], by[("prompt lookup", is_tree, 0.0)]["tau"]
            ratios[name] = glide / lookup
            lines.append(f"{first_label} τ ÷ prompt-lookup τ ({name}, greedy): {glide:.2f} / {lookup:.2f} = "
                         f"{glide / lookup:.2f}  (goal >= 2: {'met' if glide / lookup >= 2 else 'NOT met'})")
    for label in list(exports)[1:]:
        for temperature in temperatures:
            base, other = by[(first_label, False, temperature)]["tau"], by[(label, False, temperature)]["tau"]
            ratios[f"{label} / {first_label} T={temperature:g}"] = other / base
            lines.append(f"{label} τ ÷ {first_label} τ (chain γ={args.gamma}, T={temperature:g}): "
                         f"{other:.2f} / {base:.2f} = {other / base:.2f}")
    text = "\n".join(lines)
    print(text)
    # the machine-readable last line (bench/summary.py): greedy GLIDE / lookup, then each objective / the first
    headline = [f"tau_ratio_{name}={ratios[name]:.2f}" for name in ("chain", "tree") if name in ratios]
    for i, label in enumerate(list(exports)[1:], start=1):
        for t in temperatures:
            ratio = by[(label, False, t)]["tau"] / by[(first_label, False, t)]["tau"]
            key = f"tau_ratio_objective{i}_T{t:g}".replace(".", "")  # T0.7 -> T07
            headline.append(f"{key}={ratio:.2f}")
    print(" ".join(headline))
    out.mkdir(parents=True, exist_ok=True)
    results = {"rows": rows, "ratios": ratios, "exports": {k: str(v) for k, v in exports.items()},
               "target": str(target_dir)}
    (out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (out / "acceptance.md").write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
