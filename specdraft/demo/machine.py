"""The CPU a demo target was built on, kept in its stamp and printed beside bench figures: a
build's wall time depends on it (on an AVX2-only CPU torch has no native bf16 or AMX kernels)."""

from __future__ import annotations

import os
import platform

import torch


def this_cpu() -> dict:
    """{"capability": torch's CPU kernel level (AVX2, AVX512, AVX512_BF16, AMX, ...), "model",
    "cpus": the CPUs this process may run on, "threads": torch's intra-op threads}."""
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "model": _model_name(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def describe(cpu: dict) -> str:
    """One line for a report: "AMD EPYC, AVX2, 2 CPUs, 2 threads"."""
    return f"{cpu['model']}, {cpu['capability']}, {cpu['cpus']} CPUs, {cpu['threads']} threads"


def machine_line() -> str:
    """The line every bench report starts with: "machine: AMD EPYC, AVX2, 2 CPUs, 1 threads; load
    average 0.4 (1 min); ATEN_CPU_CAPABILITY=avx2" (the last part only when torch's kernels were
    capped below what the CPU has)."""
    line = f"machine: {describe(this_cpu())}"
    if hasattr(os, "getloadavg"):
        line += f"; load average {os.getloadavg()[0]:.1f} (1 min)"
    capped = os.environ.get("ATEN_CPU_CAPABILITY")
    return line + (f"; ATEN_CPU_CAPABILITY={capped}" if capped else "")


def _model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
