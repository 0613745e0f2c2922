"""Packing, whole against stream, at equal answer tokens: tau of one family trained online on the
same conversations packed each way.

    python bench/packing.py                     # smollm2: GLIDE, 2 epochs of whole windows, 32 prompts
    python bench/packing.py --preset tiny --max-prompts 8
    python bench/packing.py --quick             # a few steps on tiny (tests)

whole: each conversation whole in one window, best fit, the window's tail padded (no labels).
stream: the conversations joined and cut at every window border; a cut one goes on in the next
window without its prompt (specdraft/config/schema.py, `packing`).

The whole run trains --epochs passes over its windows. The stream run trains the steps whose
batches (the train loop's sampler, the same seed) hold as many answer tokens as the whole run's, the
first step that reaches them: both drafts have learned from the same number of answer tokens, the
stream one from pieces without their prompts too. Both exports are measured by specdraft's decoder
(greedy chain of --gamma on the preset's held-out prompts) with the ratio whole / stream and its
paired-bootstrap 95% interval (bench/offline_parts.py tau_ratio).

Resumable: every finished part (a window count, a run, a tau) is kept under --out/<preset>/parts
and reused by a rerun of the same --out. Prints one summary line of key=value pairs (bench/summary.py)
and writes packing.json to --out/<preset>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from bench_cli import assets_parser, parse_measuring  # noqa: E402
from offline_parts import Assets, Judge, Parts, preset_batch, quiet, tau_ratio, train_export  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402

PACKINGS = ("whole", "stream")
QUICK = dict(preset="tiny", epochs=1, max_prompts=2, max_new_tokens=8, gamma=3)


def parse_args(argv=None):
    parser = assets_parser(__doc__)
    parser.add_argument("--family", default="glide", help="the family trained both ways")
    parser.add_argument("--epochs", type=int, default=2, help="passes of the whole run over its windows")
    args = parse_measuring(parser, argv, "runs/bench-packing", QUICK)
    args.batch = preset_batch(args.preset, default=2)
    args.shared = []  # offline_parts.Assets reads it: no keys over the preset's
    return args


def answer_tokens_per_window(assets: Assets, family: str, packing: str) -> List[int]:
    """The trained (loss-masked) tokens of every window of the data packed this way."""
    from specdraft.target.model import load_target_tokenizer
    from specdraft.train.data import prepare_data

    cfg = assets.config(family, f"count-{packing}", 1, f"packing={packing}")
    data = prepare_data(cfg, load_target_tokenizer(cfg.target), 0, quiet)
    return [int(data.loss_mask[i : i + 1].sum()) for i in range(len(data))]


def steps_for_answer_tokens(per_window: List[int], batch: int, seed: int, answer_tokens: int) -> int:
    """The first step at which the train loop's batches (its sampler, one rank) hold answer_tokens."""
    from specdraft.data.sampler import ShardedBatchSampler

    sampler = ShardedBatchSampler(len(per_window), batch, 0, 1, seed)
    seen, steps = 0, 0
    while seen < answer_tokens:
        seen += sum(per_window[i] for i in sampler.next_batch().tolist())
        steps += 1
    return steps


def answer_tokens_in_steps(per_window: List[int], batch: int, seed: int, steps: int) -> int:
    from specdraft.data.sampler import ShardedBatchSampler

    sampler = ShardedBatchSampler(len(per_window), batch, 0, 1, seed)
    return sum(per_window[i] for _ in range(steps) for i in sampler.next_batch().tolist())


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out) / args.preset
    assets, parts = Assets(args, out), Parts(out)
    seed = assets.config(args.family, "seed", 1).seed
    print(machine_line(), flush=True)

    windows = {
        p: parts.get(f"windows-{p}", lambda p=p: answer_tokens_per_window(assets, args.family, p)) for p in PACKINGS
    }
    whole_steps = args.epochs * (len(windows["whole"]) // args.batch)
    budget = answer_tokens_in_steps(windows["whole"], args.batch, seed, whole_steps)
    steps = {"whole": whole_steps, "stream": steps_for_answer_tokens(windows["stream"], args.batch, seed, budget)}

    judge = None
    result = dict(preset=args.preset, family=args.family, epochs=args.epochs, prompts=args.max_prompts)
    for packing in PACKINGS:
        name = f"{args.family}-{packing}-{steps[packing]}"
        run = parts.get(
            f"train-{name}",
            lambda: dict(
                zip(("export", "loss"), train_export(assets, args.family, name, steps[packing], f"packing={packing}"))
            ),
        )

        def judged(export=run["export"]):
            nonlocal judge
            judge = judge or Judge(assets)
            return judge.tau(export)

        tau = parts.get(f"tau-{name}-p{args.max_prompts}x{args.max_new_tokens}g{args.gamma}", judged)
        result[packing] = dict(
            windows=len(windows[packing]),
            answer_tokens_per_epoch=sum(windows[packing]),
            steps=steps[packing],
            answer_tokens_trained=answer_tokens_in_steps(windows[packing], args.batch, seed, steps[packing]),
            loss=run["loss"],
            tau=tau["tau"],
            lossless=tau["lossless"],
            per_prompt=tau["per_prompt"],
        )
        print(f"[bench] {packing}: {steps[packing]} steps, tau {tau['tau']:.3f}", flush=True)
    result["whole_over_stream"] = tau_ratio(result["whole"], result["stream"])
    (out / "packing.json").write_text(json.dumps(result, indent=1))
    ratio = result["whole_over_stream"]
    print(
        f"preset={args.preset} family={args.family} whole_tau={result['whole']['tau']:.3f} "
        f"stream_tau={result['stream']['tau']:.3f} ratio={ratio['ratio']:.3f} "
        f"low={ratio['low']:.3f} high={ratio['high']:.3f} "
        f"whole_answer_tokens={result['whole']['answer_tokens_trained']} "
        f"stream_answer_tokens={result['stream']['answer_tokens_trained']}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
