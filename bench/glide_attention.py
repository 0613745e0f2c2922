"""GLIDE's training attention: the dense (T, S)-mask path (still what decoding uses) against the
training path without (T, T) masks (is_causal / blocked sliding window), forward + backward of
the draft layer on the same inputs, CPU seconds, median of 3 after a warm-up.

    OMP_NUM_THREADS=1 python bench/glide_attention.py [--documents 200]

Last line: `dense_over_maskfree=<x>` at the longest sequence.
--documents N: packed conversations of N tokens instead, the training path on its dense document
masks (what other devices build, and CPU before) against CPU's own per-conversation path
(target/attention.py); last line `dense_over_slices=<x>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from specdraft.config import DraftConfig  # noqa: E402
from specdraft.drafts.registry import build_draft  # noqa: E402


def cpu_seconds(fn, rounds: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def documents(draft, conversation: int) -> None:
    from specdraft.drafts import layers

    print(
        f"GLIDE layer (hidden 512, 8 heads, window 512), conversations of {conversation} tokens, lag 2: "
        f"forward + backward, CPU s"
    )
    print(f"{'B x T':>8} {'dense masks':>12} {'slices':>10} {'ratio':>6}")
    ratio = 0.0
    for B, T in ((8, 256), (1, 1024), (1, 4096), (1, 8192)):
        torch.manual_seed(0)
        x = torch.randn(B, T, 512)
        cos, sin = torch.randn(B, T, 64), torch.randn(B, T, 64)
        keys, values = torch.randn(B, 4, T, 64), torch.randn(B, 4, T, 64)
        ids = (torch.arange(T) // conversation)[None].expand(B, T)
        seconds = {}
        for path in ("dense", "slices"):
            layers.attention_path = lambda device: path
            seconds[path] = cpu_seconds(
                lambda: draft.forward_sequence(x, cos, sin, keys, values, 2, ids).sum().backward()
            )
        ratio = seconds["dense"] / seconds["slices"]
        print(f"{f'{B}x{T}':>8} {seconds['dense']:12.3f} {seconds['slices']:10.3f} {ratio:6.2f}", flush=True)
    print(f"dense_over_slices={ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=0, help="packed conversations of this many tokens")
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    draft = build_draft(OmegaConf.structured(DraftConfig(sliding_window=512, max_lag=4)), config)
    if args.documents:
        return documents(draft, args.documents)
    print("GLIDE layer (hidden 512, 8 heads, window 512), batch 1, lag 2: forward + backward, CPU s")
    print(f"{'T':>6} {'dense masks':>12} {'mask-free':>10} {'ratio':>6}")
    ratio = 0.0
    for T in (1024, 4096):
        torch.manual_seed(0)
        x = torch.randn(1, T, 512)
        cos, sin = torch.randn(1, T, 64), torch.randn(1, T, 64)
        keys, values = torch.randn(1, 4, T, 64), torch.randn(1, 4, T, 64)
        index = torch.arange(T)

        def dense():
            draft(x, cos, sin, keys, values, cross_limit=index - 2, index=index).sum().backward()

        def mask_free():
            draft.forward_sequence(x, cos, sin, keys, values, 2).sum().backward()

        a, b = cpu_seconds(dense), cpu_seconds(mask_free)
        ratio = a / b
        print(f"{T:>6} {a:12.3f} {b:10.3f} {ratio:6.2f}", flush=True)
    print(f"dense_over_maskfree={ratio:.2f}")


if __name__ == "__main__":
    main()
