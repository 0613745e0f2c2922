"""One GPU: every family through the user's commands on CUDA, and the CUDA-only kernels against
their references. Run on a machine with a GPU (CI has none):

    SPECDRAFT_HOME=DIR python bench/gpu_check.py --out OUT [--steps 30] [--families glide,eagle3]

DIR holds the demo assets (`specdraft demo` builds them: DIR/demo/target, DIR/demo/data). Per
family, at the same time on the one GPU: `specdraft train` of the demo config in bf16 twice (the
second run a repeat, the determinism baseline), a third run sent SIGTERM mid-way and rerun to
resume, then `specdraft eval --device cuda` of the finished run (greedy, fp32 and bf16). Prints
one line per family and OUT/summary.json; the last line is `key=value` pairs (bench/summary.py).

The kernel checks run first: EAGLE-3's TTT attention and the document-masked attention on CUDA
take flex_attention (compiled), which no CPU test runs with gradients; each is compared with the
dense-mask reference (values and gradients, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "glide": "demo",
    "eagle3": "demo-eagle3",
    "peagle": "demo-peagle",
    "dflash": "demo-dflash",
    "dspark": "demo-dspark",
}


def kernel_checks() -> dict:
    """flex (CUDA) against the dense reference, fp32, packed rows longer than one 128-token block."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_ttt_attention import dense_reference  # the CPU tests' reference

    from specdraft.target.attention import PackedDocuments, document_block_mask
    from specdraft.drafts.eagle3.ttt_attention import ttt_attention

    device, results = torch.device("cuda"), {}
    g = torch.Generator().manual_seed(0)
    T, B, heads, kv_heads, D = 300, 2, 4, 2, 32
    docs = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * T]).to(device)
    for step in (0, 3):
        q = torch.randn(B, heads, T, D, generator=g).to(device).requires_grad_()
        keys = [torch.randn(B, kv_heads, T, D, generator=g).to(device).requires_grad_() for _ in range(step + 1)]
        values = [torch.randn(B, kv_heads, T, D, generator=g).to(device).requires_grad_() for _ in range(step + 1)]
        grad = torch.randn(B, heads, T, D, generator=g).to(device)
        leaves = [q, *keys, *values]
        expected = dense_reference(q, keys, values, docs)
        expected_grads = torch.autograd.grad(expected, leaves, grad)
        got = ttt_attention(q, keys, values, PackedDocuments(docs, block_mask=document_block_mask(docs)))
        got_grads = torch.autograd.grad(got, leaves, grad)
        results[f"ttt_attention_step{step}"] = {
            "max_abs_diff": (got - expected).abs().max().item(),
            "max_abs_grad_diff": max((a - b).abs().max().item() for a, b in zip(got_grads, expected_grads)),
        }
    return results


def train_command(family: str, run_dir: Path, steps: int, precision: str) -> list:
    return [
        sys.executable,
        "-m",
        "specdraft",
        "train",
        str(REPO / "configs" / f"{CONFIGS[family]}.yaml"),
        f"output_dir={run_dir}",
        f"data_cache_dir={run_dir}-cache",
        f"precision={precision}",
        f"max_steps={steps}",
        "logging_steps=1",
        f"save_steps={steps}",
        "eval_steps=-1",
    ]


def start(command: list, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)


def losses(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def last_logged_step(run_dir: Path) -> int:
    return max(losses(run_dir), default=0)


def compare(a: dict, b: dict) -> dict:
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"steps": 0}
    diffs = [abs(a[s] - b[s]) for s in steps]
    return {"steps": len(steps), "identical": all(d == 0 for d in diffs), "max_abs_diff": max(diffs)}


def evaluate(run_dir: Path, prompts: Path, device: str, dtype: str, log: Path) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdraft",
            "eval",
            str(run_dir),
            "--prompts",
            str(prompts),
            "--device",
            device,
            "--dtype",
            dtype,
            "--max-prompts",
            "8",
            "--max-new-tokens",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"rc": done.returncode, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    report = json.loads(done.stdout)
    return {key: report.get(key) for key in ("tau", "matches_target", "speedup", "dtype")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script (fp32, no kernel checks)")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    assert torch.cuda.is_available() or not on_gpu, "no CUDA device"
    precision, dtypes = ("bf16", ("fp32", "bf16")) if on_gpu else ("fp32", ("fp32",))
    home = Path(os.environ["SPECDRAFT_HOME"])
    prompts = home / "demo" / "data" / "prompts.jsonl"
    work = args.out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    summary = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
    }
    started = time.perf_counter()
    try:
        summary["kernels"] = kernel_checks() if on_gpu else {}
    except Exception as error:  # report and go on: the family runs tell more
        summary["kernels"] = {"error": f"{type(error).__name__}: {error}"}
    print("kernels", json.dumps(summary["kernels"]), flush=True)

    runs = {}
    for family in families:
        for variant in ("straight", "repeat", "resumed"):
            run_dir = work / f"{family}-{variant}"
            runs[family, variant] = start(
                train_command(family, run_dir, args.steps, precision), work / f"{family}-{variant}.log"
            )
    interrupted, deadline = {}, started + args.timeout
    while time.perf_counter() < deadline and any(p.poll() is None for p in runs.values()):
        for family in families:
            proc = runs[family, "resumed"]
            if (
                family not in interrupted
                and proc.poll() is None
                and last_logged_step(work / f"{family}-resumed") >= args.steps // 2
            ):
                proc.send_signal(signal.SIGTERM)
                interrupted[family] = True
            if interrupted.get(family) is True and proc.poll() is not None:
                interrupted[family] = {"rc": proc.returncode, "at_step": last_logged_step(work / f"{family}-resumed")}
                runs[family, "resumed"] = start(
                    train_command(family, work / f"{family}-resumed", args.steps, precision),
                    work / f"{family}-resumed-2.log",
                )
        time.sleep(0.5)
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()

    summary["families"] = {}
    for family in families:
        result = {
            "train_rc": {v: runs[family, v].returncode for v in ("straight", "repeat", "resumed")},
            "interrupted": interrupted.get(family),
        }
        straight = losses(work / f"{family}-straight")
        result["first_last_loss"] = [straight[min(straight)], straight[max(straight)]] if straight else None
        result["repeat_vs_straight"] = compare(straight, losses(work / f"{family}-repeat"))
        result["resumed_vs_straight"] = compare(straight, losses(work / f"{family}-resumed"))
        summary["families"][family] = result
    # the evaluations at the same time too (each its own process, target and draft on the one GPU)
    jobs = [
        (family, dtype)
        for family in families
        for dtype in dtypes
        if summary["families"][family]["train_rc"]["straight"] == 0
    ]
    with ThreadPoolExecutor(max_workers=len(jobs) or 1) as pool:
        reports = pool.map(
            lambda job: evaluate(
                work / f"{job[0]}-straight", prompts, args.device, job[1], work / f"{job[0]}-eval-{job[1]}.log"
            ),
            jobs,
        )
        for (family, dtype), report in zip(jobs, reports):
            summary["families"][family][f"eval_{dtype}"] = report
    for family in families:
        print(family, json.dumps(summary["families"][family]), flush=True)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    ok = [
        f
        for f, r in summary["families"].items()
        if r["train_rc"] == {"straight": 0, "repeat": 0, "resumed": 0}
        and (r.get("eval_fp32") or {}).get("matches_target")
    ]
    print(
        f"device={summary['device'].replace(' ', '_')} families_ok={len(ok)}/{len(families)} "
        f"seconds={summary['seconds']}"
    )
    return 0 if len(ok) == len(families) else 1


if __name__ == "__main__":
    sys.exit(main())
