"""Peak resident memory of this process above a starting point (Linux /proc/self): how the CPU
benches (memory_model, long_context, zero3_placement, gpu_step's CPU twin) measure what a step
holds. The kernel's high-water mark (VmHWM) is reset to the current resident set (VmRSS) first, so
the peak counts what came after, not the imports before."""

from __future__ import annotations

from pathlib import Path


def status_bytes(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """VmHWM := VmRSS (clear_refs 5); returns the resident bytes now, the base a peak is taken above."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def peak_above(base: int) -> int:
    """Bytes of the high-water mark since reset_peak() above its base."""
    return status_bytes("VmHWM") - base
