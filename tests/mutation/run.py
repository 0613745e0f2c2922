"""`make mutation`: apply each semantic mutation to a temporary copy of the tree, run its tests.

    python tests/mutation/run.py                 every mutation (tests/mutation/mutations.py)
    python tests/mutation/run.py -k glide/label  only names containing a substring (repeatable)
    python tests/mutation/run.py --list          the mutations, no run
    python tests/mutation/run.py --workers 1     one mutant at a time (default: one per core)
    python tests/mutation/run.py --fork          tests in forks of one preloaded process (faster)
    python tests/mutation/run.py --no-whole-suite   a survivor of its own tests is not run on the suite

The working tree is never written: the files git tracks (plus untracked, not ignored ones) are
copied to a temporary directory per worker, each mutant is written there and the original put
back after its run, and pytest runs with that copy first on PYTHONPATH. A mutant runs only the
tests it names; one they let survive then faces the whole suite before it counts as survived.
A run that times out kills nothing: the mutant is reported as a timeout. A kill counts only if
what killed it passes on the unmutated tree: after the mutants, the distinct killing tests run
once, unmutated (a broken test would make every mutant it runs look killed); a kill that names no
test (a crash) reruns the very run that failed, its own tests or the whole suite. Exit status 1
when a mutation survives or times out, its snippet is not found exactly once, or what killed it
fails unmutated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import signal
import threading
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation, all_mutations  # noqa: E402

Outcome = Tuple[str, float, str]  # ("passed" | "failed" | "timeout", seconds, the FAILED/ERROR lines or the last lines)
WHOLE_SUITE = ("tests",)
# What a test run must not inherit from the process that starts it: a launcher's rank variables
# (a pytest worker that trained sets MASTER_PORT, which its own process group holds) and
# pytest-xdist's (the session fixtures would build in the wrong basetemp).
INHERITED_NOT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST")


def copy_tree(destination: Path) -> None:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # deleted-but-tracked files are skipped
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)  # configs/demo*.yaml stay links


def test_env(tree: Path, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT and not k.startswith("PYTEST_XDIST")}
    env.update(
        PYTHONPATH=str(tree),
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
        **(extra or {}),
    )
    return env


def pytest_args(args: Tuple[str, ...], first_failure: bool) -> List[str]:
    return [*(["-x"] if first_failure else []), "-q", "-p", "no:cacheprovider", *args]


def summarize(passed: bool, output: str) -> Tuple[str, str]:
    """-> ("passed" | "failed", the FAILED/ERROR lines or else the last 3 lines)."""
    lines = output.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return ("passed" if passed else "failed"), "\n".join(failed) if failed else "\n".join(lines[-3:])


class Runner:
    """Runs pytest on one tree: a fresh interpreter per run, or (fork) a fork of one server
    process that has imported torch, transformers and DeepSpeed once (never specdraft: each
    fork imports the tree's)."""

    def __init__(self, tree: Path, fork: bool = False, env: Optional[Dict[str, str]] = None):
        self.tree, self.env = tree, test_env(tree, env)
        self.server = self._start_server() if fork else None

    def _start_server(self) -> subprocess.Popen:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(self.tree)]
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return subprocess.Popen(command, cwd=self.tree, env=self.env, **pipes)

    def run(self, args: Tuple[str, ...], timeout: float, first_failure: bool = True) -> Outcome:
        if self.server is not None:
            request = {"args": list(args), "timeout": timeout, "first_failure": first_failure}
            reply = self._ask(request)
            if reply is None:  # the server itself died (never a mutant: those run in its forks)
                self.server = self._start_server()
                reply = self._ask(request)
            if reply is None:
                raise RuntimeError(f"the fork server of {self.tree} exited twice ({self.server.wait()})")
            return reply["outcome"], reply["seconds"], reply["detail"]
        command = [sys.executable, "-m", "pytest", *pytest_args(args, first_failure)]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=self.tree, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start, ""
        outcome, detail = summarize(done.returncode == 0, done.stdout + done.stderr)
        return outcome, time.perf_counter() - start, detail

    def _ask(self, request: dict) -> Optional[dict]:
        try:
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
        except BrokenPipeError:
            return None
        for line in self.server.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        return None

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait()


# -- the fork server (run.py --serve TREE, started by Runner) ---------------------------------------

REPLY = "@@mutation-reply "
PRELOAD = (  # what every test imports and a fresh interpreter spends most of its start on
    "numpy",
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "deepspeed",
    "deepspeed.runtime.engine",
    "safetensors.torch",
    "omegaconf",
    "filelock",
    "pytest",
    "hypothesis",
)


def serve(tree: Path) -> None:
    """Reads one JSON request a line, runs it in a fork, answers one REPLY line per request."""
    import gc
    import importlib
    import warnings

    with warnings.catch_warnings():  # the tests' own filters stay as pytest sets them
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    if any(name == "specdraft" or name.startswith("specdraft.") for name in sys.modules):
        raise SystemExit("the fork server imported specdraft: its forks would not test the mutated tree")
    gc.freeze()  # the preloaded objects stay out of every fork's collections (and its copies)
    with tempfile.TemporaryDirectory(prefix="specdraft-fork-") as logs:
        for number, line in enumerate(sys.stdin):
            request = json.loads(line)
            log = Path(logs) / f"{number}.log"
            start = time.perf_counter()
            code = fork_pytest(tree, tuple(request["args"]), request["first_failure"], log, request["timeout"])
            output = log.read_text(errors="replace")
            if code is None:
                outcome, detail = "timeout", "\n".join(output.strip().splitlines()[-3:])
            else:
                outcome, detail = summarize(code == 0, output)
            reply = {"outcome": outcome, "seconds": time.perf_counter() - start, "detail": detail}
            sys.stdout.write(REPLY + json.dumps(reply) + "\n")
            sys.stdout.flush()


def fork_pytest(tree: Path, args: Tuple[str, ...], first_failure: bool, log: Path, timeout: float) -> Optional[int]:
    """pytest in a fork, its output into `log` -> its exit status; None: killed at the timeout
    (with every process it started: the fork leads its own process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            os.setsid()
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.chdir(tree)
            sys.path.insert(0, str(tree))
            import pytest
            import specdraft

            if not Path(specdraft.__file__).resolve().is_relative_to(tree.resolve()):
                raise RuntimeError(f"imported {specdraft.__file__}, not the tree's")
            code = int(pytest.main(pytest_args(args, first_failure)))
        except BaseException as err:  # noqa: BLE001 - reported in the log, as a failed run
            print(f"fork server: {type(err).__name__}: {err}", flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


# -- one mutant ---------------------------------------------------------------------------------------


def check_snippet(tree: Path, mutation: Mutation) -> str:
    """'' when the mutation applies; otherwise what is wrong with it."""
    path = tree / mutation.file
    if not path.is_file():
        return f"file not found: {mutation.file}"
    count = path.read_text().count(mutation.original)
    if count != 1:
        return f"snippet {'not found' if count == 0 else f'found {count} times'} in {mutation.file}"
    if mutation.original == mutation.replacement:
        return "replacement equals the original"
    return ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str  # killed | survived | timeout | error | broken-test
    detail: str  # the failing lines (killed), what is wrong (error), the last lines (others)
    killer: str = ""  # the node id of the test that killed it; "" when none is named
    recheck: Tuple[str, ...] = ()  # killed: what to run unmutated to trust the kill


def verdict(tests: Tuple[str, ...], own: Outcome, suite: Optional[Outcome] = None) -> Verdict:
    """What a mutant's runs say: `own` of its tests, `suite` of the whole suite (run only when
    its own tests passed; None when not run). A run that timed out proves nothing: "timeout".
    A kill is to be checked unmutated by its named test, else by the run that failed."""
    outcome, _, detail = own
    ran = tests
    if outcome == "passed" and suite is not None:
        (outcome, _, detail), ran = suite, WHOLE_SUITE
        detail = f"(whole suite) {detail}"
    if outcome != "failed":
        return Verdict("survived" if outcome == "passed" else "timeout", detail)
    killer = killing_test(detail)
    return Verdict("killed", detail, killer, (killer,) if killer else tuple(ran))


def trusted(found: Verdict, broken: Set[Tuple[str, ...]]) -> Verdict:
    """A kill whose recheck failed on the unmutated tree proves nothing: "broken-test"."""
    if found.status == "killed" and found.recheck in broken:
        return dataclasses.replace(found, status="broken-test")
    return found


def run_mutation(runner: Runner, mutation: Mutation, timeout: int, whole_suite: bool = True) -> Tuple[Verdict, float]:
    """Its own tests first; only if they all pass (and whole_suite), the whole suite (a survivor
    of its named tests that the suite kills is reported as killed, naming the test that did)."""
    problem = check_snippet(runner.tree, mutation)
    if problem:
        return Verdict("error", problem), 0.0
    path = runner.tree / mutation.file
    original = path.read_text()
    try:
        path.write_text(original.replace(mutation.original, mutation.replacement))
        own = runner.run(mutation.tests, timeout)
        suite = None
        if own[0] == "passed" and whole_suite and mutation.tests != WHOLE_SUITE:
            suite = runner.run(WHOLE_SUITE, timeout * 4)
    finally:
        path.write_text(original)
    return verdict(mutation.tests, own, suite), own[1] + (suite[1] if suite else 0.0)


def killing_test(detail: str) -> str:
    """The node id in pytest's first "FAILED <id> - <message>" / "ERROR <id>" line; "" when the
    run failed without one (a crash: `detail` is its last lines)."""
    first = (detail.splitlines()[0] if detail else "").removeprefix("(whole suite) ")
    if not first.startswith(("FAILED ", "ERROR ")):
        return ""
    return first.split(" ", 1)[1].split(" - ")[0].strip()


# -- many mutants ---------------------------------------------------------------------------------------


def in_parallel(jobs: List, work: Callable, workers: int, fork: bool = False, env=None) -> List:
    """work(runner, job) for every job, `workers` at a time, each worker on its own copy of the
    tree (a mutant is written into the tree it runs in); results in the order of `jobs`."""
    todo: "queue.Queue[int]" = queue.Queue()
    for index in range(len(jobs)):
        todo.put(index)
    results: List = [None] * len(jobs)

    def worker() -> None:
        with tempfile.TemporaryDirectory(prefix="specdraft-mutation-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            runner = Runner(tree, fork, env)
            try:
                while True:
                    try:
                        index = todo.get_nowait()
                    except queue.Empty:
                        return
                    results[index] = work(runner, jobs[index])
            finally:
                runner.close()

    threads = [threading.Thread(target=worker) for _ in range(max(1, min(workers, len(jobs))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def kill_checks(killers: Dict[str, str], timeout: int, env: Optional[Dict[str, str]] = None) -> Dict[str, Verdict]:
    """{mutation name: the one test to run} -> each mutation's verdict from that test alone, in
    forks on one copy of the tree (tests/test_mutants_killed.py, under `make test`)."""
    by_name = {m.name: m for m in all_mutations()}
    jobs = [dataclasses.replace(by_name[name], tests=(test,)) for name, test in killers.items()]
    found = in_parallel(jobs, lambda runner, m: run_mutation(runner, m, timeout, whole_suite=False)[0], 1, True, env)
    return dict(zip(killers, found))


def unmutated_failures(rechecks: List[Tuple[str, ...]], args, print_lock) -> Set[Tuple[str, ...]]:
    """Run every distinct recheck once on the unmutated tree; -> the ones that fail there (a kill
    by one proves nothing). Named tests are split over the workers, in batches; any other recheck
    (the run that a kill naming no test came from: its own tests, or the whole suite) runs alone."""
    distinct = list(dict.fromkeys(rechecks))
    named = [r[0] for r in distinct if is_named(r)]
    jobs = [(tuple(named[i :: args.workers]), False) for i in range(args.workers) if named[i :: args.workers]]
    jobs += [(r, True) for r in distinct if not is_named(r)]

    def check(runner: Runner, job: Tuple[Tuple[str, ...], bool]) -> Set[Tuple[str, ...]]:
        batch, alone = job
        outcome, seconds, detail = runner.run(batch, args.timeout * (4 if alone else 2), first_failure=False)
        with print_lock:
            print(f"unmutated {outcome:8s} {seconds:6.1f}s  {' '.join(batch)[:100]}", flush=True)
        if outcome == "passed":
            return set()
        if alone:
            return {batch}
        failing = {(killing_test(line),) for line in detail.splitlines() if line.startswith(("FAILED ", "ERROR "))}
        return failing or {(name,) for name in batch}  # a crash or a timeout: trust none of this batch

    return set().union(*in_parallel(jobs, check, args.workers, args.fork))


def is_named(recheck: Tuple[str, ...]) -> bool:
    """A recheck that is one test's node id (a kill that named its test)."""
    return len(recheck) == 1 and "::" in recheck[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-k",
        dest="select",
        action="append",
        default=[],
        help="only mutations whose name contains this (repeatable: any of them)",
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the killing tests")
    parser.add_argument(
        "--no-whole-suite", action="store_true", help="a survivor of its own tests counts as survived at once"
    )
    parser.add_argument("--fork", action="store_true", help="run the tests in forks of one preloaded process")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the fork server of Runner
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="mutants run at once, each in its own copy of the tree (default: one per core)",
    )
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0

    mutations = [m for m in all_mutations() if not args.select or any(k in m.name for k in args.select)]
    names = [m.name for m in all_mutations()]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        print(f"duplicate mutation names: {sorted(duplicates)}")
        return 1
    if args.list:
        for m in mutations:
            print(f"{m.name:45s} {m.file}  {m.why}")
        return 0

    started = time.perf_counter()
    print_lock = threading.Lock()

    def judge(runner: Runner, m: Mutation) -> Verdict:
        found, seconds = run_mutation(runner, m, args.timeout, whole_suite=not args.no_whole_suite)
        line = f"{found.status:8s} {seconds:6.1f}s  {m.name}"
        if found.status == "killed":
            whole = "(whole suite) " if found.detail.startswith("(whole suite)") else ""
            line += f"  by {whole + (found.killer or '(no test named: ' + ' '.join(found.recheck) + ')')}"[:130]
        else:
            line += f"  <- {found.detail or m.why or 'no test fails'}"
        with print_lock:
            print(line, flush=True)
        return found

    verdicts: List[Verdict] = in_parallel(mutations, judge, args.workers, args.fork)
    if not args.no_baseline:
        broken = unmutated_failures([v.recheck for v in verdicts if v.status == "killed"], args, print_lock)
        verdicts = [trusted(v, broken) for v in verdicts]
    return report(mutations, verdicts, time.perf_counter() - started)


def report(mutations: List[Mutation], verdicts: List[Verdict], seconds: float) -> int:
    by_status: Dict[str, List[str]] = {}
    for m, v in zip(mutations, verdicts):
        by_status.setdefault(v.status, []).append(m.name)
    count = {
        status: len(by_status.get(status, [])) for status in ("killed", "survived", "timeout", "error", "broken-test")
    }
    print(
        f"\n{count['killed']}/{len(verdicts)} killed, {count['survived']} survived, {count['timeout']} timed out, "
        f"{count['error']} not applicable, {count['broken-test']} killed by a test that fails unmutated; "
        f"{seconds:.0f}s in all"
    )
    for status, label in (
        ("survived", "SURVIVED"),
        ("timeout", "TIMEOUT"),
        ("error", "SNIPPET"),
        ("broken-test", "BROKEN TEST"),
    ):
        for name in by_status.get(status, []):
            print(f"  {label + ':':12s} {name}")
    return 1 if any(count[s] for s in ("survived", "timeout", "error", "broken-test")) else 0


if __name__ == "__main__":
    sys.exit(main())
