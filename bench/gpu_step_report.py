"""What one case of bench/gpu_step.py measured, and how the bench prints it: the header (device,
versions, timing), a table row per case, and the last line of key=value pairs (bench/summary.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_step_shapes import Shape  # noqa: E402

MEASURED = ("ratio", "tokens_per_s", "peak_gb", "step_ms", "first_s", "recompiles", "tokens")


@dataclass
class Result:
    family: str
    shape: Shape
    target: str = ""
    status: str = "ok"  # ok | oom | skipped | error
    note: str = ""
    phase: str = "build"  # where it stopped, for oom / error
    values: Dict[str, float] = field(default_factory=dict)
    warm: List[float] = field(default_factory=list)  # warm-up steps of (c) after the first, seconds
    held_before: float = 0.0  # bytes allocated before the case (CUDA)
    compiles_first: int = 0
    breaks: int = 0


def header(device: torch.device, dtype: torch.dtype, steps: int, warmup: int) -> str:
    import deepspeed
    import transformers

    from specdraft.demo.machine import machine_line

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (
            f"device: {props.name} ({props.total_memory / 2**30:.1f} GiB), CUDA {torch.version.cuda}, "
            f"{os.cpu_count()} CPUs"
        )
    else:
        where = machine_line()
    return (
        f"{where}\ntorch {torch.__version__}, transformers {transformers.__version__}, deepspeed "
        f"{deepspeed.__version__}; {str(dtype).replace('torch.', '')}; (c) first step alone, {warmup - 1} more "
        f"warm-up step(s), {steps} timed; (a), (b) {warmup} warm-up + {steps} timed; medians"
    )


COLUMNS = (
    f"{'family':<7} {'shape':<10} {'target':<11} {'(a) ms':>9} {'(b) ms':>9} {'(c) ms':>9} {'c/(a+b)':>8} "
    f"{'tokens/s':>10} {'peak GB':>8} {'first s':>8} {'compiles':>8} {'recomp.':>7} {'breaks':>6}  warm-up s"
)


def row(result: Result) -> str:
    v, shape = result.values, result.shape
    head = f"{result.family:<7} {shape.name:<10} {result.target:<11}"
    if result.status != "ok":
        measured = ", ".join(f"{key} {v[key]:.4g}" for key in ("step_ms", "tokens_per_s", "peak_gb") if key in v)
        return f"{head} {result.status}: {result.note}" + (f" (measured: {measured})" if measured else "")
    line = (
        f"{head} {v['a_ms']:9.1f} {v['b_ms']:9.1f} {v['step_ms']:9.1f} {v['ratio']:8.3f} "
        f"{v['tokens_per_s']:10.0f} {v['peak_gb']:8.2f} {v['first_s']:8.2f} {result.compiles_first:8d} "
        f"{int(v['recompiles']):7d} {result.breaks:6d}  {' '.join(f'{s:.2f}' for s in result.warm) or '-'}"
    )
    if result.note:
        line += f"  ({result.note})"
    if result.held_before >= 2**20:
        line += f"  ({result.held_before / 2**30:.2f} GB held before the case)"
    return line


def last_line(results: Sequence[Result]) -> str:
    pairs = []
    for result in results:
        prefix = f"{result.family}_{result.shape.name}_"
        for key in MEASURED:
            value = result.values.get(key)
            if value is None:
                text = result.status if result.status != "ok" else "nan"
            elif key in ("recompiles", "tokens") and value == int(value):
                text = str(int(value))
            elif key == "tokens_per_s":
                text = f"{value:.0f}"
            else:
                text = f"{value:.4g}"
            pairs.append(f"{prefix}{key}={text}")
    return " ".join(pairs)
