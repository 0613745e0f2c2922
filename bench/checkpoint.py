"""Checkpoint cost, measured in one run: slot bytes / ideal, save wall time, and the stall a save
causes relative to a training step.

    python bench/checkpoint.py [--target DIR] [--steps 24] [--save-steps 6] [--zero-stage 2]

ideal = trainable params x 16 B (fp32 weights + fp32 master + Adam m + v). The stall is the extra
wall time of a step that saves (DeepSpeed slot + COMMITTED manifest + draft export) over the median
plain step. Without --target it uses the demo target (built once under $SPECDRAFT_HOME).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import run_overrides, write_chat_files  # noqa: E402
from specdraft.config import load_config  # noqa: E402
from specdraft.train import loop  # noqa: E402
from specdraft.rundir.layout import COMMITTED  # noqa: E402
from specdraft.checkpoint.manager import CheckpointManager  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=6)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if args.target is None:
        from specdraft.demo.assets import ensure_demo_assets

        args.target = str(ensure_demo_assets(preset="demo")[0])

    work = Path(tempfile.mkdtemp(prefix="specdraft-bench-ckpt-"))
    write_chat_files(work / "data")
    save_times, step_times = [], []
    original_save = CheckpointManager.save

    def timed_save(self, *a, **k):  # the DeepSpeed slot + commit, without the draft export
        start = time.perf_counter()
        out = original_save(self, *a, **k)
        save_times.append(time.perf_counter() - start)
        return out

    CheckpointManager.save = timed_save
    original_forward_step = loop.forward_step
    marks = []

    def marked_forward_step(*a, **k):
        marks.append(time.perf_counter())
        return original_forward_step(*a, **k)

    loop.forward_step = marked_forward_step
    cfg = load_config(
        None,
        run_overrides(
            args.target,
            work / "data",
            work / "run",
            work / "cache",
            max_seq_length=args.seq,
            max_steps=args.steps,
            save_steps=args.save_steps,
            zero_stage=args.zero_stage,
        ),
    )
    result = loop.train(cfg, log=lambda *a: None)
    marks.append(time.perf_counter())
    step_times = [b - a for a, b in zip(marks, marks[1:])]
    saving = {s - 1 for s in range(args.save_steps, args.steps + 1, args.save_steps)}
    plain = statistics.median(t for i, t in enumerate(step_times) if i not in saving and i > 0)
    stalls = [step_times[i] - plain for i in sorted(saving) if i < len(step_times) - 1]

    slot = sorted((work / "run" / "ckpt").glob("step_*"))[-1]
    slot_bytes = sum(p.stat().st_size for p in slot.iterdir() if p.name != COMMITTED)
    record = json.loads((slot / COMMITTED).read_text())
    from safetensors.torch import load_file

    params = sum(t.numel() for t in load_file(str(result.export_dir / "model.safetensors")).values())
    print(
        f"target {args.target}; draft {params / 1e6:.2f}M params; ZeRO-{record['zero_stage']}; "
        f"{args.steps} steps, save every {args.save_steps}"
    )
    print(f"slot bytes / ideal (params x 16 B)     = {slot_bytes / (params * 16):.3f}  ({slot_bytes / 2**20:.1f} MiB)")
    print(f"save wall time (slot + commit), median = {statistics.median(save_times):.3f} s")
    print(f"plain step time, median               = {plain:.3f} s")
    if stalls:
        print(
            f"stall of a saving step / step time    = {statistics.median(stalls) / plain:.2f}  (goal <= 1.0; "
            f"includes the draft export)"
        )
    print(f"slot_ratio={slot_bytes / (params * 16):.3f} stall={statistics.median(stalls) / plain if stalls else 0:.2f}")


if __name__ == "__main__":
    main()
