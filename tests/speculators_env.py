"""Run a script under vLLM's `speculators` package, which lives in a venv of its own.

speculators 0.9.0 needs transformers 5.0-5.19 while specdraft is tested with 5.23, so the two
cannot share a venv: `make speculators-venv` (a dependency of `make test`) builds
.venv-speculators, and tests hand it scripts that print one JSON object on their last stdout line.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON_ENV_VAR = "SPECDRAFT_SPECULATORS_PYTHON"
DEFAULT_PYTHON = REPO / ".venv-speculators" / "bin" / "python"


def speculators_python() -> Path:
    """The speculators venv's interpreter: $SPECDRAFT_SPECULATORS_PYTHON, else the Makefile's."""
    return Path(os.environ.get(PYTHON_ENV_VAR) or DEFAULT_PYTHON)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_speculators_python() -> Path:
    """The interpreter, or a failure in CI (it must be built there) / a skip elsewhere."""
    python = speculators_python()
    if python.is_file():
        return python
    reason = (f"no speculators venv at {python} (build it with `make speculators-venv`, "
              f"or point {PYTHON_ENV_VAR} at a python with speculators==0.9.0)")
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def run_in_speculators(script: str, *args, timeout: float = 600) -> dict:
    """Run `script` (Python source) in the speculators venv; return its last stdout line as JSON."""
    python = require_speculators_python()
    # Our PYTHONPATH points at specdraft, built for another transformers; the hub stays offline
    # because every test hands it local directories.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(python), "-c", script, *map(str, args)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"speculators script exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise AssertionError(f"speculators script printed nothing; stderr:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
