"""Acceptance benchmark: a demo-trained GLIDE draft vs prompt lookup vs an untrained draft.

    python bench/acceptance.py                      # demo preset (builds it the first time)
    python bench/acceptance.py --preset tiny        # a quick run
    python bench/acceptance.py --draft runs/glide   # an existing run / export instead of training

Every number comes from this one run: tau, acceptance per position and tokens/s of each drafter,
chain (gamma) and tree, against plain target decoding of the same prompts measured once here.
Prints a markdown table and the ratio GLIDE tau / prompt-lookup tau (the goal is >= 2).
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"], help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--draft", help="run or export dir of a GLIDE draft (default: train one now)")
    parser.add_argument("--data", help="training data glob for the draft (default: the preset's)")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--gamma", type=int, default=None, help="default: the depth the draft was trained for")
    parser.add_argument("--tree", default="4,16,16,16", help="tree widths per depth (the draft's max_lag: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained draft and results go")
    return parser.parse_args(argv)


def train_glide(target_dir, data_glob, out_dir: Path, steps: int) -> Path:
    from specdraft.config import load_config
    from specdraft.train.loop import train

    cfg = load_config(None, [f"target={target_dir}", f"data_files={data_glob}", f"output_dir={out_dir}",
                             f"max_steps={steps}", "max_seq_length=256", "per_device_batch_size=8",
                             "learning_rate=2e-3", "warmup_steps=20", f"save_steps={steps}",
                             "logging_steps=25", "zero_stage=0", "resume=no", "seed=0",
                             "draft.sliding_window=128", "draft.max_lag=4"])
    result = train(cfg)
    return Path(result.export_dir)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out) / args.preset
    tree = [int(w) for w in args.tree.split(",")]

    # -- assets: target, prompts, a trained draft ----------------------------------------------
    target_dir, prompts_file, data_glob = args.target, args.prompts, args.data
    if target_dir is None or prompts_file is None or (args.draft is None and data_glob is None):
        from specdraft.demo import ensure_demo_assets

        demo_target, demo_data = ensure_demo_assets(preset=args.preset)
        target_dir = target_dir or str(demo_target)
        prompts_file = prompts_file or str(demo_data.prompts_file)
        data_glob = data_glob or str(Path(demo_data.train_files[0]).parent / "train-*.jsonl")
    t0 = time.perf_counter()
    if args.draft is None:
        export_dir = train_glide(target_dir, data_glob, out / "glide", args.train_steps)
        print(f"[bench] trained GLIDE for {args.train_steps} steps in {time.perf_counter() - t0:.0f}s: {export_dir}")
    else:
        export_dir, _ = resolve_export(args.draft)

    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32")
    tokenizer = load_tokenizer(export_dir, Path(target_dir))
    prompts = read_prompts(prompts_file, tokenizer, args.max_prompts)
    stop = stop_tokens(target, tokenizer)
    trained, _ = load_exported_draft(export_dir)
    untrained = draft_from_export_config(read_export_config(export_dir)).eval()

    # -- one baseline, then every drafter x shape --------------------------------------------
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=stop)
    baseline = run_plain(target, prompts, **settings)
    drafters = {"GLIDE (trained)": ("draft", trained), "prompt lookup": ("prompt_lookup", None),
                "GLIDE (untrained)": ("untrained", untrained)}
    rows = []
    for label, (method, draft) in drafters.items():
        # one γ for every drafter: the trained draft's depth unless asked otherwise
        gamma = trained.trained_depth if args.gamma is None else args.gamma
        for shape in (dict(gamma=gamma), dict(tree=tree)):
            report = compare(target, make_drafter(method, target, draft), prompts, baseline=baseline,
                             **shape, **settings)
            rows.append(dict(report, label=label, method=method))

    # -- report --------------------------------------------------------------------------------
    lines = [f"target {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params), "
             f"draft {export_dir}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
             f"temperature {args.temperature}, plain decoding {rows[0]['baseline_tokens_per_second']:.1f} tok/s",
             "",
             "| drafter | shape | τ | acceptance per position | tok/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"tree {','.join(map(str, r['tree']))}" if r["tree"] else f"chain γ={r['gamma']}"
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
        lines.append(f"| {r['label']} | {shape} | {r['tau']:.2f} | {acc} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x | {lossless} |")
    by = {(r["method"], bool(r["tree"])): r for r in rows}
    ratios = {}
    for is_tree, name in ((False, "chain"), (True, "tree")):
        glide, lookup = by[("draft", is_tree)]["tau"], by[("prompt_lookup", is_tree)]["tau"]
        ratios[name] = glide / lookup
        lines.append("")
        lines.append(f"GLIDE τ ÷ prompt-lookup τ ({name}): {glide:.2f} / {lookup:.2f} = {ratios[name]:.2f}"
                     f"  (goal >= 2: {'met' if ratios[name] >= 2 else 'NOT met'})")
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    results = {"rows": rows, "ratios": ratios, "export_dir": str(export_dir), "target": str(target_dir)}
    (out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (out / "acceptance.md").write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
