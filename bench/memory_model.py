"""Per-device peak memory: the model in specdraft/train/memory.py, checked against peaks measured
on CPU, then its predictions for real targets on 8 x 80 GB GPUs.

    OMP_NUM_THREADS=1 python bench/memory_model.py [--skip-check]
    OMP_NUM_THREADS=1 python bench/memory_model.py --families [--seqs 1024,4096,8192] [--only glide]
    OMP_NUM_THREADS=1 python bench/memory_model.py --targets   # predictions only: Qwen3-8B per family,
                                                               # gpt-oss-20b and Qwen3-30B-A3B rows

Measurement (CPU, one rank, fp32, batches without document borders): each shape runs in a fresh process that builds a random Llama
target, the GLIDE draft and the DeepSpeed engine, and trains 2 steps. Peak = the kernel's
high-water mark of resident memory (VmHWM, reset through /proc/self/clear_refs after imports and
process-group start-up) minus the resident memory at that moment. glibc is told to serve every
allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves RSS at once
and RSS follows live tensor bytes instead of the allocator's cached heap. Untouched pages of an
allocation never count (RSS, not the address space); on a GPU the caching allocator holds the
whole allocation, so the model counts whole buffers. Goal: |measured / predicted - 1| <= 10%.

Each shape is measured twice: warm (after one step of the same run at 256 tokens, so that the
first step's one-off host costs, library code paged in and modules imported on first use, sit in
the baseline with the imports) and cold (without). The goal is read on warm.

The last line is `memory_error=<x> memory_error_cold=<y>`: the largest relative error of the three
checks (`--families`: `family_memory_error=`, `family_memory_error_cold=`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_measure import measure_child, measured_cells  # noqa: E402
from memory_predictions import glide_table, moe_target_rows, qwen3_8b_sequence_parallel_table, qwen3_8b_table  # noqa: E402
from memory_specs import llama_config, run_config  # noqa: E402
from specdraft.train.memory import estimate_peak  # noqa: E402

# Three CPU shapes that move different parts: weights, activations, the loss chunk.
CHECKS = [
    dict(
        name="wide-vocab",
        layers=4,
        hidden=512,
        heads=8,
        kv_heads=4,
        intermediate=1376,
        vocab=32000,
        batch=2,
        seq=1024,
        window=512,
        zero=0,
    ),
    dict(
        name="deep",
        layers=12,
        hidden=768,
        heads=12,
        kv_heads=4,
        intermediate=2048,
        vocab=8000,
        batch=4,
        seq=256,
        window=128,
        zero=2,
    ),
    dict(
        name="long",
        layers=4,
        hidden=384,
        heads=6,
        kv_heads=2,
        intermediate=1024,
        vocab=16000,
        batch=2,
        seq=2048,
        window=512,
        zero=3,
    ),
]


# One CPU shape per family at growing T (batch 1, ZeRO-0, fp32): the family's own terms grow with T.
FAMILY_SHAPE = dict(
    layers=4, hidden=256, heads=4, kv_heads=2, intermediate=688, vocab=8000, batch=1, window=512, zero=0
)


def check_families(seqs, only=None) -> None:
    """Each (family, T) measured twice, each in a fresh process: cold (the first step's one-off
    host costs included, as before) and warm (after a warm-up step; see measure_child). The goal
    is read on warm: the model predicts tensors, not the process's code pages."""
    from specdraft.drafts.registry import FAMILIES

    worst = {"warm": 0.0, "cold": 0.0}
    print("CPU check per family (fp32, 1 rank, batch 1, no document borders; 4 x 256 target, vocab 8000):")
    print(
        f"{'family':<8} {'T':>5} {'predicted MiB':>13} {'warm MiB':>8} {'error':>7} {'cold MiB':>8} {'error':>7}"
        f"  family terms (MiB)"
    )
    for family in only or FAMILIES:
        if not FAMILIES[family].drafts_for("llama"):  # MTP: its terms are pinned by tests/test_memory.py
            print(
                f"{family:<8} skipped: it drafts only for {', '.join(FAMILIES[family].target_model_types)} "
                f"targets, this check builds a Llama"
            )
            continue
        for seq in seqs:
            spec = dict(FAMILY_SHAPE, seq=seq, family=family)
            estimate = estimate_peak(llama_config(spec), run_config(spec), world_size=1, documents=False)
            cells = measured_cells(spec, estimate.total, worst)
            parts = ", ".join(
                f"{k} {v / 2**20:.0f}"
                for k, v in estimate.parts.items()
                if "weights" not in k and "optimizer" not in k and "grads" not in k
            )
            print(f"{family:<8} {seq:>5} {estimate.total / 2**20:13.0f}{cells}  {parts}", flush=True)
    qwen3_8b_table()
    moe_target_rows()
    print(f"family_memory_error={worst['warm']:.3f} family_memory_error_cold={worst['cold']:.3f}")


def check_shapes(worst: dict) -> None:
    """The three CHECKS shapes measured warm and cold against their prediction, the parts below each."""
    print(
        "CPU check (fp32, 1 rank, peak RSS above imports; warm: after a warm-up step, cold: without; "
        "see the docstring):"
    )
    print(
        f"{'shape':<11} {'L x H, V':>14} {'B x T':>8} {'ZeRO':>4} {'predicted MiB':>13} {'warm MiB':>8} "
        f"{'error':>7} {'cold MiB':>8} {'error':>7}"
    )
    for spec in CHECKS:
        estimate = estimate_peak(llama_config(spec), run_config(spec), world_size=1, documents=False)
        predicted = estimate.total
        cells = measured_cells(spec, predicted, worst)
        dims = f"{spec['layers']}x{spec['hidden']}, {spec['vocab']}"
        shape = f"{spec['batch']}x{spec['seq']}"
        print(
            f"{spec['name']:<11} {dims:>14} {shape:>8} {spec['zero']:>4} {predicted / 2**20:13.0f}{cells}",
            flush=True,
        )
        print("    " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in estimate.parts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip-check", action="store_true", help="only the GPU predictions")
    parser.add_argument(
        "--families", action="store_true", help="check every family at growing T, then the per-family Qwen3-8B table"
    )
    parser.add_argument("--seqs", default="1024,4096,8192")
    parser.add_argument("--only", default=None, help="with --families: these families (comma-separated)")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="only the Qwen3-8B table of the longest context per family at SP = 1, 2, 4, 8",
    )
    parser.add_argument(
        "--targets",
        action="store_true",
        help="only the Qwen3-8B table per family, then the gpt-oss-20b and Qwen3-30B-A3B rows",
    )
    args = parser.parse_args()
    if args.sequence_parallel:
        qwen3_8b_sequence_parallel_table()
        return
    if args.targets:
        qwen3_8b_table()
        moe_target_rows()
        return
    if args.child:
        measure_child(json.loads(args.child))
        return
    if args.families:
        check_families([int(t) for t in args.seqs.split(",")], args.only.split(",") if args.only else None)
        return

    worst = {"warm": 0.0, "cold": 0.0}
    if not args.skip_check:
        check_shapes(worst)
    glide_table()
    if not args.skip_check:
        print(f"memory_error={worst['warm']:.3f} memory_error_cold={worst['cold']:.3f}")


if __name__ == "__main__":
    main()
