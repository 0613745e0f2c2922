"""bench/memory_model.py's CPU measurement: a shape trained for 2 steps in a fresh process (the
script itself, run with --child: its imports sit in the baseline), the peak resident memory above
that baseline, warm and cold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

import resident_memory  # noqa: E402
from memory_specs import llama_config, run_config  # noqa: E402

CHILD = BENCH / "memory_model.py"  # run with --child SPEC: measure_child(SPEC)

WARM_UP_SEQ = 256  # tokens of the warm-up run (--warm): the same code paths, little memory


def train_steps(spec: dict, steps: int) -> None:
    """Build the target, the draft and the DeepSpeed engine of `spec` and train `steps` steps."""
    from transformers import LlamaForCausalLM

    from specdraft.drafts.registry import build_draft
    from specdraft.train import loop
    from specdraft.train.engine import build_engine, resolve_target_placement
    from specdraft.train.model import TargetWithDraft

    cfg = run_config(spec)
    torch.manual_seed(0)
    target = LlamaForCausalLM(llama_config(spec)).eval().requires_grad_(False)
    model = TargetWithDraft(target, build_draft(cfg.draft, target.config), cfg.loss_chunk_size)
    engine = build_engine(cfg, model, 10, resolve_target_placement(cfg, target.config, world_size=1))
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    for step in range(steps):
        options = engine.module.draft_model.sample_batch_options(torch.Generator().manual_seed(step), spec["seq"])
        loop.forward_step(engine, batch, options)


def measure_child(spec: dict) -> None:
    """In a fresh process: peak resident bytes above imports of a 2-step training run. With
    spec["warm"], one step of the same run at WARM_UP_SEQ tokens comes first, before the baseline:
    the first step's one-off host costs (library code paged in, modules imported on first use,
    first-call caches: about 30 MiB at ZeRO-0, 80 MiB at ZeRO-2/3 here, 20 of them file-backed) are
    then in the baseline, as the imports are, and the peak counts what the run holds, which is what
    the model predicts for a GPU. (The warm-up's engine stays alive, DeepSpeed holds on to it: it is
    in the baseline too.)"""
    import gc

    from specdraft.train.engine import init_distributed

    init_distributed()
    if spec.get("warm"):
        train_steps(dict(spec, seq=WARM_UP_SEQ), steps=1)
    gc.collect()
    base = resident_memory.reset_peak()  # VmHWM := VmRSS
    train_steps(spec, steps=2)
    print(json.dumps({"peak": resident_memory.peak_above(base)}))


def measure(spec: dict) -> int:
    """measure_child(spec) in a fresh process, glibc serving every allocation above 64 KiB with mmap
    (a freed tensor leaves RSS at once)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run(
        [sys.executable, str(CHILD), "--child", json.dumps(spec)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def measured_cells(spec: dict, predicted: float, worst: dict) -> str:
    """The table cells of one shape, measured warm and cold (MiB, error vs predicted); keeps each
    kind's largest |error| in `worst`."""
    cells = ""
    for kind in ("warm", "cold"):
        measured = measure(dict(spec, warm=kind == "warm"))
        error = measured / predicted - 1
        worst[kind] = max(worst[kind], abs(error))
        cells += f" {measured / 2**20:8.0f} {error:+7.1%}"
    return cells
