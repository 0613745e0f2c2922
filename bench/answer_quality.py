"""Answer quality of demo targets: distinct-2, degenerate answers and prompt lookup's τ, side by side.

    python bench/answer_quality.py --presets demo,bench      # builds (and caches) missing targets
    python bench/answer_quality.py --target DIR --prompts prompts.jsonl   # any HF chat target

Per target: its greedy answers to the preset dataset's held-out prompts (held out from the drafts'
training rows; the target was pre-trained on them, as on every function of its corpus), and to as
many prompts from stdlib files no compared target read (--unseen, 0 to skip). One speculative pass
per prompt with prompt lookup (γ=5) gives the greedy answer (lossless) and prompt lookup's τ; see
specdraft/demo/quality.py for the definitions. The bench target's goals (issue 23): distinct-2 ≥ 0.5,
≤ 10% degenerate, prompt lookup τ ≤ 1.6, on the held-out prompts. Only the targets are built, not the
regenerated datasets. Prints a markdown table and a last line of key=value pairs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdraft.decode.prompts import encode_messages, read_prompts, stop_tokens  # noqa: E402
from specdraft.commands.evaluate import load_tokenizer  # noqa: E402
from specdraft.demo.cache import read_stamp  # noqa: E402
from specdraft.demo.machine import describe  # noqa: E402
from specdraft.demo.presets import PRESETS, get_preset  # noqa: E402
from specdraft.demo.quality import held_out_prompts, measure_answer_quality, unseen_prompts  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402

GOALS = {"distinct_2": 0.5, "degenerate": 0.10, "lookup_tau": 1.6}  # >=, <=, <=
SEED = 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="demo,bench", help=f"comma-separated, from {sorted(PRESETS)}")
    parser.add_argument("--target", help="an HF target dir instead of presets (with --prompts)")
    parser.add_argument("--prompts", help="jsonl prompts for --target")
    parser.add_argument("--max-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--unseen", type=int, default=64, help="prompts no compared target read (0: skip)")
    return parser.parse_args(argv)


def _measure(target_dir: Path, prompts, max_new_tokens: int):
    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32")
    tokenizer = load_tokenizer(None, target_dir)
    ids = [
        p if isinstance(p, list) else encode_messages(tokenizer, [{"role": "user", "content": p}])
        for p in prompts(tokenizer)
    ]
    t0 = time.perf_counter()
    quality, texts = measure_answer_quality(
        target, tokenizer, ids, max_new_tokens=max_new_tokens, stop=stop_tokens(target, tokenizer)
    )
    return quality, texts, time.perf_counter() - t0


def build_figures(stamp: dict | None) -> str:
    if not stamp or "params" not in stamp:
        return "build figures not recorded" + (f"; final loss {stamp['final_loss']:.3f}" if stamp else "")
    return (
        f"{stamp['params'] / 1e6:.2f}M params, {stamp['tokens_seen'] / 1e6:.2f}M tokens seen "
        f"({stamp['tokens_seen'] / stamp['corpus_tokens']:.1f} passes), final loss {stamp['final_loss']:.3f}, "
        f"built in {stamp['build_seconds']:.0f}s wall / {stamp['build_cpu_seconds']:.0f}s CPU"
        + (f" on {describe(stamp['cpu'])}" if "cpu" in stamp else "")
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []  # (name, prompt set, AnswerQuality)
    if args.target:
        if not args.prompts:
            sys.exit("bench/answer_quality.py: --target needs --prompts")
        quality, texts, seconds = _measure(
            Path(args.target), lambda tok: read_prompts(args.prompts, tok, args.max_prompts), args.max_new_tokens
        )
        rows.append((args.target, Path(args.prompts).name, quality))
        print(f"[quality] {args.target}: {quality.line()} ({seconds:.0f}s)", flush=True)
    else:
        from specdraft.demo.assets import ensure_demo_target

        try:
            presets = [get_preset(name).name for name in args.presets.split(",") if name]
        except SpecdraftError as err:
            sys.exit(f"bench/answer_quality.py: {err}")
        after = max(get_preset(name).corpus_bytes for name in presets)
        max_prompt_tokens = max(get_preset(name).max_prompt_tokens for name in presets)
        for name in presets:
            target_dir = ensure_demo_target(preset=name)
            print(f"[quality] {name} target: {build_figures(read_stamp(target_dir))}", flush=True)
            sets = {"held-out": lambda tok, n=name: held_out_prompts(tok, n, SEED)[: args.max_prompts]}
            if args.unseen:
                sets["unseen"] = lambda tok: unseen_prompts(tok, after, SEED, args.unseen, max_prompt_tokens)
            for which, prompts in sets.items():
                quality, texts, seconds = _measure(target_dir, prompts, args.max_new_tokens)
                rows.append((name, which, quality))
                print(f"[quality] {name}, {which} prompts: {quality.line()} ({seconds:.0f}s)", flush=True)
                sample = texts[0].splitlines()[:6]
                print("[quality]   first answer: " + " ⏎ ".join(line.rstrip() for line in sample), flush=True)

    lines = [
        f"greedy answers, at most {args.max_new_tokens} new tokens; prompt lookup γ=5",
        "",
        "| target | prompts | answers | distinct-2 | degenerate | prompt lookup τ | mean tokens | ended turn |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, which, q in rows:
        lines.append(
            f"| {name} | {which} | {q.answers} | {q.distinct_2:.2f} | {q.degenerate:.0%} | {q.lookup_tau:.2f} "
            f"| {q.mean_tokens:.0f} | {q.ended:.0%} |"
        )
    lines.append(
        f"| goal (bench, held-out) | | | ≥ {GOALS['distinct_2']} | ≤ {GOALS['degenerate']:.0%} "
        f"| ≤ {GOALS['lookup_tau']} | | |"
    )
    print("\n".join(lines))
    headline = []
    for name, which, q in rows:
        key = f"{Path(name).name}_{which}".replace("-", "_")
        headline += [
            f"distinct2_{key}={q.distinct_2:.2f}",
            f"degenerate_{key}={q.degenerate:.2f}",
            f"lookup_tau_{key}={q.lookup_tau:.2f}",
        ]
    goals = next((q for name, which, q in rows if name == "bench" and which == "held-out"), None)
    if goals is not None:
        met = (
            goals.distinct_2 >= GOALS["distinct_2"]
            and goals.degenerate <= GOALS["degenerate"]
            and goals.lookup_tau <= GOALS["lookup_tau"]
        )
        headline.append(f"bench_goals_met={'yes' if met else 'no'}")
    print(" ".join(headline))
    return {"rows": rows}


if __name__ == "__main__":
    main()
