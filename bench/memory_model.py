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
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from specdraft.config import TrainConfig  # noqa: E402
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
# The real configs (Hugging Face Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json), written here
# because nothing can be downloaded on this machine.
QWEN3 = {
    "Qwen3-8B": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
    ),
    "Qwen3-32B": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
    ),
}
# Mixture-of-experts targets, shaped as the published config.json of openai/gpt-oss-20b and
# Qwen/Qwen3-30B-A3B on Hugging Face (written here: nothing can be downloaded on this machine).
# gpt-oss-20b's release stores its experts in MXFP4; training holds them in bf16, as the model
# counts them (every parameter at the run's precision).
MOE_TARGETS = {
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 12,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
                "rope_theta": 150000.0,
            },
            attention_bias=True,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen3-30B-A3B": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
GPU_BYTES = 80e9
USABLE = 0.9  # CUDA context, NCCL buffers and allocator fragmentation take the rest


# One CPU shape per family at growing T (batch 1, ZeRO-0, fp32): the family's own terms grow with T.
FAMILY_SHAPE = dict(
    layers=4, hidden=256, heads=4, kv_heads=2, intermediate=688, vocab=8000, batch=1, window=512, zero=0
)


def run_config(spec: dict, precision: str = "fp32"):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.precision = precision
    cfg.zero_stage = spec["zero"]
    cfg.per_device_batch_size = spec["batch"]
    cfg.max_seq_length = spec["seq"]
    cfg.draft.type = spec.get("family", "glide")
    if cfg.draft.type == "glide":
        cfg.draft.sliding_window = spec["window"]
    return cfg


def llama_config(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=4 * spec["seq"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


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
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    train_steps(spec, steps=2)
    print(json.dumps({"peak": _status("VmHWM") - base}))


def measure(spec: dict) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True, check=True
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


def qwen3_8b_table(seqs=(4096, 32768, 65536)) -> None:
    """Per family, the predicted per-GPU peak for Qwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed
    documents, and the longest context (a power of two from 4k) that fits."""
    from specdraft.drafts.registry import FAMILIES

    config = Qwen3Config(**QWEN3["Qwen3-8B"])
    print(
        f"\nQwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed documents: predicted GB per GPU "
        f"(fits: <= {USABLE:.0%} of 80 GB)"
    )
    print(f"| family | {' | '.join(f'{t // 1024}k' for t in seqs)} | longest that fits |")
    print(f"|---|{'---|' * len(seqs)}---|")
    from specdraft.drafts import family_keys

    families = {family: cls for family, cls in FAMILIES.items() if cls.drafts_for("qwen3")}
    rows = [(family, cls.label, False) for family, cls in families.items()]
    rows += [
        (family, f"{cls.label}, gradient_checkpointing", True)
        for family, cls in families.items()
        if "gradient_checkpointing" in family_keys(cls)
    ]
    for family, label, checkpointing in rows:

        def peak(seq):
            cfg = run_config(dict(zero=2, batch=1, seq=seq, window=512, family=family), precision="bf16")
            if checkpointing:
                cfg.draft.gradient_checkpointing = True
            return estimate_peak(config, cfg, world_size=8).total

        longest, seq = None, 4096
        while seq <= 262144 and peak(seq) <= USABLE * GPU_BYTES:
            longest, seq = seq, seq * 2
        cells = " | ".join(f"{peak(t) / 1e9:.1f}" for t in seqs)
        print(f"| {label} | {cells} | {f'{longest // 1024}k' if longest else 'under 4k'} |")


def moe_target_config(name: str):
    from transformers import AutoConfig

    model_type, fields = MOE_TARGETS[name]
    return AutoConfig.for_model(model_type, **fields)


def moe_target_rows(seqs=(4096, 32768, 65536)) -> None:
    """gpt-oss-20b and Qwen3-30B-A3B shaped targets, per family that drafts for them: the predicted
    per-GPU peak on 8 x 80 GB, bf16, batch 1, packed documents, at ZeRO-2 (the target replicated:
    every expert's weights on every GPU) and ZeRO-3 with the target partitioned, and the longest
    context (a power of two from 4k) that fits."""
    from specdraft.drafts.registry import FAMILIES
    from specdraft.train.memory import attention_tile_bytes, mlp_working_bytes
    from specdraft.target.moe import moe_shape

    print(
        f"\nMixture-of-experts targets, 8 x 80 GB, bf16, batch 1, packed documents: predicted GB per GPU "
        f"(fits: <= {USABLE:.0%} of 80 GB)"
    )
    for name in MOE_TARGETS:
        config = moe_target_config(name)
        moe = moe_shape(config)
        print(
            f"{name}: {moe.experts} experts, top {moe.top_k}, expert intermediate {moe.expert_intermediate}, "
            f"window {getattr(config, 'sliding_window', None) or '-'}; the capture's MLP holds "
            f"{mlp_working_bytes(config, 2) / 1024:.1f} KB per token (routed activations); one row of 32k "
            f"without packed documents adds an attention tile of "
            f"{attention_tile_bytes(config, 1, 32768, 2, documents=False) / 1e9:.2f} GB"
        )
    print(f"| target, family, ZeRO (target) | {' | '.join(f'{t // 1024}k' for t in seqs)} | longest that fits |")
    print(f"|---|{'---|' * len(seqs)}---|")
    for name in MOE_TARGETS:
        config = moe_target_config(name)
        for family, cls in FAMILIES.items():
            if not cls.drafts_for(config.model_type):
                continue
            for stage, placement in ((2, "replicated"), (3, "partitioned")):

                def peak(seq):
                    cfg = run_config(dict(zero=stage, batch=1, seq=seq, window=512, family=family), precision="bf16")
                    cfg.document_mask = True
                    return estimate_peak(config, cfg, world_size=8, target_placement=placement).total

                try:
                    peak(4096)
                except Exception as err:  # a refused cell (docs/targets.md): say so, one line
                    print(f"| {name}, {cls.label} | refused: {str(err).splitlines()[0][:80]} |")
                    break
                longest, seq = None, 4096
                while seq <= 262144 and peak(seq) <= USABLE * GPU_BYTES:
                    longest, seq = seq, seq * 2
                cells = " | ".join(f"{peak(t) / 1e9:.1f}" for t in seqs)
                print(
                    f"| {name}, {cls.label}, {stage} ({placement}) | {cells} | "
                    f"{f'{longest // 1024}k' if longest else 'under 4k'} |",
                    flush=True,
                )


def qwen3_8b_sequence_parallel_table(sizes=(1, 2, 4, 8)) -> None:
    """Per family, the longest context (a power of two from 4k to 1M) predicted to fit on 8 x 80 GB
    at each sequence_parallel_size: Qwen3-8B, ZeRO-2, bf16, batch 1, packed documents."""
    from specdraft.drafts import family_keys
    from specdraft.drafts.registry import FAMILIES

    config = Qwen3Config(**QWEN3["Qwen3-8B"])
    print(
        f"\nQwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed documents: longest context that fits "
        f"(<= {USABLE:.0%} of 80 GB per GPU) at sequence_parallel_size"
    )
    print(f"| family | {' | '.join(f'SP={s}' for s in sizes)} |")
    print(f"|---|{'---|' * len(sizes)}")
    sharded = {family: cls for family, cls in FAMILIES.items() if cls.sequence_parallel}
    rows = [(family, cls.label, False) for family, cls in sharded.items()]
    rows += [
        (family, f"{cls.label}, gradient_checkpointing", True)
        for family, cls in sharded.items()
        if "gradient_checkpointing" in family_keys(cls)
    ]
    for family, label, checkpointing in rows:
        cells = []
        for size in sizes:

            def peak(seq):
                cfg = run_config(dict(zero=2, batch=1, seq=seq, window=512, family=family), precision="bf16")
                if checkpointing:
                    cfg.draft.gradient_checkpointing = True
                return estimate_peak(config, cfg, world_size=8, sequence_parallel=size)

            longest, seq = None, 4096
            while seq <= 1 << 20 and peak(seq).total <= USABLE * GPU_BYTES:
                longest, seq = seq, seq * 2
            if longest:
                top = max(peak(longest).parts.items(), key=lambda kv: kv[1])
                cells.append(f"{longest // 1024}k ({top[0]} {top[1] / 1e9:.0f} GB)")
            else:
                cells.append("under 4k")
        print(f"| {label} | {' | '.join(cells)} |", flush=True)


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

    print(
        f"\nPredicted per-GPU peak, GLIDE, bf16, 8 GPUs of 80 GB (fits: <= {USABLE:.0%} of 80 GB, "
        f"no CPU offload); 4k at batch 2 (the shipped config), 16k at batch 1; packed documents "
        f"(document_mask: true):"
    )
    print(f"{'target':<10} {'seq':>4} {'ZeRO':>4} {'target placement':>16} {'GB':>6}  fits  largest parts (GB)")
    for name, values in QWEN3.items():
        config = Qwen3Config(**values)
        for seq, batch in ((4096, 2), (16384, 1)):
            for stage, placement in ((2, "replicated"), (3, "replicated"), (3, "partitioned")):
                cfg = run_config(dict(zero=stage, batch=batch, seq=seq, window=512), precision="bf16")
                est = estimate_peak(config, cfg, world_size=8, target_placement=placement)
                top = sorted(est.parts.items(), key=lambda kv: -kv[1])[:3]
                parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in top)
                fits = "yes" if est.total <= USABLE * GPU_BYTES else "no"
                print(
                    f"{name:<10} {seq // 1024:>3}k {stage:>4} {placement:>16} {est.total / 1e9:6.1f}  {fits:<4}  {parts}"
                )
    if not args.skip_check:
        print(f"memory_error={worst['warm']:.3f} memory_error_cold={worst['cold']:.3f}")


if __name__ == "__main__":
    main()
