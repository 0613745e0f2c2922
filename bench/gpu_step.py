"""One GPU: where a training step's time goes, per family and shape (the GPU twin of
bench/step_efficiency.py). Per case (a family at a shape), on random weights built on the device:

    (a) the target forward as the capture runs it: train/model.py target_features with the draft's
        capture request, under no_grad, attending inside each packed document;
    (b) the draft forward + backward alone, on features captured once (a plain copy of the draft in
        the engine's parameter dtype, no DeepSpeed hooks);
    (c) the whole training step through the DeepSpeed engine (train/engine.py build_engine, a world
        of one) as train() runs it (train/loop.py): the batch read from packed memory-mapped data,
        the per-batch options, forward_step (capture, loss, backward, optimizer step).

    ratio = median(c) / (median(a) + median(b))    tokens/s = tokens of the batch / median(c)

(c) runs first after torch._dynamo.reset(), so its first step includes every compilation
(flex_attention, create_block_mask, any torch.compile) as a fresh `specdraft train` pays it; the
rest of the warm-up steps, then --steps steps timed back to back. Then (a) and (b): --warmup calls,
then --steps timed. On CUDA every call is timed with CUDA events (wall time on the GPU's timeline,
the host's launch gaps included), on CPU with time.perf_counter. Also per case: the first step's
time and the other warm-up steps', dynamo's compilations in (c)'s first step and in its later
steps (torch._dynamo.utils.counters: frames compiled; any after the first step is a recompile or
a frame first met late), (c)'s graph breaks, and the peak memory of (c)'s timed steps: on CUDA
torch.cuda.max_memory_allocated (reset per case, after the warm-up) less what was allocated
before the case (printed as 'held before': nonzero only if an earlier case leaked), i.e. the
weights, optimizer state and activations the training holds; on CPU the process's peak resident
memory over the same steps (VmHWM, reset likewise), only so that the CPU run exercises the same
code. TORCH_LOGS=recompiles prints why dynamo recompiles.

    python bench/gpu_step.py [--device cuda|cpu] [--families glide,eagle3,peagle,dflash,dspark,mtp]
        [--shapes 2048x1,2048x4,8192x1,32768x1,8b_4096x1] [--steps 10] [--warmup 3] [--case-budget 0]

--case-budget S: past S seconds of a case (its build and (c)), no further warm-up or timed step
of (c) starts (the row says how many ran): a case whose every step recompiles still ends. The
first step re-traces with dynamo in every case (torch._dynamo.reset()), but inductor's caches
(in memory and on disk, shared with later processes) can shorten a later case's compilation;
TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 gives every case a cold compile.

Shapes (random weights, no download; transformers' Qwen3Config): "2048x1", "2048x4", "8192x1",
"32768x1" a Qwen3-0.6B-like target (hidden 1024, 28 layers, 16 / 8 heads, head_dim 128,
intermediate 3072, vocab 151,936, tied embeddings) at T x B; "8b_4096x1" a Qwen3-8B-like one
(hidden 4096, 36 layers, 32 / 8 heads, head_dim 128, intermediate 12288, vocab 151,936, untied) at
4096 x 1. MTP fine-tunes a qwen3_next target's own layer: its target is a Qwen3-Next of the same
dims (Qwen3NextConfig: every layer full attention, 4 experts of intermediate / 4, 2 per token, a
shared expert of intermediate / 2: the dense MLP's active width), its layer random (no checkpoint
files to read it from); a shape the config class cannot build is skipped with the reason. bf16 on
CUDA. `--device cpu` (fp32) runs the same code on the tiny preset, "64x2" and "128x1" (the tests'
widths: hidden 64, 2 layers, 4 / 2 heads, vocab 256), so that a test keeps the script from rotting.

Each family trains with its packaged demo config's settings (specdraft/configs/demo*.yaml: its
draft keys, ZeRO stage, optimizer), at the shape's max_seq_length and batch: as `specdraft train`
of the demo config runs at that length (DFlash and DSpark keep its 64 anchors per row). The data is packed as
the demo data is: conversations of 64-512 tokens, several per row (document_ids), the first third
of each a prompt and the rest its answer (the loss mask); random token ids.

A case that runs out of GPU memory prints `oom` (and the phase it failed in) and the run goes on;
another error prints its traceback to stderr, `error` for the case, and the exit status is 1. The
last line is `key=value` pairs (bench/summary.py), per case `<family>_<shape>_` + ratio,
tokens_per_s, peak_gb, step_ms, first_s, recompiles, tokens (counted per training step).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from device_meters import Clock, PeakMemory, dynamo_counts, is_oom  # noqa: E402
from gpu_step_report import COLUMNS, Result, header, last_line, row  # noqa: E402
from gpu_step_shapes import DEFAULT_SHAPES, SHAPES, Shape, Skip, build_target, target_config  # noqa: E402

FAMILY_ORDER = ("glide", "eagle3", "peagle", "dflash", "dspark", "dflash2", "mtp")
DEFAULT_STEPS = {"cuda": (10, 3), "cpu": (2, 1)}  # (--steps, --warmup)


# -- data --------------------------------------------------------------------------------------


def packed_data(shape: Shape, rows: int, out: Path):
    """A packed cache as prepare_data leaves it: random tokens in conversations of 64-512 tokens
    (the first third a prompt, the rest the answer: the loss mask), several per row; the CPU
    twin's data, at this bench's shape."""
    from step_efficiency import packed_data as cpu_twins

    return cpu_twins(shape, rows, out)


def run_config(shape: Shape, family: str, precision: str):
    """The family's packaged demo config (its draft keys, ZeRO stage, optimizer) at the shape."""
    from omegaconf import OmegaConf

    from specdraft.config import TrainConfig, family_demo_configs

    demo = OmegaConf.load(family_demo_configs()[family])
    for key in ("target", "data_files", "eval_prompts", "output_dir"):  # paths of the demo assets: not read
        demo.pop(key, None)
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), demo)
    cfg.max_seq_length, cfg.per_device_batch_size, cfg.precision = shape.seq, shape.batch, precision
    cfg.gradient_accumulation_steps = 1
    return cfg


# -- one case ------------------------------------------------------------------------------------


class Case:
    """The target, draft, engine and data of one family at one shape; measure() fills a Result."""

    def __init__(
        self,
        family: str,
        shape: Shape,
        device: torch.device,
        dtype: torch.dtype,
        work: Path,
        steps: int,
        warmup: int,
        budget: float = 0.0,
    ):
        self.family, self.shape, self.device, self.dtype = family, shape, device, dtype
        self.work, self.steps, self.warmup = work, steps, warmup
        self.budget = budget  # seconds for (c), the build included; 0: no limit
        self.engine = self.model = self.plain = self.features = self.data = None

    def build(self, result: Result) -> None:
        from specdraft.data.sampler import ShardedBatchSampler
        from specdraft.drafts.registry import build_draft
        from specdraft.train.engine import build_engine
        from specdraft.train.model import TargetWithDraft

        shape = self.shape
        config = target_config(shape, self.family)
        result.target = f"{config.model_type}"
        cfg = run_config(shape, self.family, "bf16" if self.dtype == torch.bfloat16 else "fp32")
        self.cfg = cfg
        self.data = packed_data(
            shape,
            rows=shape.batch * (self.warmup + self.steps + 1),
            out=self.work / f"{shape.name}-{config.model_type}",
        )
        target = build_target(config, self.device, self.dtype)
        draft = build_draft(cfg.draft, target.config, data=self.data)  # EAGLE-3's vocab maps from the data
        self.plain = copy.deepcopy(draft)  # (b) runs outside the engine (moved to the device in (b))
        self.model = TargetWithDraft(target, draft, cfg.loss_chunk_size)
        self.engine = build_engine(cfg, self.model, total_steps=self.warmup + self.steps + 1)
        self.sampler = ShardedBatchSampler(len(self.data), shape.batch, rank=0, world_size=1, seed=cfg.seed)
        self.tokens: List[int] = []

    def train_step(self, step: int) -> None:
        """(c): what train() does per micro-batch (gradient_accumulation_steps 1)."""
        from specdraft.train import loop

        batch = loop.model_inputs(self.data.batch(self.sampler.next_batch()), self.cfg.document_mask)
        options = self.engine.module.draft_model.sample_batch_options(
            loop.batch_generator(self.cfg.seed, step, 0), self.cfg.max_seq_length
        )
        self.tokens.append(batch["input_ids"].numel())  # as the loop counts tokens_seen
        loop.forward_step(self.engine, batch, options)

    def fixed_batch(self):
        """One batch on the device for (a) and (b), its options and its host copy."""
        from specdraft.data.sampler import ShardedBatchSampler
        from specdraft.train import loop

        sampler = ShardedBatchSampler(len(self.data), self.shape.batch, rank=0, world_size=1, seed=self.cfg.seed)
        batch = loop.model_inputs(self.data.batch(sampler.next_batch()), self.cfg.document_mask)
        options = self.plain.sample_batch_options(loop.batch_generator(self.cfg.seed, 0, 0), self.cfg.max_seq_length)
        inputs, host = loop.device_inputs(batch, self.device), loop.host_batch(batch)
        return inputs, options, host

    def capture(self, inputs: dict, options: dict):
        """(a): the training step's target pass (TargetWithDraft.forward's, world of one)."""
        from specdraft.train.model import target_features

        model = self.model
        return target_features(
            model.model,
            model.draft_model.capture_request(),
            inputs["input_ids"],
            inputs.get("document_positions"),
            inputs.get("document_ids"),
            position_ids=options.get("position_ids"),
            shard=model.sequence_parallel.shard(inputs["input_ids"].shape[1]),
        )

    def draft_step(self, inputs: dict, options: dict, host) -> None:
        """(b): the draft's loss, forward and backward, on the features captured once."""
        from specdraft.drafts.base import LossBatch

        own = {key: value for key, value in options.items() if key != "position_ids"}  # the target's, in (a)
        out = self.plain.training_loss(
            LossBatch(
                self.features,
                self.model.lm_head.weight,
                inputs["input_ids"],
                inputs["loss_mask"],
                self.cfg.loss_chunk_size,
                documents=inputs.get("document_ids"),
                host=host,
                options=own,
            )
        )
        out.loss.backward()
        self.plain.zero_grad(set_to_none=False)  # grads stay allocated, as in the engine

    def measure(self, result: Result, clock: Clock, memory: PeakMemory) -> None:
        result.phase = "build"
        deadline = time.perf_counter() + self.budget if self.budget > 0 else None
        self.build(result)
        # (c) first, after a dynamo reset: its first step pays every compilation, as a fresh run's does
        torch._dynamo.reset()
        result.phase = "(c) first step"
        before = dynamo_counts()
        first = clock.alone(self.train_step, 0)
        after_first = dynamo_counts()
        result.compiles_first = after_first["frames"] - before["frames"]
        result.phase = "(c) warm-up"
        for i in range(1, self.warmup):
            if deadline is not None and time.perf_counter() > deadline:
                break
            result.warm.append(clock.alone(self.train_step, i))
        result.phase = "(c) steps"
        memory.reset()  # the steady state's peak: what stays allocated (weights, optimizer state) and a step's
        c_times = clock.each(self.train_step, self.steps, start=self.warmup, deadline=deadline)
        if len(result.warm) < self.warmup - 1 or len(c_times) < self.steps:
            result.note = (
                f"--case-budget {self.budget:g} s reached: {len(result.warm)} of {self.warmup - 1} more "
                f"warm-up and {len(c_times)} of {self.steps} timed steps"
            )
        peak = memory.peak()
        after_c = dynamo_counts()  # (c) only: (a) and (b) run the plain draft, which training never does
        result.breaks = after_c["breaks"] - before["breaks"]
        tokens = self.tokens[-len(c_times) :]  # the timed steps'
        c = statistics.median(c_times)
        result.values.update(
            first_s=first,
            step_ms=c * 1e3,
            peak_gb=peak / 2**30,
            tokens=sum(tokens) / len(tokens),
            tokens_per_s=sum(tokens) / len(tokens) / c,
            recompiles=after_c["frames"] - after_first["frames"],
        )

        result.phase = "(a)"
        inputs, options, host = self.fixed_batch()
        capture = lambda _: self.capture(inputs, options)  # noqa: E731
        clock.each(capture, self.warmup)
        a = statistics.median(clock.each(capture, self.steps))
        result.phase = "(b)"
        self.features = self.capture(inputs, options)
        held = dict(self.engine.module.draft_model.named_parameters())
        self.plain.to(self.device)  # as the engine holds the draft: each parameter in its dtype, buffers kept
        for name, param in self.plain.named_parameters():
            param.data = param.data.to(held[name].dtype)
        step = lambda _: self.draft_step(inputs, options, host)  # noqa: E731
        clock.each(step, self.warmup)
        b = statistics.median(clock.each(step, self.steps))
        result.values.update(a_ms=a * 1e3, b_ms=b * 1e3, ratio=c / (a + b))
        result.phase = "done"

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.destroy()
        self.model = self.plain = self.features = self.data = None


def run_case(
    family: str,
    shape: Shape,
    device: torch.device,
    dtype: torch.dtype,
    work: Path,
    steps: int,
    warmup: int,
    clock: Clock,
    memory: PeakMemory,
    budget: float = 0.0,
) -> Result:
    result = Result(family, shape)
    result.held_before = memory.start_case()
    case = Case(family, shape, device, dtype, work, steps, warmup, budget)
    try:
        case.measure(result, clock, memory)
    except Skip as why:
        result.status, result.note = "skipped", str(why)
    except Exception as error:  # noqa: BLE001 - one case's failure is reported, the others still run
        if is_oom(error):
            result.status = "oom"
            result.note = f"out of memory in {result.phase}"
            if memory.cuda:
                result.note += f" ({torch.cuda.max_memory_allocated() / 2**30:.1f} GB allocated at most)"
        else:
            result.status, result.note = "error", f"{type(error).__name__} in {result.phase}: {str(error)[:200]}"
            print(f"{family} {shape.name}: {result.note}", file=sys.stderr)
            traceback.print_exc()
    finally:
        case.close()
    del case
    memory.start_case()  # the exception (its frames' tensors) is gone: free the cache now
    return result


def parse_args(argv: Optional[Sequence[str]] = None):
    """The arguments, and the families, shape names, --steps and --warmup they resolve to."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--families", default=",".join(FAMILY_ORDER))
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated, of {', '.join(SHAPES)} "
        f"(default: {DEFAULT_SHAPES['cuda']} on cuda, {DEFAULT_SHAPES['cpu']} on cpu)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed calls per phase (default 10 cuda, 2 cpu)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up calls per phase, the first step among (c)'s (default 3 cuda, 1 cpu)",
    )
    parser.add_argument(
        "--case-budget",
        type=float,
        default=0.0,
        help="seconds per case for its build and "
        "(c)'s steps: past it no further warm-up or timed step starts (the first step and one "
        "timed step always run); 0: no limit",
    )
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILY_ORDER]
    if unknown:
        parser.error(f"--families: unknown family {unknown[0]!r} (choose from {', '.join(FAMILY_ORDER)})")
    shape_names = [s.strip() for s in (args.shapes or DEFAULT_SHAPES[args.device]).split(",") if s.strip()]
    unknown = [s for s in shape_names if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown[0]!r} (choose from {', '.join(SHAPES)})")
    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.device][0]
    warmup = args.warmup if args.warmup is not None else DEFAULT_STEPS[args.device][1]
    if steps < 1 or warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step is (c)'s first warm-up step)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu runs the tiny preset)")
    return args, families, shape_names, steps, warmup


def main(argv: Optional[Sequence[str]] = None) -> List[Result]:
    args, families, shape_names, steps, warmup = parse_args(argv)
    # DeepSpeed picks its accelerator once, at its first use: the device asked for, whatever the shell says
    os.environ["DS_ACCELERATOR"] = args.device

    import logging

    from deepspeed.utils import logger as deepspeed_logger

    from specdraft.train.engine import init_distributed

    deepspeed_logger.setLevel(logging.ERROR)  # its per-engine notes would split the table
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    clock, memory = Clock(device), PeakMemory(device)
    print(header(device, dtype, steps, warmup), flush=True)
    print(COLUMNS, flush=True)
    work = Path(tempfile.mkdtemp(prefix="specdraft-gpu-step-"))
    results = []
    try:
        for name in shape_names:
            for family in families:
                result = run_case(
                    family, SHAPES[name], device, dtype, work, steps, warmup, clock, memory, args.case_budget
                )
                results.append(result)
                print(row(result), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(last_line(results), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(1 if any(r.status == "error" for r in main()) else 0)
