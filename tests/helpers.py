"""Shared by the training tests: a small chat dataset from stdlib sources, a run's overrides."""

import inspect
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_chat_files(out_dir: Path, modules=("json", "textwrap", "string", "shlex", "fnmatch", "glob",
                                              "posixpath", "random", "calendar")) -> list:
    """Two jsonl files of (function name -> its source) conversations; deterministic."""
    import importlib

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in modules:
        module = importlib.import_module(name)
        for fn_name, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            rows.append({"conversations": [{"role": "user", "content": f"Write {name}.{fn_name}"},
                                           {"role": "assistant", "content": source[:400]}]})
    files = []
    for i, part in enumerate((rows[::2], rows[1::2])):
        path = out_dir / f"part{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        files.append(path)
    return files


def run_overrides(target_dir, data_dir, out_dir, cache_dir, **extra) -> list:
    values = dict(target=target_dir, data_files=f"{data_dir}/*.jsonl", output_dir=out_dir,
                  data_cache_dir=cache_dir, max_seq_length=64, per_device_batch_size=4,
                  learning_rate=1e-2, warmup_steps=2, logging_steps=1, seed=3)
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def torchrun(script: Path, *args, port: int, timeout=240):
    """Run a script on 2 CPU ranks (gloo); returns the CompletedProcess."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
