"""Does one test file, alone, kill a mutant? (`make mutation` stops at a mutant's first killing test.)

    python tests/mutation/one_file.py tests/test_multinode.py loading/resume-without-the-weights [NAME ...]

Each named mutation is applied to its own copy of the tree (run.py's copy_tree, the working tree
untouched) and the file runs there with -x. Exit status 1 when the file passes under any of them.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import all_mutations  # noqa: E402
from run import copy_tree, test_env  # noqa: E402


def main(argv) -> int:
    test_file, names = argv[0], argv[1:]
    mutations = {m.name: m for m in all_mutations()}
    unknown = [name for name in names if name not in mutations]
    if not names or unknown:
        print(f"usage: one_file.py TEST_FILE MUTATION [...]; unknown: {unknown}")
        return 2
    survived = []
    for name in names:
        m = mutations[name]
        with tempfile.TemporaryDirectory(prefix="specdraft-one-file-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            source = (tree / m.file).read_text()
            if source.count(m.original) != 1:
                print(f"{name}: its snippet is not in {m.file} exactly once")
                return 1
            (tree / m.file).write_text(source.replace(m.original, m.replacement))
            start = time.perf_counter()
            command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", test_file]
            done = subprocess.run(command, cwd=tree, env=test_env(tree), capture_output=True, text=True)
            failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
            verdict = "killed" if done.returncode != 0 else "SURVIVED"
            print(f"{verdict:8s} {time.perf_counter() - start:6.1f}s  {name}  {' '.join(failed)[:150]}", flush=True)
            if done.returncode == 0:
                survived.append(name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
