"""The layout shows the design (docs/architecture.md): imports point one way, cli -> commands / demo ->
regenerate / train -> checkpoint / export -> config -> drafts -> decode / target / data -> parallel -> rundir, each
family is one folder drafts/<family>/ holding all of its code, importing the shared blocks in drafts/
and at most the one base family it declares; a shared module names no family; and each module stays
small enough to read."""

import ast
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pytest

import specdraft
from specdraft.drafts import SPECS
from specdraft.drafts.registry import FAMILIES

PACKAGE = Path(specdraft.__file__).resolve().parent
DRAFTS = PACKAGE / "drafts"
MAX_LINES = 500
# Packages that must never import these (each layer imports only the layers below it).
ABOVE = [
    "cli",
    "commands",
    "demo",
    "regenerate",
    "train",
    "checkpoint",
    "export",
    "config",
    "drafts",
    "decode",
    "target",
    "data",
    "parallel",
    "rundir",
]
NEVER = {
    "commands": {"cli"},
    "demo": {"cli"},
    "regenerate": {"cli", "commands", "demo", "train", "checkpoint", "export", "drafts", "decode"},
    "train": {"cli", "commands", "demo", "regenerate"},
    "checkpoint": {"cli", "commands", "demo", "regenerate", "train", "export"},
    "export": {"cli", "commands", "demo", "regenerate", "train"},
    "config": {"cli", "commands", "demo", "regenerate", "train", "checkpoint", "export"},
    "drafts": {"cli", "commands", "demo", "regenerate", "train", "checkpoint", "export", "config"},
    "decode": {"cli", "commands", "demo", "regenerate", "train", "checkpoint", "export", "config", "drafts"},
    "target": {
        "cli",
        "commands",
        "demo",
        "regenerate",
        "train",
        "checkpoint",
        "export",
        "config",
        "drafts",
        "decode",
        "data",
    },
    "data": {
        "cli",
        "commands",
        "demo",
        "regenerate",
        "train",
        "checkpoint",
        "export",
        "config",
        "drafts",
        "decode",
        "target",
    },
    "parallel": set(ABOVE) - {"parallel", "rundir"},
    "rundir": set(ABOVE) - {"rundir"},
}
LEAVES = ("errors", "paths", "transfer")  # modules at the package root that import nothing of ours


def unit(module: str) -> str:
    """specdraft.train.loop -> train; specdraft.rundir.layout -> run; specdraft -> specdraft."""
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
                names = [f"specdraft.{a.name}" for a in node.names] if node.module == "specdraft" else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("specdraft")]
            else:
                continue
            for there in {unit(name) for name in names} - {here, "specdraft"}:  # specdraft: __version__
                edges[here][there].append(str(rel))
    return edges


def test_no_package_imports_a_package_that_imports_it():
    edges = imports_by_unit()
    cycles = [
        (a, b, edges[a][b][0], edges[b][a][0]) for a in edges for b in edges[a] if a in edges.get(b, {}) and a < b
    ]
    assert not cycles, cycles


def test_imports_point_from_commands_down_to_the_engine():
    edges = imports_by_unit()
    wrong = [
        (here, there, files[0])
        for here, forbidden in NEVER.items()
        for there, files in edges.get(here, {}).items()
        if there in forbidden
    ]
    assert not wrong, wrong


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_checkpoint_manager_holds_the_policy_only():
    assert len((PACKAGE / "checkpoint" / "manager.py").read_text().splitlines()) <= 300


def test_the_package_root_holds_the_cli_and_leaves_only():
    """Commands live in commands/, the run directory's rules in rundir/; the root keeps the entry
    points and the leaf modules every package may use."""
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert root == sorted(["__init__", "__main__", "cli", *LEAVES])
    edges = imports_by_unit()
    assert not {leaf: dict(edges[leaf]) for leaf in LEAVES if set(edges.get(leaf, {})) - {"errors"}}


def imported_modules(path: Path, source: Optional[str] = None):
    """Every specdraft module a file imports (function-level imports included), as dotted names;
    `from specdraft.drafts import x` names specdraft.drafts.x. source: the file's text (default: read)."""
    package = ".".join(("specdraft",) + path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("specdraft"):
                yield from (f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("specdraft"))


REGISTRIES = ("__init__.py", "registry.py")  # drafts.SPECS (every options.py) and registry.FAMILIES (every model.py)


def family_folder_imported(module: str):
    """specdraft.drafts.eagle3.model -> eagle3; a shared block -> None; a registry (specdraft.drafts
    itself or a name it defines: SPECS, DraftConfig ...; specdraft.drafts.registry: FAMILIES,
    build_draft ...) -> "drafts" (each imports every family)."""
    parts = module.split(".")
    if parts[:2] != ["specdraft", "drafts"]:
        return None
    if len(parts) == 2 or parts[2] == "registry":
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
        name: f"specdraft.drafts.{name}.model" for name in FAMILIES
    }


def test_each_model_inherits_what_the_config_knows_of_its_family():
    """drafts.SPECS (each family's options.py, no torch) and registry.FAMILIES (its model) are the
    same families in the same order; a model inherits its family's declarations, and its serving
    writers are the formats the config accepts by name."""
    assert list(SPECS) == list(FAMILIES)
    for name, cls in FAMILIES.items():
        assert issubclass(cls, SPECS[name]) and SPECS[name].__module__ == f"specdraft.drafts.{name}.options"
        assert tuple(cls.serving_formats) == SPECS[name].serving_format_names, name


def wrong_family_imports(rel: Path, source: str):
    """The imports of drafts/<rel> that break the rule: a shared block (a module directly in drafts/)
    imports no family folder; a family folder imports its own, the shared blocks and the folder of
    the one base family its class declares (Draft.base_family), nothing else."""
    own = rel.parts[0] if len(rel.parts) > 1 else None
    allowed = {own, FAMILIES[own].base_family} - {None} if own else set()
    wrong = []
    for module in imported_modules(DRAFTS / rel, source):
        there = family_folder_imported(module)
        if there is not None and there not in allowed:
            wrong.append((str(rel), module))
    return wrong


def test_a_family_folder_imports_shared_blocks_and_its_declared_base_family_only():
    wrong = [
        w
        for path in sorted(DRAFTS.rglob("*.py"))
        if path not in [DRAFTS / name for name in REGISTRIES]
        for w in wrong_family_imports(path.relative_to(DRAFTS), path.read_text())
    ]
    assert not wrong, wrong
    assert {name: cls.base_family for name, cls in FAMILIES.items() if cls.base_family} == {
        "peagle": "eagle3",
        "dspark": "dflash",
        "dflash2": "dflash",
    }


@pytest.mark.parametrize(
    "rel, planted, refused",
    [
        ("peagle/model.py", "from specdraft.drafts.eagle3.layer import Eagle3Base", False),  # its base
        ("dspark/decode.py", "from specdraft.drafts.dflash import blocks", False),
        ("peagle/model.py", "from specdraft.drafts.dflash.blocks import BlockShape", True),  # not its base
        ("eagle3/layer.py", "from specdraft.drafts.peagle.cod_attention import CODSlots", True),  # base -> child
        ("dflash/model.py", "import specdraft.drafts.dspark.model", True),
        ("glide/model.py", "from ..mtp import layer", True),  # relative
        ("objectives.py", "from specdraft.drafts.eagle3 import vocab", True),  # a shared block
        ("layers.py", "from specdraft.drafts.registry import FAMILIES", True),  # the registry imports every family
        ("spec.py", "from specdraft.drafts import SPECS", True),  # and so does drafts.SPECS
        ("glide/options.py", "from specdraft.drafts.registry import build_draft", True),
        ("mtp/model.py", "from specdraft.drafts.layers import RMSNorm", False),
    ],
)
def test_a_planted_import_is_judged_by_the_rule(rel, planted, refused):
    source = (DRAFTS / rel).read_text()
    assert not wrong_family_imports(Path(rel), source)
    inside_a_function = source + "\n\ndef _planted():\n    " + planted + "\n"
    assert bool(wrong_family_imports(Path(rel), inside_a_function)) == refused


def family_names_in(source: str):
    """String constants equal to a family's name and identifiers that contain one (GlideDraft,
    eagle3_layer, is_peagle)."""
    names = {name.lower() for name in FAMILIES}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names:
            yield repr(node.value)
        for ident in (
            getattr(node, "id", None),
            getattr(node, "attr", None),
            node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.alias)) else None,
        ):
            if isinstance(ident, str) and any(name in ident.lower() for name in names):
                yield ident


def test_no_shared_module_names_a_family():
    """What every family uses (drafts/ blocks, train/, checkpoint/, export/, decode/, config/ ...)
    asks a draft through its interface; only the registry and the demo, which pick families, name
    them."""
    named = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if (
            (rel.parts[0] == "drafts" and len(rel.parts) > 2)
            or rel in [Path("drafts", name) for name in REGISTRIES]
            or rel.parts[0] == "demo"
        ):
            continue
        if found := sorted(set(family_names_in(path.read_text()))):
            named[str(rel)] = found
    assert not named, named


def test_the_family_name_check_sees_a_planted_name():
    assert list(family_names_in("if draft.family == 'peagle':\n    pass")) == ["'peagle'"]
    assert list(family_names_in("from x import GlideDraft")) == ["GlideDraft"]
    assert not list(family_names_in("if draft.base_family:\n    pass"))


ROLES = ("options.py", "model.py", "train.py", "export.py", "decode.py")  # docs/architecture.md, "Adding a family"
TRAINING = ("capture_request", "sample_batch_options", "training_loss", "memory_terms")


def defined_functions(path: Path):
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


def test_every_family_folder_has_the_same_files_by_role():
    """options.py: keys and checks; model.py: the network; train.py: what a step computes from a
    LossBatch (the loss, the rows it counts, the per-batch draws, the memory); export.py: every
    format the family writes; decode.py: its drafter. No family's training lives outside train.py,
    and every writer of a family's formats is in its export.py (or its base family's)."""
    for name, cls in FAMILIES.items():
        folder = DRAFTS / name
        assert all((folder / role).is_file() for role in ROLES), (name, sorted(p.name for p in folder.glob("*.py")))
        outside = {
            f"{path.name}:{function}"
            for path in folder.glob("*.py")
            if path.name != "train.py"
            for function in defined_functions(path) & set(TRAINING)
        }
        assert not outside, (name, outside)
        homes = {f"specdraft.drafts.{family}" for family in (name, cls.base_family) if family}
        for method in TRAINING:  # a family that draws nothing per batch keeps Draft's sample_batch_options
            allowed = {f"{home}.train" for home in homes} | (
                {"specdraft.drafts.base"} if method == TRAINING[1] else set()
            )
            assert getattr(cls, method).__module__ in allowed, (name, method)
        for fmt, writer in cls.serving_formats.items():
            assert getattr(writer, "func", writer).__module__ in {f"{home}.export" for home in homes}, (name, fmt)
