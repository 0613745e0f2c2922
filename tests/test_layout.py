"""The layout shows the design (shared/DESIGN.md, "Layout"): imports point one way, cli ->
commands (train, evaluate, regenerate, demo) -> train -> drafts -> decode / target / data, each
family is one folder drafts/<family>/ that imports the shared blocks in drafts/ and never another
family's folder, and each module stays small enough to read."""

import ast
from collections import defaultdict
from pathlib import Path

import specdraft
from specdraft.drafts import FAMILIES

PACKAGE = Path(specdraft.__file__).resolve().parent
DRAFTS = PACKAGE / "drafts"
MAX_LINES = 500
# Packages that must never import these (the engine below the families, the leaves below them).
NEVER = {
    "decode": {"drafts", "train", "evaluate", "regenerate", "cli", "demo"},
    "target": {"drafts", "train", "decode", "evaluate", "regenerate", "cli", "demo"},
    "data": {"drafts", "train", "decode", "evaluate", "cli", "demo"},
    "drafts": {"train", "evaluate", "regenerate", "cli", "demo"},
    "train": {"evaluate", "regenerate", "cli", "demo"},
    "run": {"drafts", "train", "decode", "target", "data", "evaluate", "cli"},
}


def unit(module: str) -> str:
    """specdraft.train.loop -> train; specdraft.run -> run; specdraft -> specdraft."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "specdraft"


def imports_by_unit():
    """{unit: {imported unit: [file, ...]}}, function-level imports included."""
    edges = defaultdict(lambda: defaultdict(list))
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        here = rel.parts[0].removesuffix(".py") if rel != Path("__init__.py") else "specdraft"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdraft"):
                names = ([f"specdraft.{a.name}" for a in node.names] if node.module == "specdraft"
                         else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("specdraft")]
            else:
                continue
            for there in {unit(name) for name in names} - {here, "specdraft"}:  # specdraft: __version__
                edges[here][there].append(str(rel))
    return edges


def test_no_package_imports_a_package_that_imports_it():
    edges = imports_by_unit()
    cycles = [(a, b, edges[a][b][0], edges[b][a][0]) for a in edges for b in edges[a] if a in edges.get(b, {}) and a < b]
    assert not cycles, cycles


def test_imports_point_from_commands_down_to_the_engine():
    edges = imports_by_unit()
    wrong = [(here, there, files[0]) for here, forbidden in NEVER.items()
             for there, files in edges.get(here, {}).items() if there in forbidden]
    assert not wrong, wrong


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checkpoint_manager_holds_the_policy_only():
    assert len((PACKAGE / "train" / "checkpoint.py").read_text().splitlines()) <= 300


def imported_modules(path: Path):
    """Every specdraft module a file imports (function-level imports included), as dotted names;
    `from specdraft.drafts import x` names specdraft.drafts.x."""
    package = ".".join(("specdraft",) + path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("specdraft"):
                yield from (f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("specdraft"))


def family_folder_imported(module: str):
    """specdraft.drafts.eagle3.model -> eagle3; a shared block -> None; the registry (specdraft.drafts
    itself, or a name it defines: FAMILIES, build_draft ...) -> "drafts" (it imports every family)."""
    parts = module.split(".")
    if parts[:2] != ["specdraft", "drafts"]:
        return None
    if len(parts) == 2:
        return "drafts"
    if parts[2] in FAMILIES:
        return parts[2]
    if not (DRAFTS / f"{parts[2]}.py").is_file():
        return "drafts"
    return None


def test_each_family_is_one_folder_of_drafts():
    folders = sorted(p.name for p in DRAFTS.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(FAMILIES)
    assert {name: cls.__module__ for name, cls in FAMILIES.items()} == {
        name: f"specdraft.drafts.{name}.model" for name in FAMILIES}


def test_a_family_folder_imports_shared_blocks_never_another_family():
    """What two families share (DFlash's block backbone under DSpark) is a shared block in drafts/;
    a shared block imports no family folder."""
    wrong = []
    for path in sorted(DRAFTS.rglob("*.py")):
        rel = path.relative_to(DRAFTS)
        own = rel.parts[0] if len(rel.parts) > 1 else None
        if rel == Path("__init__.py"):
            continue  # the registry: it imports every family
        for module in imported_modules(path):
            there = family_folder_imported(module)
            if there is not None and there != own:
                wrong.append((str(rel), module))
    assert not wrong, wrong
