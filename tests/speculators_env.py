"""Run a script under vLLM's `speculators` package, which lives in a venv of its own.

speculators 0.9.0 needs transformers 5.0-5.19 while specdraft is tested with 5.23, so the two
cannot share a venv: `make speculators-venv` (a dependency of `make test`) builds
.venv-speculators, and tests hand it scripts that print one JSON object on their last stdout line.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import tempfile
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
    reason = (
        f"no speculators venv at {python} (build it with `make speculators-venv`, "
        f"or point {PYTHON_ENV_VAR} at a python with speculators==0.9.0)"
    )
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


# The venv's interpreter, started once per pytest process: it imports torch, transformers and
# speculators (~7 s of CPU each time) and then forks a child per script, so every script runs in a
# process of its own, as from a fresh interpreter (nothing one script patches or seeds reaches the
# next), without paying the imports again.
SERVER = r"""
import importlib, json, os, runpy, sys, tempfile, traceback

protocol = os.fdopen(os.dup(1), "w")  # the replies; anything else written to fd 1 goes to the log
os.dup2(2, 1)
import torch, transformers  # noqa: F401
for name in ("speculators.model", "speculators.models.eagle3", "speculators.models.dflash",
             "speculators.models.dspark", "speculators.models.peagle", "speculators.models.mtp",
             "speculators.convert.mtp.converter", "speculators.losses", "safetensors.torch"):
    try:
        importlib.import_module(name)
    except Exception:  # the script that needs it reports the error itself
        pass
for line in sys.stdin:
    request = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: the script, its stdout and stderr (fds 1 and 2) in files
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = [request["path"] or "-c", *request["args"]]
            code = 0
            try:
                if request["path"]:
                    sys.path.insert(0, os.path.dirname(request["path"]))  # as `python FILE` has it
                    runpy.run_path(request["path"], run_name="__main__")
                else:
                    exec(compile(request["source"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        status = os.waitpid(pid, 0)[1]
        out.seek(0)
        err.seek(0)
        protocol.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                   "stdout": out.read().decode(errors="replace"),
                                   "stderr": err.read().decode(errors="replace")}) + "\n")
        protocol.flush()
"""
_server = None


def _start_server(python: Path) -> subprocess.Popen:
    # Our PYTHONPATH points at specdraft, built for another transformers; the hub stays offline
    # because every test hands it local directories.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = tempfile.TemporaryFile()  # the server's own stderr (an import that failed)
    proc = subprocess.Popen(
        [str(python), "-c", SERVER],
        env=env,
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    proc.log = log
    atexit.register(_stop_server, proc)
    return proc


def _stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: the server and a script it runs
        proc.wait()


def _run(path, source, args, timeout: float) -> subprocess.CompletedProcess:
    """One script in the venv (a file, or Python source as `python -c`), through the server."""
    global _server
    python = require_speculators_python()
    if _server is None or _server.poll() is not None:
        _server = _start_server(python)
    proc = _server
    proc.stdin.write(json.dumps({"path": path and str(path), "source": source, "args": [str(a) for a in args]}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline() if select.select([proc.stdout], [], [], timeout)[0] else None
    if not line:
        _stop_server(proc)
        _server = None
        proc.log.seek(0)
        why = "ran past its timeout" if line is None else "lost its server"
        raise AssertionError(
            f"speculators script {why} ({timeout}s):\n{proc.log.read().decode(errors='replace')[-4000:]}"
        )
    result = json.loads(line)
    return subprocess.CompletedProcess(path or "-c", result["returncode"], result["stdout"], result["stderr"])


def run_speculators_file(path: Path, *args, timeout: float = 300) -> str:
    """Run the script file `path` with `args` in the speculators venv; its stdout, or a failure
    with its stderr's tail."""
    run = _run(path, None, args, timeout)
    assert run.returncode == 0, f"{Path(path).name} exited {run.returncode}:\n{run.stderr[-3000:]}"
    return run.stdout


def run_in_speculators(script: str, *args, timeout: float = 600) -> dict:
    """Run `script` (Python source) in the speculators venv; return its last stdout line as JSON."""
    proc = _run(None, script, args, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"speculators script exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise AssertionError(f"speculators script printed nothing; stderr:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
