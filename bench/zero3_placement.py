"""ZeRO-3's frozen target: replicated outside the partition, or partitioned. Step time and peak
memory per rank, on 1 and 2 CPU ranks, measured in one run.

    OMP_NUM_THREADS=1 python bench/zero3_placement.py [--shape large] [--steps 4]

Each (placement, ranks) pair runs in fresh processes (torchrun for 2 ranks, gloo). Step time: the
median CPU seconds of a training step on rank 0 (see step_efficiency.timed), plus its wall time.
Memory: peak RSS above imports per rank, as bench/memory_model.py measures it. The last line is
`partitioned_over_replicated=<step time ratio at 2 ranks>`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def worker(args) -> None:
    import torch

    from resident_memory import peak_above, reset_peak
    from specdraft.drafts.registry import build_draft
    from specdraft.train import loop
    from specdraft.train.engine import build_engine, init_distributed
    from specdraft.train.model import TargetWithDraft
    from step_efficiency import SHAPES, random_target, run_config

    rank, world = init_distributed()
    shape = SHAPES[args.shape]
    cfg = run_config(shape, 3, document_mask=False)
    cfg.per_device_batch_size = 1
    base = reset_peak()
    target = random_target(shape)
    model = TargetWithDraft(target, build_draft(cfg.draft, target.config), cfg.loss_chunk_size)
    engine = build_engine(cfg, model, 100, args.placement)
    generator = torch.Generator().manual_seed(rank)
    cpu, wall = [], []
    for step in range(args.steps + 1):
        ids = torch.randint(0, shape.vocab, (1, shape.seq), generator=generator)
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        loop.forward_step(engine, batch, {"lag": 1 + step % 4})
        if step > 0:  # the first step allocates the optimizer state
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start_wall)
    peak = peak_above(base)
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    if rank == 0:
        print(json.dumps({"cpu": statistics.median(cpu), "wall": statistics.median(wall), "peaks": peaks}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(placement: str, ranks: int, args) -> dict:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=str(BENCH.parent),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    script = [
        str(Path(__file__)),
        "--worker",
        "--placement",
        placement,
        "--shape",
        args.shape,
        "--steps",
        str(args.steps),
    ]
    if ranks == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            *script,
        ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--placement", default="replicated", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="large")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"ZeRO-3, shape {args.shape} at batch 1, fp32; median of {args.steps} steps after one")
    print(f"{'placement':<12} {'ranks':>5} {'step CPU s':>10} {'step wall s':>11} {'peak MiB per rank':>18}")
    results = {}
    for ranks in (1, 2):
        for placement in ("replicated", "partitioned"):
            r = results[placement, ranks] = run(placement, ranks, args)
            peaks = " / ".join(f"{p / 2**20:.0f}" for p in r["peaks"])
            print(f"{placement:<12} {ranks:>5} {r['cpu']:10.2f} {r['wall']:11.2f} {peaks:>18}", flush=True)
    ratio = results["partitioned", 2]["cpu"] / results["replicated", 2]["cpu"]
    print(f"partitioned_over_replicated={ratio:.2f}")


if __name__ == "__main__":
    main()
