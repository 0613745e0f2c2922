"""Acceptance benchmark: GLIDE and EAGLE-3 trained on the demo target with the same data and
steps, against prompt lookup (no model).

    python bench/acceptance.py                      # demo preset (builds it the first time)
    python bench/acceptance.py --preset tiny        # a quick run
    python bench/acceptance.py --draft GLIDE=runs/glide --draft EAGLE-3=runs/e3   # existing runs / exports

Every number comes from this one run: tau, acceptance per position and tokens/s of each drafter,
chain (gamma) and tree, against plain target decoding of the same prompts measured once here.
Greedy decoding must be token-identical to the target's ("lossless"). Prints a markdown table and
each draft's tau / prompt-lookup tau.
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
from specdraft.drafts.io import load_exported_draft  # noqa: E402

# The families trained here, and the `draft.` keys each gets on top of the shared schedule.
FAMILIES = {"GLIDE": ["draft.type=glide", "draft.sliding_window=128", "draft.max_lag=4"],
            "EAGLE-3": ["draft.type=eagle3"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"], help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--draft", action="append", default=[],
                        help="LABEL=run or export dir of an existing draft (repeatable; default: train GLIDE "
                             "and EAGLE-3 now)")
    parser.add_argument("--data", help="training data glob for the drafts (default: the preset's)")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--ttt-steps", type=int, default=7, help="EAGLE-3's training-time-test unroll")
    parser.add_argument("--gamma", type=int, default=None, help="default: the depth each draft was trained for")
    parser.add_argument("--tree", default="4,16,16,16,16", help="tree widths per depth")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained drafts and results go")
    return parser.parse_args(argv)


def train_draft(target_dir, data_glob, out_dir: Path, steps: int, draft_keys) -> Path:
    """The same data, schedule and seed for every family; only the `draft.` keys differ."""
    from specdraft.config import load_config
    from specdraft.train.loop import train

    cfg = load_config(None, [f"target={target_dir}", f"data_files={data_glob}", f"output_dir={out_dir}",
                             f"max_steps={steps}", "max_seq_length=256", "per_device_batch_size=8",
                             "learning_rate=2e-3", "warmup_steps=20", f"save_steps={steps}",
                             "logging_steps=25", "zero_stage=0", "resume=no", "seed=0", *draft_keys])
    result = train(cfg)
    return Path(result.export_dir)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out) / args.preset
    tree = [int(w) for w in args.tree.split(",")]

    # -- assets: target, prompts, trained drafts -----------------------------------------------
    target_dir, prompts_file, data_glob = args.target, args.prompts, args.data
    if target_dir is None or prompts_file is None or (not args.draft and data_glob is None):
        from specdraft.demo import ensure_demo_assets

        demo_target, demo_data = ensure_demo_assets(preset=args.preset)
        target_dir = target_dir or str(demo_target)
        prompts_file = prompts_file or str(demo_data.prompts_file)
        data_glob = data_glob or str(Path(demo_data.train_files[0]).parent / "train-*.jsonl")
    exports, train_seconds = {}, {}
    if args.draft:
        for item in args.draft:
            label, _, path = item.partition("=")
            exports[label] = resolve_export(path)[0]
    else:
        for label, keys in FAMILIES.items():
            t0 = time.perf_counter()
            extra = [f"draft.ttt_steps={args.ttt_steps}"] if label == "EAGLE-3" else []
            exports[label] = train_draft(target_dir, data_glob, out / label.lower(), args.train_steps, keys + extra)
            train_seconds[label] = time.perf_counter() - t0
            print(f"[bench] trained {label} for {args.train_steps} steps in {train_seconds[label]:.0f}s: "
                  f"{exports[label]}")

    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32")
    tokenizer = load_tokenizer(next(iter(exports.values())), Path(target_dir))
    prompts = read_prompts(prompts_file, tokenizer, args.max_prompts)
    stop = stop_tokens(target, tokenizer)

    # -- one baseline, then every drafter x shape --------------------------------------------
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=stop)
    baseline = run_plain(target, prompts, **settings)
    drafters = {f"{label} (trained)": ("draft", load_exported_draft(path)[0]) for label, path in exports.items()}
    drafters["prompt lookup"] = ("prompt_lookup", None)
    rows = []
    for label, (method, draft) in drafters.items():
        # one γ for every drafter: the trained draft's depth unless asked otherwise
        gamma = args.gamma  # None: each drafter's trained depth
        for shape in (dict(gamma=gamma), dict(tree=tree)):
            report = compare(target, make_drafter(method, target, draft), prompts, baseline=baseline,
                             **shape, **settings)
            rows.append(dict(report, label=label, method=method))

    # -- report --------------------------------------------------------------------------------
    lines = [f"target {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params), "
             f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, temperature {args.temperature}, "
             f"drafts trained {args.train_steps} steps on the same data "
             + ", ".join(f"({label}: {s:.0f}s)" for label, s in train_seconds.items())
             + f", plain decoding {rows[0]['baseline_tokens_per_second']:.1f} tok/s",
             "",
             "| drafter | shape | τ | acceptance per position | tok/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"tree {','.join(map(str, r['tree']))}" if r["tree"] else f"chain γ={r['gamma']}"
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
        lines.append(f"| {r['label']} | {shape} | {r['tau']:.2f} | {acc} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x | {lossless} |")
    by = {(r["label"], bool(r["tree"])): r for r in rows}
    ratios = {}
    lines.append("")
    for label in exports:
        for is_tree, name in ((False, "chain"), (True, "tree")):
            ours, lookup = by[(f"{label} (trained)", is_tree)]["tau"], by[("prompt lookup", is_tree)]["tau"]
            ratios[f"{label} {name}"] = ours / lookup
            lines.append(f"{label} τ ÷ prompt-lookup τ ({name}): {ours:.2f} / {lookup:.2f} = {ours / lookup:.2f}")
    text = "\n".join(lines)
    print(text)
    print(f"tau_ratio_chain={ratios['chain']:.2f} tau_ratio_tree={ratios['tree']:.2f}")
    out.mkdir(parents=True, exist_ok=True)
    results = {"rows": rows, "ratios": ratios, "exports": {k: str(v) for k, v in exports.items()},
               "target": str(target_dir), "train_seconds": train_seconds}
    (out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (out / "acceptance.md").write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
