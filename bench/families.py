"""Acceptance benchmark: draft families trained the same way (demo data, steps) side by side, vs
prompt lookup and an untrained GLIDE draft.

    python bench/families.py                        # demo preset (builds it the first time)
    python bench/families.py --preset tiny          # a quick run
    python bench/families.py --families dflash      # only some families
    python bench/families.py --draft runs/glide     # an existing GLIDE run / export instead

Every number comes from this one run: tau, acceptance per position, tokens/s and draft forward
passes per generated token of each drafter, chain (gamma) and tree, against plain target decoding
of the same prompts measured once here. A block drafter (DFlash) also runs its whole block as the
chain (gamma = its block's predictions). Prints a markdown table and each family's tau / prompt-
lookup tau (the goal for GLIDE is >= 2).
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
from specdraft.decode.speculative import speculative_generate  # noqa: E402
from specdraft.drafts import draft_from_export_config  # noqa: E402
from specdraft.drafts.io import load_exported_draft, read_export_config  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=["demo", "tiny"], help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--families", default="glide,dflash", help="draft families to train and compare")
    parser.add_argument("--draft", help="run or export dir of a GLIDE draft (default: train one now)")
    parser.add_argument("--data", help="training data glob for the draft (default: the preset's)")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tree", default="4,16,16,16,16", help="tree widths per depth")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained draft and results go")
    return parser.parse_args(argv)


# per family: the `draft.` keys of its demo config (configs/demo*.yaml); training keys are shared
FAMILY_KEYS = {
    "glide": ["draft.type=glide", "draft.sliding_window=128", "draft.max_lag=4"],
    "eagle3": ["draft.type=eagle3"],
    "dflash": ["draft.type=dflash", "draft.num_layers=2", "draft.block_size=8", "draft.max_anchors=64"],
}
LABELS = {"glide": "GLIDE", "eagle3": "EAGLE-3", "dflash": "DFlash"}


def train_draft(family: str, target_dir, data_glob, out_dir: Path, steps: int) -> Path:
    from specdraft.config import load_config
    from specdraft.train.loop import train

    cfg = load_config(None, [f"target={target_dir}", f"data_files={data_glob}", f"output_dir={out_dir}",
                             f"max_steps={steps}", "max_seq_length=256", "per_device_batch_size=8",
                             "learning_rate=2e-3", "warmup_steps=20", f"save_steps={steps}",
                             "logging_steps=25", "zero_stage=0", "resume=no", "seed=0", *FAMILY_KEYS[family]])
    result = train(cfg)
    return Path(result.export_dir)


class ForwardCounter:
    """Counts calls of a draft module's forward (one call = one draft forward pass)."""

    def __init__(self, module):
        self.calls = 0
        self._handle = None if module is None else module.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def close(self):
        if self._handle is not None:
            self._handle.remove()


def compare_counted(target, method, draft, prompts, baseline, shape, settings) -> dict:
    """compare() plus draft forward passes per generated token (the tokens the verification
    rounds produced: accepted + one per target forward)."""
    drafter = make_drafter(method, target, draft)
    counter = ForwardCounter(draft)
    try:
        # compare() starts with one 2-token warm-up generation; the same call here, counted, is
        # subtracted (greedy: it drafts the same forwards again)
        before = counter.calls
        speculative_generate(target, drafter, prompts[0], max_new_tokens=2, **shape)
        warmup = counter.calls - before
        start = counter.calls
        report = compare(target, drafter, prompts, baseline=baseline, **shape, **settings)
        forwards = counter.calls - start - warmup
    finally:
        counter.close()
    produced = report["accepted_tokens"] + report["target_forwards"]
    report["draft_forwards"] = forwards
    report["draft_forwards_per_token"] = forwards / produced if produced else 0.0
    return report


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
    families = [f for f in args.families.split(",") if f]
    exports = {}
    for family in families:
        if family == "glide" and args.draft is not None:
            exports[family], _ = resolve_export(args.draft)
            continue
        t0 = time.perf_counter()
        exports[family] = train_draft(family, target_dir, data_glob, out / family, args.train_steps)
        print(f"[bench] trained {LABELS[family]} for {args.train_steps} steps in {time.perf_counter() - t0:.0f}s: "
              f"{exports[family]}")

    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32")
    tokenizer = load_tokenizer(next(iter(exports.values()), None), Path(target_dir))
    prompts = read_prompts(prompts_file, tokenizer, args.max_prompts)
    stop = stop_tokens(target, tokenizer)
    trained = {family: load_exported_draft(path)[0] for family, path in exports.items()}

    # -- one baseline, then every drafter x shape --------------------------------------------
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=stop)
    baseline = run_plain(target, prompts, **settings)
    drafters = {f"{LABELS[family]} (trained)": ("draft", family, draft) for family, draft in trained.items()}
    drafters["prompt lookup"] = ("prompt_lookup", None, None)
    if "glide" in exports:
        drafters["GLIDE (untrained)"] = ("untrained", "glide",
                                         draft_from_export_config(read_export_config(exports["glide"])).eval())
    rows = []
    for label, (method, family, draft) in drafters.items():
        shapes = [dict(gamma=args.gamma), dict(tree=tree)]
        block = getattr(getattr(draft, "layout", None), "predictions", None)  # a block drafter
        if block is not None and block != args.gamma:
            shapes.insert(1, dict(gamma=block))
        for shape in shapes:
            report = compare_counted(target, method, draft, prompts, baseline, shape, settings)
            rows.append(dict(report, label=label, method=method, family=family))

    # -- report --------------------------------------------------------------------------------
    lines = [f"target {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params), "
             f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, temperature {args.temperature}, "
             f"every family trained {args.train_steps} steps on the same data, "
             f"plain decoding {rows[0]['baseline_tokens_per_second']:.1f} tok/s",
             "",
             "| drafter | shape | τ | acceptance per position | draft fwd / token | tok/s | speedup | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"tree {','.join(map(str, r['tree']))}" if r["tree"] else f"chain γ={r['gamma']}"
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
        lines.append(f"| {r['label']} | {shape} | {r['tau']:.2f} | {acc} | {r['draft_forwards_per_token']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {lossless} |")
    by = {(r["method"], r["family"], r["tree"] is not None, r["gamma"]): r for r in rows}
    ratios = {}
    for family in exports:
        for is_tree, name in ((False, "chain"), (True, "tree")):
            gamma = None if is_tree else args.gamma
            tau, lookup = by[("draft", family, is_tree, gamma)]["tau"], by[("prompt_lookup", None, is_tree, gamma)]["tau"]
            ratios[f"{family}/{name}"] = tau / lookup
            lines.append("")
            goal = f"  (goal >= 2: {'met' if tau / lookup >= 2 else 'NOT met'})" if family == "glide" else ""
            lines.append(f"{LABELS[family]} τ ÷ prompt-lookup τ ({name}): {tau:.2f} / {lookup:.2f} = "
                         f"{tau / lookup:.2f}{goal}")
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    results = {"rows": rows, "ratios": ratios, "exports": {k: str(v) for k, v in exports.items()},
               "target": str(target_dir)}
    (out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (out / "acceptance.md").write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
