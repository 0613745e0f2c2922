"""Peak memory and time: reading the target's embeddings and lm_head directly vs building the model.

    python bench/target_weights.py [--workdir DIR] [--keep] [--layers 4] [--hidden 2048] [--tied]

Builds a random bf16 Qwen3-like checkpoint (large vocab, few layers, sharded, >= 1 GB by default)
with save_pretrained, then runs each way of getting the two tensors in a fresh subprocess that
reports its own peak RSS (ru_maxrss):
  baseline  imports torch, transformers and specdraft, loads nothing
  light     specdraft.target.weights.load_target_head_weights
  full      AutoModelForCausalLM.from_pretrained(dtype=bf16) + get_input/output_embeddings
  full-used the same, then every parameter read (what .to(device) or a forward pass does)
Each child reads every page of what it keeps (timed too): mapped pages count only once read.
Peak above baseline isolates what the loading itself costs.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20


# ------------------------------------------------------------------ work done inside the children


def _import_everything():
    # Every child imports the same modules so the baseline subtracts the same import cost.
    import torch
    import transformers  # noqa: F401

    import specdraft.target.weights  # noqa: F401

    return torch


def child_build(checkpoint: Path, args) -> dict:
    torch = _import_everything()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=128,
        tie_word_embeddings=args.tied,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # allocate bf16 from the start: no fp32 copy of 1+ GB
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(checkpoint, max_shard_size=args.shard_size)
    return {"seconds": 0.0}


def child_baseline(checkpoint: Path, args) -> dict:
    _import_everything()
    return {"seconds": 0.0}


def child_light(checkpoint: Path, args) -> dict:
    _import_everything()
    from specdraft.target.weights import load_target_head_weights

    started = time.perf_counter()
    head = load_target_head_weights(checkpoint)
    tensors = [head.embed_tokens] if head.tied else [head.embed_tokens, head.lm_head]
    touch(tensors)
    return {
        "seconds": time.perf_counter() - started,
        "tied": head.tied,
        "tensor_bytes": sum(tensor.numel() * tensor.element_size() for tensor in tensors),
    }


def child_full(checkpoint: Path, args, use_whole_model: bool = False) -> dict:
    torch = _import_everything()
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    touch(list(model.parameters()) if use_whole_model else [embed, lm_head])
    return {"seconds": time.perf_counter() - started, "tied": lm_head is embed}


def touch(tensors) -> None:
    """Read one element per 4 KiB page, as copying or using the tensors would fault every page in.

    transformers 5 memory-maps safetensors and leaves same-dtype weights on the mapping, so a
    freshly loaded model costs little RSS until its pages are read.
    """
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        flat[:: max(1, 4096 // tensor.element_size())].float().sum()


CHILDREN = {
    "build": child_build,
    "baseline": child_baseline,
    "light": child_light,
    "full": child_full,
    "full-used": lambda checkpoint, args: child_full(checkpoint, args, use_whole_model=True),
}


def run_child(name: str, checkpoint: Path, args) -> None:
    result = CHILDREN[name](checkpoint, args)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps(result))


# --------------------------------------------------------------------------------- the driver


def spawn(name: str, checkpoint: Path, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--checkpoint",
        str(checkpoint),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--shard-size",
        args.shard_size,
    ] + (["--tied"] if args.tied else [])
    finished = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(finished.stdout.strip().splitlines()[-1])


def checkpoint_bytes(checkpoint: Path) -> tuple[int, int]:
    files = list(checkpoint.glob("*.safetensors"))
    return sum(path.stat().st_size for path in files), len(files)


def report(args, checkpoint: Path, runs: dict[str, dict]) -> None:
    size, files = checkpoint_bytes(checkpoint)
    baseline, light = runs["baseline"]["peak_rss"], runs["light"]
    above = {name: run["peak_rss"] - baseline for name, run in runs.items()}
    tensors = "embed_tokens, tied lm_head" if light["tied"] else "embed_tokens + lm_head"
    print(
        f"checkpoint: {size / MIB:.0f} MiB in {files} safetensors shards; Qwen3-like bf16, "
        f"vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"{'tied' if args.tied else 'untied'}"
    )
    print(
        f"tensors read: {light['tensor_bytes'] / MIB:.0f} MiB ({tensors}); "
        f"checkpoint / tensors = {size / light['tensor_bytes']:.2f}"
    )
    labels = {
        "baseline": "baseline (imports only)",
        "light": "light reader",
        "full": "from_pretrained, 2 tensors read",
        "full-used": "from_pretrained, all params read",
    }
    for name, label in labels.items():
        print(
            f"{label:33s} peak RSS {runs[name]['peak_rss'] / MIB:6.0f} MiB  "
            f"(+{above[name] / MIB:5.0f} MiB)  load+read {runs[name]['seconds']:6.2f} s"
        )
    print(f"light above baseline / tensor bytes  = {above['light'] / light['tensor_bytes']:.3f}  (goal <= 1.3)")
    for name in ("full", "full-used"):
        print(
            f"{labels[name]} / light, above baseline = {above[name] / above['light']:.2f}  "
            f"(goal >= 5); raw peaks {runs[name]['peak_rss'] / light['peak_rss']:.2f}; "
            f"load time {runs[name]['seconds'] / light['seconds']:.1f}x"
        )
    print(
        f"light_rss_ratio={above['light'] / light['tensor_bytes']:.3f} "
        f"full_used_over_light={above['full-used'] / above['light']:.2f}"
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where to build the checkpoint (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint instead of deleting it")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--shard-size", default="500MB")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(args.child, args.checkpoint, args)
        return
    workdir = Path(tempfile.mkdtemp(prefix="specdraft-bench-", dir=args.workdir))
    checkpoint = workdir / "target"
    try:
        started = time.perf_counter()
        spawn("build", checkpoint, args)
        print(f"built {checkpoint} in {time.perf_counter() - started:.0f} s")
        runs = {name: spawn(name, checkpoint, args) for name in ("baseline", "light", "full", "full-used")}
        report(args, checkpoint, runs)
    finally:
        if args.keep:
            print(f"kept {checkpoint}")
        else:
            shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
