"""The bench scripts keep to the package's size limits: a file of bench/ at most 500 lines, a
function or method at most 100. A script that grows past them is split into helper modules of
bench/ (one job each) that the other scripts share, as acceptance_runs.py and bench_out.py are."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100


def bench_files():
    files = sorted(BENCH.glob("*.py"))
    assert len(files) >= 20, files  # the folder is there, not a stray glob
    return files


def test_every_bench_file_is_at_most_500_lines():
    long = {path.name: n for path in bench_files() if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"


def test_no_bench_function_is_over_100_lines():
    long = {}
    for path in bench_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.name}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
