"""The tests' recipes live once, in tests/helpers.py: the environment and command that launch
DeepSpeed on CPU (launch_env, one_rank_env, rendezvous_env, torchrun_command), and a small run's
overrides (run_overrides), which the torchrun scripts use rather than spell again. A copy drifts:
one test would launch, or train, otherwise than the others without anyone deciding it."""

import ast
from pathlib import Path

import pytest

from helpers import launch_env, one_rank_env, run_overrides, torchrun_command

TESTS = Path(__file__).resolve().parent
# what only helpers.py spells: DeepSpeed's accelerator, a rendezvous, a torchrun command line
LAUNCH_NAMES = {"DS_ACCELERATOR", "MASTER_ADDR", "MASTER_PORT", "torch.distributed.run", "--nproc_per_node"}


def launch_spellings(source: str) -> list:
    """(line, name) where source spells a name of LAUNCH_NAMES: a string equal to it (an
    environment key, a command-line word) or a keyword argument (dict(os.environ, DS_ACCELERATOR=...))."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in LAUNCH_NAMES:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg in LAUNCH_NAMES:
            found.append((node.value.lineno, node.arg))
    return sorted(found)


def small_run_keys() -> list:
    """The keys of the small-run values run_overrides gives (not the four paths it is given)."""
    paths = {"T", "D/*.jsonl", "O", "C"}
    return [o.split("=", 1)[0] for o in run_overrides("T", "D", "O", "C") if o.split("=", 1)[1] not in paths]


def override_spellings(source: str, keys) -> list:
    """(line, text) where source spells one of keys as an override string ("max_seq_length=64",
    f"seed={n}"): a value passed to run_overrides as a keyword argument is not one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(node.value.startswith(f"{key}=") for key in keys):
                found.append((node.lineno, node.value))
    return sorted(found)


def script_modules() -> list:
    """The torchrun scripts (tests/*_script.py) and the modules of tests/ they import (their runs'
    recipes: offline_runs.py), helpers.py apart."""
    scripts = sorted(TESTS.glob("*_script.py"))
    imported = set()
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (TESTS / f"{node.module}.py").is_file():
                imported.add(TESTS / f"{node.module}.py")
    return scripts + sorted(imported - set(scripts) - {TESTS / "helpers.py"})


def test_only_helpers_spells_the_cpu_launch_environment_and_command():
    others = [p for p in sorted(TESTS.glob("*.py")) if p.name not in ("helpers.py", Path(__file__).name)]
    assert len(others) > 50  # the scan sees the suite
    found = {p.name: spelled for p in others if (spelled := launch_spellings(p.read_text()))}
    assert found == {}, f"use helpers.launch_env / one_rank_env / rendezvous_env / torchrun_command: {found}"


def test_the_torchrun_scripts_take_a_small_runs_values_from_run_overrides():
    keys = small_run_keys()
    assert {"max_seq_length", "per_device_batch_size", "learning_rate", "warmup_steps", "seed"} <= set(keys)
    modules = script_modules()
    assert TESTS / "dist_script.py" in modules and TESTS / "offline_runs.py" in modules
    found = {p.name: spelled for p in modules if (spelled := override_spellings(p.read_text(), keys))}
    assert found == {}, f"pass what differs to helpers.run_overrides: {found}"


@pytest.mark.parametrize(
    "planted",
    [
        'env = dict(os.environ, DS_ACCELERATOR="cpu")',
        'os.environ["MASTER_PORT"] = str(port)',
        'monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")',
        'os.environ.update(RANK="0", MASTER_PORT=str(port))',
        'cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script]',
    ],
)
def test_a_planted_launch_spelling_is_seen(planted):
    assert launch_spellings(planted)


def test_prose_naming_a_launch_variable_is_not_a_spelling():
    assert not launch_spellings('"""MASTER_PORT: the launcher sets it."""  # and DS_ACCELERATOR')


@pytest.mark.parametrize(
    "planted,seen",
    [
        ('load_config(None, [f"target={t}", "max_seq_length=64"])', True),
        ('args = [f"warmup_steps={STEPS}", "seed=3"]', True),
        ("run_overrides(t, d, o, c, max_seq_length=128, warmup_steps=3)", False),  # what differs: allowed
        ('args = ["max_steps=4", "zero_stage=2"]', False),  # not a small-run value
    ],
)
def test_a_planted_override_spelling_is_seen(planted, seen):
    assert bool(override_spellings(planted, small_run_keys())) == seen


def test_the_launch_environment(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "5")
    env = launch_env(EXTRA="x")
    assert (env["DS_ACCELERATOR"], env["OMP_NUM_THREADS"], env["EXTRA"]) == ("cpu", "1", "x")
    assert env["PYTHONPATH"] == str(TESTS.parent)
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(env)  # not ours
    one = launch_env(one_rank=True)
    assert {k: one[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert int(one["MASTER_PORT"]) > 0 and one_rank_env(7)["MASTER_PORT"] == "7"


def test_the_torchrun_command():
    cmd = torchrun_command(Path("s.py"), "a", 3, port=9)
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "9",
        "s.py",
        "a",
        "3",
    ]
    node = torchrun_command("s.py", nproc=1, port=9, nodes=2, node_rank=1)
    assert node[3:7] == ["--nnodes", "2", "--node_rank", "1"] and node[node.index("--nproc_per_node") + 1] == "1"


def test_run_overrides_leaves_out_a_none():
    spelled = run_overrides("T", "D", None, "C", seed=None, max_steps=2)
    assert not any(o.startswith(("output_dir=", "seed=")) for o in spelled) and "max_steps=2" in spelled
