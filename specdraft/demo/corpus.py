"""The demo's only text: Python standard-library sources found on this machine.

Everything the demo builds (tokenizer, target, chat dataset) reads this one corpus, so the demo
needs no download. The file list is sorted before a seeded shuffle, so a given Python installation
and seed always give the same corpus; another Python version gives another (equally valid) one.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError

# Directories that hold tests, third-party packages, data tables (encodings/*, pydoc_data) or
# generated/demo code: not the idiomatic library code the demo target should learn.
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "lib2to3",
        "turtledemo",
    }
)
_MAX_FILE_BYTES = 256 * 1024  # a single huge file would dominate a few-MB corpus

PROMPT_PREFIX = "Complete this Python function:\n\n"


@dataclass(frozen=True)
class SourceFile:
    name: str  # path relative to the stdlib root, e.g. "json/decoder.py"
    text: str


@dataclass(frozen=True)
class FunctionExample:
    """One documented stdlib function, split where a chat model would be asked to continue."""

    qualname: str  # "json/decoder.py:JSONDecoder.decode"
    prompt: str  # PROMPT_PREFIX + signature + docstring (dedented)
    answer: str  # the body after the docstring (dedented with the signature, so still indented)


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise SpecdraftError(
            f"Python standard library sources not found at {root}; the demo builds its target from them"
        )
    return root


def read_corpus(max_bytes: int, seed: int) -> list[SourceFile]:
    """Stdlib *.py files (no tests), sorted, shuffled with `seed`, until `max_bytes` of text."""
    root = stdlib_root()
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.stat().st_size <= _MAX_FILE_BYTES
    )
    random.Random(seed).shuffle(paths)
    files, total = [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(path.relative_to(root).as_posix(), text))
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not files:
        raise SpecdraftError(f"no readable Python sources under {root}")
    return files


def extract_functions(files: list[SourceFile]) -> list[FunctionExample]:
    """Every function with a docstring and a body after it, as (signature + docstring, body).

    Functions are returned in file order; duplicates (same prompt text) are dropped.
    """
    examples, seen = [], set()
    for file in files:
        try:
            tree = ast.parse(file.text)
        except SyntaxError:
            continue
        lines = file.text.splitlines()
        for node, qualname in _functions(tree, prefix=""):
            example = _split_function(node, lines, f"{file.name}:{qualname}")
            if example is not None and example.prompt not in seen:
                seen.add(example.prompt)
                examples.append(example)
    return examples


def _functions(tree: ast.AST, prefix: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def _split_function(node, lines: list[str], qualname: str) -> FunctionExample | None:
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    # Needs a body after the docstring, and every piece on its own lines (no `def f(): "d"; x`).
    if len(node.body) < 2 or doc.lineno == node.lineno or node.body[1].lineno <= doc.end_lineno:
        return None
    source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    source_lines = source.splitlines()
    head_len = doc.end_lineno - node.lineno + 1  # def line .. last docstring line
    head = "\n".join(source_lines[:head_len])
    body = "\n".join(source_lines[head_len:]).strip("\n")
    if not body.strip():
        return None
    return FunctionExample(qualname, PROMPT_PREFIX + head, body)
