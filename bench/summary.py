"""Run every bench script and print one table of their machine-readable last lines.

    python bench/summary.py [--only step_efficiency,memory_model]

Each script ends with one line of `key=value` pairs (its headline numbers); the table shows them
with the script's wall time. A script that fails or prints no such line is reported as such.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from specdraft.demo.machine import machine_line  # noqa: E402

SCRIPTS = [
    "target_weights",
    "checkpoint",
    "acceptance",
    "step_efficiency",
    "memory_model",
    "zero3_placement",
    "glide_attention",
    "regenerate",
    "offline",
]
LAST_LINE = re.compile(r"^(\w+=\S+)(\s+\w+=\S+)*\s*$")


def run(name: str) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCH / f"{name}.py")], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    sys.stdout.write(done.stdout)  # the full report stays visible above the table
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return name, f"FAILED (exit {done.returncode}): {tail[:80]}", seconds
    if not lines or not LAST_LINE.match(lines[-1]):
        return name, "(no key=value last line)", seconds
    return name, lines[-1], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SCRIPTS))
    args = parser.parse_args()
    rows = []
    print(machine_line(), flush=True)
    for name in args.only.split(","):
        print(f"== bench/{name}.py", flush=True)
        rows.append(run(name))
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{machine_line()}\n\n| bench | result | wall s |\n|---|---|---|")
    for name, result, seconds in rows:
        print(f"| {name:<{width}} | {result} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
