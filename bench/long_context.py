"""Peak memory of one training step per family as the context grows, measured on CPU.

    OMP_NUM_THREADS=1 python bench/long_context.py [--families glide,eagle3,dflash,dspark,peagle] [--lengths 2048,4096,8192]
        [--no-documents] [--path slices|dense] [--flex-sizes] [--mask-peak] [--sp N] [--live]

Each (family, T) runs in a fresh process: a random target shaped like the demo target (Llama,
4 layers, hidden 256, vocab 4096), the family's draft with the demo configs' keys, one batch of
one packed row of T tokens (DFlash, DSpark: 512 blocks, the default) (conversations of 512 tokens, so the document path runs), capture +
loss + backward, no DeepSpeed. Peak = the high-water mark of resident memory (VmHWM, reset
after set-up through /proc/self/clear_refs) minus the resident memory at that moment; glibc
serves allocations above 64 KiB with mmap so freed tensors leave RSS at once. Also printed:
tokens/s of the step. The last line gives `<family>_growth=` peak(T_max) / peak(T_max / 2):
2.0 is linear in T, 4.0 quadratic.

--path: how the drafts attend packed documents (target/attention.py): `slices`, CPU's own path
(per conversation), or `dense`, the masks other devices build (what CPU built before). The flex
path of CUDA has no backward on CPU: --flex-sizes prints instead the bytes of the block masks it
builds per batch (made here with the same mask_mods) beside those of the dense masks;
--mask-peak the peak RSS of building one (GLIDE's lagged cross-attention mask, T x T) eager and
compiled on CPU, as CUDA builds it (eager create_block_mask evaluates the whole (B, 1, T, T) grid).

--sp N: each (family, T) also at sequence_parallel_size N on N CPU ranks (torchrun, gloo): the peak
of the rank with the highest one, its ratio to SP=1 (the step's own peak: the sequence-proportional
terms; the weights, the same on every rank, are in the base RSS it is measured above), and the
step-time ratio SP=N / SP=1. Beside every peak: the memory model's terms above weights,
gradients and optimizer state for that shape and SP size (train/memory.py), and peak ÷ model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import resident_memory  # noqa: E402

ROW_CONVERSATION = int(os.environ.get("BENCH_CONVERSATION", 512))  # tokens per packed conversation; 0: one per row
SP = int(os.environ.get("BENCH_SP", 1))  # ranks per sequence (the child runs under torchrun when > 1)
PATH = os.environ.get("BENCH_PATH", "slices")  # the drafts' document attention path: slices (CPU's) or dense
LIVE = os.environ.get("BENCH_LIVE") == "1"  # peak of live tensor bytes instead of resident memory


def force_path(path: str) -> None:
    from specdraft.drafts import layers
    from specdraft.target import attention as documents
    from specdraft.drafts.dflash import blocks as dflash_blocks

    for module in (documents, layers, dflash_blocks):
        module.attention_path = lambda device: path


def measure_one(family: str, T: int) -> dict:
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.config import TrainConfig
    from specdraft.demo.presets import get_preset
    from specdraft.drafts.base import HostBatch
    from specdraft.drafts.registry import build_draft
    from specdraft.train.model import TargetWithDraft

    torch.manual_seed(0)
    force_path(PATH)
    p = get_preset("demo")
    config = LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=2 * T,
        tie_word_embeddings=False,
        dtype="float32",
    )
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    cfg = OmegaConf.structured(TrainConfig).draft
    cfg.type = family
    cfg.update(
        {
            "glide": {"sliding_window": 512},
            "eagle3": {"ttt_steps": 7},
            "dflash": {"num_layers": 2, "block_size": 8, "max_anchors": 512},
            "dspark": {"num_layers": 2, "block_size": 8, "max_anchors": 512, "markov_rank": 64},
            "peagle": {"num_depths": 8},
        }[family]
    )
    sp = {}
    if SP > 1:
        import torch.distributed as dist

        from specdraft.parallel.sequence import sequence_parallel_groups

        dist.init_process_group("gloo")
        sp = {"sequence_parallel": sequence_parallel_groups(SP)}
    model = TargetWithDraft(target, build_draft(cfg, config), loss_chunk_size=0, **sp)
    ids = torch.randint(0, p.vocab_size, (1, T))
    conversation = ROW_CONVERSATION or T
    documents = (torch.arange(T) // conversation)[None] if ROW_CONVERSATION else None
    positions = (torch.arange(T) % conversation)[None]
    mask = (positions >= conversation // 3).long()
    options = model.draft_model.sample_batch_options(torch.Generator().manual_seed(0), T)

    def step():
        out = model(
            ids,
            mask,
            document_positions=positions,
            document_ids=documents,
            host=HostBatch(ids, mask, documents),
            **options,
        )
        out.loss.backward()
        model.draft_model.zero_grad(
            set_to_none=False
        )  # kept: the gradients are in the base, as the model's fixed terms

    step()  # warm-up: lazily made buffers, allocator state
    base = resident_memory.reset_peak()
    start = time.perf_counter()
    if LIVE:
        from specdraft.train.live_bytes import LiveTensorBytes

        with LiveTensorBytes() as live:
            step()
        peak_gb = live.peak / 2**30
    else:
        step()
        peak_gb = resident_memory.peak_above(base) / 2**30
    seconds = time.perf_counter() - start
    result = {
        "family": family,
        "T": T,
        "peak_gb": peak_gb,
        "tokens_per_s": T / seconds,
        "model_gb": modelled_step_gb(config, cfg, T),
    }
    if SP > 1:  # the rank with the highest peak, the slowest step
        ranks = [None] * SP
        dist.all_gather_object(ranks, result)
        result = {
            "family": family,
            "T": T,
            "peak_gb": max(r["peak_gb"] for r in ranks),
            "tokens_per_s": min(r["tokens_per_s"] for r in ranks),
            "model_gb": result["model_gb"],
        }
        dist.destroy_process_group()
    return result


def modelled_step_gb(target_config, draft_cfg, T: int) -> float:
    """What the memory model (train/memory.py) puts above the weights, gradients and optimizer
    state for this step at SP: the terms the measured peak counts (it is taken above the
    resident weights). fp32, one row of T tokens, packed documents as measured."""
    from omegaconf import OmegaConf

    from specdraft.config import TrainConfig
    from specdraft.train import memory

    cfg = OmegaConf.structured(TrainConfig)
    cfg.draft = draft_cfg
    cfg.precision, cfg.per_device_batch_size, cfg.max_seq_length, cfg.loss_chunk_size = "fp32", 1, T, 0
    estimate = memory.estimate_peak(
        target_config, cfg, world_size=SP, documents=bool(ROW_CONVERSATION), sequence_parallel=SP
    )
    fixed = ("target weights", "draft weights", "draft grads", "optimizer (fp32 master + Adam m, v)")
    return (estimate.total - sum(estimate.parts.get(name, 0) for name in fixed)) / 2**30


def flex_sizes(T: int, window: int = 512, lag: int = 2, anchors: int = 512, block: int = 8) -> None:
    """Bytes of the block masks the CUDA path builds for one packed row of T tokens (conversations
    of ROW_CONVERSATION), beside the dense masks of the same rules (bool; SDPA adds a float copy)."""
    import torch

    from specdraft.drafts.base import document_starts
    from specdraft.drafts.dflash.blocks import BlockVisibility
    from specdraft.target.attention import document_block_mask
    from specdraft.drafts.layers import lagged_block_mask, window_block_mask

    def nbytes(mask) -> int:
        return sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))

    documents = (torch.arange(T) // (ROW_CONVERSATION or T))[None]
    starts = torch.arange(1, T - block, (T - block) // anchors)[:anchors][None]
    visibility = BlockVisibility(starts, T, block, document_starts(documents).gather(1, starts))
    blocked = -(-T // window) * window * 2 * window  # the dense path's band: blocks of (window, 2 window)
    rows = [
        ("GLIDE window", window_block_mask(documents, window), T * T if T <= 2 * window else blocked),
        ("GLIDE cross", lagged_block_mask(documents, lag), (T - lag) ** 2),
        ("EAGLE-3 causal", document_block_mask(documents), T * T),
        ("DFlash blocks", visibility.block_mask(), visibility.query_len * (T + visibility.query_len)),
    ]
    for name, mask, dense in rows:
        print(f"{name:<15} T={T:>6} block mask {nbytes(mask) / 2**10:10.1f} KiB   dense mask {dense / 2**20:10.1f} MiB")


def mask_build_peak(mode: str, T: int) -> dict:
    """Peak RSS above the start of building GLIDE's cross-attention block mask once (after a
    warm-up build of the same shape, which compiles): `eager` or `compiled` create_block_mask."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from specdraft.drafts import layers

    build = torch.compile(create_block_mask) if mode == "compiled" else create_block_mask
    layers.make_block_mask = lambda mask_mod, B, q, kv, device: build(mask_mod, B, None, q, kv, device=device)
    documents = (torch.arange(T) // (ROW_CONVERSATION or T))[None]
    layers.lagged_block_mask(documents, 2)  # warm-up (compiles)
    base = resident_memory.reset_peak()
    layers.lagged_block_mask(documents, 2)
    return {"mode": mode, "T": T, "peak_mib": resident_memory.peak_above(base) / 2**20}


def compiled_masks_equal_eager(T: int = 300) -> bool:
    """Every family's block mask (GLIDE window and lag, EAGLE-3, DFlash) built compiled, as CUDA
    builds it, equals the eager one: the mask_mods trace (on CPU's inductor here)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from specdraft.drafts import layers
    from specdraft.target import attention as docs_module
    from specdraft.drafts.dflash import blocks as dflash_blocks
    from specdraft.drafts.base import document_starts

    documents = (torch.arange(T) // 100)[None].expand(2, T).clone()
    documents[1] = 0
    anchors = torch.tensor([[1, 2, 50, 99, 101, 130, 199, 251], [1, 3, 64, 127, 128, 200, 255, 290]])
    starts = document_starts(documents).gather(1, anchors)

    def masks():
        return [
            layers.window_block_mask(documents, 16),
            layers.lagged_block_mask(documents, 2),
            docs_module.document_block_mask(documents),
            dflash_blocks.BlockVisibility(anchors, T, 4, starts).block_mask(),
        ]

    eager = masks()
    compiled = torch.compile(create_block_mask)
    for module in (docs_module, layers, dflash_blocks):
        module.make_block_mask = lambda mask_mod, B, q, kv, device: compiled(mask_mod, B, None, q, kv, device=device)

    def tensors(mask):
        return [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]

    return all(
        len(tensors(a)) == len(tensors(b)) and all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b)))
        for a, b in zip(eager, masks())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="glide,eagle3,dflash")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--no-documents", action="store_true", help="one conversation per row (no borders)")
    parser.add_argument(
        "--path",
        default="slices",
        choices=("slices", "dense"),
        help="the drafts' document attention on CPU: per conversation (its own) or dense",
    )
    parser.add_argument("--flex-sizes", action="store_true", help="bytes of the CUDA path's block masks")
    parser.add_argument("--mask-peak", action="store_true", help="peak RSS of building a block mask, eager vs compiled")
    parser.add_argument("--sp", type=int, default=1, help="also at sequence_parallel_size N on N CPU ranks")
    parser.add_argument("--live", action="store_true", help="peak of live tensor bytes instead of resident memory")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # family:T, in the child process
    parser.add_argument("--one-mask", help=argparse.SUPPRESS)  # mode:T, in the child process
    args = parser.parse_args()
    if args.one_mask:
        mode, T = args.one_mask.split(":")
        print(json.dumps(mask_build_peak(mode, int(T))))
        return
    if args.mask_peak:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        for T in (int(t) for t in args.lengths.split(",")):
            for mode in ("eager", "compiled"):
                run = subprocess.run(
                    [sys.executable, __file__, "--one-mask", f"{mode}:{T}"], env=env, capture_output=True, text=True
                )
                out = (run.stdout if run.returncode == 0 else run.stderr).strip().splitlines()[-1]
                print(f"T={T:>6} {mode:<8} {out}", flush=True)
        print(f"compiled_masks_equal_eager={compiled_masks_equal_eager()}")
        return
    if args.flex_sizes:
        for T in (int(t) for t in args.lengths.split(",")):
            flex_sizes(T)
        return
    if args.one:
        family, T = args.one.split(":")
        result = measure_one(family, int(T))
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(result))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", DS_ACCELERATOR="cpu", BENCH_PATH=args.path)
    if args.no_documents:
        env["BENCH_CONVERSATION"] = "0"
    if args.live:
        env["BENCH_LIVE"] = "1"
    lengths = [int(t) for t in args.lengths.split(",")]
    print(f"{'family':<7} {'T':>6} {'SP':>3} {'peak GB/rank':>12} {'model GB':>9} {'÷ model':>7} {'tokens/s':>9}")
    peaks = {}
    for family in args.families.split(","):
        for T in lengths:
            for sp in sorted({1, args.sp}):
                launcher = (
                    [sys.executable]
                    if sp == 1
                    else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp)]
                )
                run = subprocess.run(
                    [*launcher, __file__, "--one", f"{family}:{T}"],
                    env=dict(env, BENCH_SP=str(sp)),
                    capture_output=True,
                    text=True,
                )
                if run.returncode:
                    print(f"{family:<7} {T:>6} {sp:>3} failed: {run.stderr.strip().splitlines()[-1]}", flush=True)
                    continue
                m = json.loads(run.stdout.strip().splitlines()[-1])
                peaks[family, T, sp], rate = m["peak_gb"], m["tokens_per_s"]
                peaks[family, T, sp, "rate"] = rate
                ratio = (
                    ""
                    if sp == 1 or (family, T, 1) not in peaks
                    else (
                        f"  peak/rank vs SP=1 {m['peak_gb'] / peaks[family, T, 1]:.2f}, step time vs SP=1 "
                        f"{peaks[family, T, 1, 'rate'] / rate:.2f}"
                    )
                )
                print(
                    f"{family:<7} {T:>6} {sp:>3} {m['peak_gb']:12.2f} {m['model_gb']:9.2f} "
                    f"{m['peak_gb'] / m['model_gb']:7.2f} {rate:9.0f}{ratio}",
                    flush=True,
                )
    peaks = {
        (family, T): peaks[family, T, 1]
        for family in args.families.split(",")
        for T in lengths
        if (family, T, 1) in peaks
    }
    top = max(lengths)
    print(
        " ".join(
            f"{family}_growth={peaks[family, top] / peaks[family, top // 2]:.2f}"
            for family in args.families.split(",")
            if (family, top) in peaks and (family, top // 2) in peaks
        )
    )


if __name__ == "__main__":
    main()
