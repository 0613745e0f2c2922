"""GLIDE's training attention: the dense (T, S)-mask path (still what decoding uses) against the
training path without (T, T) masks (is_causal / blocked sliding window), forward + backward of
the draft layer on the same inputs, CPU seconds, median of 3 after a warm-up.

    OMP_NUM_THREADS=1 python bench/glide_attention.py

Last line: `dense_over_maskfree=<x>` at the longest sequence.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from specdraft.config import DraftConfig  # noqa: E402
from specdraft.drafts import build_draft  # noqa: E402


def cpu_seconds(fn, rounds: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4)
    draft = build_draft(OmegaConf.structured(DraftConfig(sliding_window=512, max_lag=4)), config)
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
