"""`make mutation`: apply each semantic mutation to a temporary copy of the tree, run its tests.

    python tests/mutation/run.py                 every mutation (tests/mutation/mutations.py)
    python tests/mutation/run.py -k glide/label  only names containing a substring (repeatable)
    python tests/mutation/run.py --list          the mutations, no run
    python tests/mutation/run.py --workers 1     one mutant at a time (default: one per core)

The working tree is never written: the files git tracks (plus untracked, not ignored ones) are
copied to a temporary directory per worker, each mutant is written there and the original put
back after its run, and pytest runs with that copy first on PYTHONPATH. A mutant runs only the
tests it names; one they let survive then faces the whole suite before it counts as survived.
A kill counts only if the test that killed it passes on the unmutated tree: after the mutants,
the distinct killing tests run once, unmutated (a broken test would make every mutant it runs
look killed). Exit status 1 when a mutation survives, its snippet is not found exactly once, or
a killing test fails unmutated.
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation, all_mutations  # noqa: E402


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


def run_tests(tree: Path, args: Tuple[str, ...], timeout: int, first_failure: bool = True) -> Tuple[str, float, str]:
    """-> ("passed" | "failed" | "timeout", seconds, the FAILED/ERROR lines or the last lines)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        *(["-x"] if first_failure else []),
        "-q",
        "-p",
        "no:cacheprovider",
        *args,
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    detail = "\n".join(failed) if failed else "\n".join(lines[-3:])
    return ("passed" if done.returncode == 0 else "failed"), time.perf_counter() - start, detail


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


WHOLE_SUITE = ("tests",)


def run_mutation(tree: Path, mutation: Mutation, timeout: int) -> Tuple[str, float, str]:
    """Its own tests first; only if they all pass, the whole suite (a survivor of its named
    tests that the suite kills is reported as killed, naming the test that did)."""
    problem = check_snippet(tree, mutation)
    if problem:
        return "error", 0.0, problem
    path = tree / mutation.file
    original = path.read_text()
    try:
        path.write_text(original.replace(mutation.original, mutation.replacement))
        outcome, seconds, tail = run_tests(tree, mutation.tests, timeout)
        if outcome == "passed" and mutation.tests != WHOLE_SUITE:
            outcome, more, tail = run_tests(tree, WHOLE_SUITE, timeout * 4)
            seconds += more
            tail = f"(whole suite) {tail}"
    finally:
        path.write_text(original)
    # a failing (or hanging) test run kills the mutant; passing tests let it survive
    return ("survived" if outcome == "passed" else "killed"), seconds, tail


def killing_test(detail: str) -> str:
    """The node id in pytest's first "FAILED <id> - <message>" / "ERROR <id>" line."""
    first = detail.splitlines()[0] if detail else ""
    for prefix in ("(whole suite) ", "FAILED ", "ERROR "):
        first = first.removeprefix(prefix)
    return first.split(" - ")[0].strip()


def in_parallel(jobs: List, work, workers: int) -> List:
    """work(tree, job) for every job, `workers` at a time, each worker on its own copy of the tree
    (a mutant is written into the tree it runs in); results in the order of `jobs`."""
    todo: "queue.Queue[int]" = queue.Queue()
    for index in range(len(jobs)):
        todo.put(index)
    results: List = [None] * len(jobs)

    def worker() -> None:
        with tempfile.TemporaryDirectory(prefix="specdraft-mutation-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                results[index] = work(tree, jobs[index])

    threads = [threading.Thread(target=worker) for _ in range(max(1, min(workers, len(jobs))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def unmutated_failures(results, args, print_lock) -> List[str]:
    """Run every distinct killing test once on the unmutated tree, split over the workers;
    -> the ones that fail there (a kill by such a test proves nothing). A kill without a named
    test (a timeout, a crash) runs that mutation's own tests; their files are returned if they fail."""
    killers = list(dict.fromkeys(killer for _, status, _, killer in results if status == "killed" and killer))
    unnamed = list(
        dict.fromkeys(
            arg
            for m, status, _, killer in results
            if status == "killed" and not killer
            for arg in m.tests
            if not arg.startswith("-")
        )
    )
    batches = [tuple(killers[i :: args.workers]) for i in range(args.workers)] + [tuple(unnamed)]
    batches = [b for b in batches if b]

    def check(tree: Path, batch: Tuple[str, ...]) -> List[str]:
        outcome, seconds, detail = run_tests(tree, batch, args.timeout * 2, first_failure=False)
        failing = [killing_test(line) for line in detail.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        with print_lock:
            print(f"unmutated {outcome:8s} {seconds:6.1f}s  {len(batch)} killing tests", flush=True)
        if outcome != "passed" and (batch == tuple(unnamed) or not failing):  # trust none of this batch
            failing = [*failing, *batch]
        return failing

    return [name for failing in in_parallel(batches, check, args.workers) for name in failing]


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
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="mutants run at once, each in its own copy of the tree (default: one per core)",
    )
    args = parser.parse_args(argv)

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

    def judge(tree: Path, m: Mutation) -> Tuple[Mutation, str, float, str]:
        status, seconds, detail = run_mutation(tree, m, args.timeout)
        killer = killing_test(detail) if status == "killed" else ""
        line = f"{status:8s} {seconds:6.1f}s  {m.name}"
        if status == "killed":
            line += f"  by {('(whole suite) ' if detail.startswith('(whole suite)') else '') + killer}"[:130]
        else:
            line += f"  <- {detail or m.why or 'no test fails'}"
        with print_lock:
            print(line, flush=True)
        return m, status, seconds, killer

    results: List[Tuple[Mutation, str, float, str]] = in_parallel(mutations, judge, args.workers)
    broken = [] if args.no_baseline else unmutated_failures(results, args, print_lock)

    def trusted(m: Mutation, status: str, killer: str) -> str:
        suspect = killer in broken if killer else any(arg in broken for arg in m.tests)
        return "broken-test" if status == "killed" and suspect else status

    results = [(m, trusted(m, status, killer), seconds) for m, status, seconds, killer in results]

    survived = [m.name for m, status, _ in results if status == "survived"]
    errors = [m.name for m, status, _ in results if status == "error"]
    broken = [m.name for m, status, _ in results if status == "broken-test"]
    killed = sum(status == "killed" for _, status, _ in results)
    print(
        f"\n{killed}/{len(results)} killed, {len(survived)} survived, {len(errors)} not applicable, "
        f"{len(broken)} killed by a test that fails unmutated; {time.perf_counter() - started:.0f}s in all"
    )
    for name in survived:
        print(f"  SURVIVED: {name}")
    for name in errors:
        print(f"  SNIPPET:  {name}")
    for name in broken:
        print(f"  BROKEN TEST: {name}")
    return 1 if survived or errors or broken else 0


if __name__ == "__main__":
    sys.exit(main())
