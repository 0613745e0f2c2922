"""Every shell command that README.md and the docs pages show in a ```bash block is read by the
parser that will read it: `specdraft ...` and `python -m specdraft ...` by our argparse parser,
`deepspeed ...` by DeepSpeed's launcher (`deepspeed.launcher.runner.parse_args`), `torchrun ...` by
torch.distributed.run's, `python bench/X.py ...` by that script's own parser, `python -c` by the
compiler and the imports it names; every `key=value` of `train`, `data`, `config` and `demo` is
loaded with the config it overrides, as the command itself would load them (the target and the
data are this test's). A line of a bash block that is none of the commands known here fails too:
prose a broken code fence left inside a block, or a command no parser here reads."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_TEXT = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# a fenced block, its indentation (a block inside a list item is indented) and language
FENCE = re.compile(r"^([ \t]*)```(\w*)[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(\.yaml)?")  # CONFIG, CONFIG.yaml, RUN: a synopsis's names
CONTROL = {"|", "||", "&&", ";", "&"}
REDIRECT = {">", ">>", "<", "2>", "&>"}
OVERRIDING = {"train", "data", "config", "demo"}  # the commands that take CONFIG [key=value ...]


def _name(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def bash_lines(paths=USER_TEXT):
    """(where, line) of every logical line (continuations joined) of every ```bash block; a comment
    `# or: COMMAND` is a command too, every other comment is dropped. A variable a line of the block
    assigns (`C="a=1 b=2"`) is expanded in the lines after it, as the shell would."""
    found = []
    for path in paths:
        text = path.read_text()
        for block in FENCE.finditer(text):
            indent, language, body = block.groups()
            if language != "bash":
                continue
            first = text.count("\n", 0, block.start()) + 2
            pending, start, variables = "", None, {}
            for offset, raw in enumerate(body.splitlines()):
                raw = raw[len(indent) :] if raw.startswith(indent) else raw
                start = first + offset if start is None else start
                if raw.rstrip().endswith("\\"):
                    pending += raw.rstrip()[:-1] + " "
                    continue
                line, pending = (pending + raw).strip(), ""
                where, start = f"{_name(path)}:{start}", None
                alternative = re.match(r"#\s*or:\s*(.+)", line)
                if alternative:
                    line = alternative.group(1)
                elif line.startswith("#"):
                    continue
                for name, value in variables.items():
                    line = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", lambda _: value, line)
                words = shlex.split(line, comments=True) if "$(" not in line else []
                if words and all(ASSIGNMENT.match(word) for word in words):
                    variables.update(word.split("=", 1) for word in words)
                if line:
                    found.append((where, line))
    return found


def simple_commands(line: str):
    """The simple commands of a shell line: split at |, &&, ;, cut at a redirection, trailing
    comments dropped. An assignment from a command substitution (X=$(...)) is not one."""
    if re.match(r"[A-Za-z_]\w*=\$\(", line):
        return []
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    commands, words, cut = [], [], False
    for token in lexer:
        if token in CONTROL:
            commands.append(words)
            words, cut = [], False
        elif token in REDIRECT:
            cut = True
        elif not cut:
            words.append(token)
    commands.append(words)
    return [words for words in commands if words]


def without_placeholders(words):
    """A synopsis's `[key=value ...]` / `[--plot FILE]` groups and `...` words dropped."""
    kept, depth = [], 0
    for word in words:
        if word.startswith("[") and not ASSIGNMENT.match(word):
            depth += 1
        if depth == 0 and word != "...":
            kept.append(word)
        if depth and word.endswith("]"):
            depth -= 1
    return kept


def parsed(parse, argv, what: str):
    """parse(argv) (an argparse parser's parse_args), its usage error (it would exit 2) raised as the
    test's failure; None for --help."""
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            return parse(argv)
        except SystemExit as exit_:
            if exit_.code in (0, None):  # --help
                return None
            lines = err.getvalue().strip().splitlines() or [f"exit {exit_.code}"]
            raise AssertionError(f"{what} {shlex.join(argv)}: {lines[-1]}") from None


# -- our commands --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """In place of the user's files (their target, data, imported draft, own config file), this
    test's: the overrides are loaded with these after them."""
    root = tmp_path_factory.mktemp("world")
    (root / "target").mkdir()
    (root / "d.jsonl").write_text("{}\n")
    (root / "empty.yaml").write_text("{}\n")
    return {
        "target": str(root / "target"),
        "data_files": str(root / "d.jsonl"),
        "eval_prompts": "null",
        "draft.init_from": str(root / "target"),
        "config": str(root / "empty.yaml"),
    }


def check_specdraft(argv, world):
    from specdraft.cli import build_parser
    from specdraft.config import demo_config_path, load_config

    args = parsed(build_parser().parse_args, argv, "specdraft")
    if args is None:
        return
    if args.command in OVERRIDING:
        if args.command == "demo":
            config = demo_config_path(args.config)
        elif PLACEHOLDER.fullmatch(args.config):
            config = None  # a synopsis: the overrides against the schema's defaults
        elif args.config.startswith("configs/") or (REPO / args.config).is_file():
            assert (REPO / args.config).is_file(), f"specdraft {args.command}: {args.config} is not shipped"
            config = str(REPO / args.config)
        else:  # a file of the user's own, not shown: the overrides say every key
            assert args.config.endswith((".yaml", ".yml")), f"specdraft {args.command}: config {args.config}?"
            config = world["config"]
        overrides = [item for item in args.overrides if item != "..."]
        given = {item.split("=", 1)[0] for item in overrides}
        theirs = [
            f"{key}={value}"
            for key, value in world.items()
            if key in ("target", "data_files", "eval_prompts") or (key in given and key != "config")
        ]
        try:
            load_config(config, [*overrides, *theirs])
        except Exception as err:  # the one-line SpecdraftError the command would print
            raise AssertionError(f"specdraft {shlex.join(argv)}: {err}") from None
    if args.command == "export" and args.out:  # our own rule: an export never goes inside its run
        run, out = Path(args.run_dir).resolve(), Path(args.out).resolve()
        assert run not in (out, *out.parents), f"specdraft {shlex.join(argv)}: --out inside the run is refused"


def check_deepspeed(argv, world):
    from deepspeed.launcher.runner import parse_args

    args = parsed(parse_args, argv, "deepspeed")
    if args.module:
        assert args.user_script == "specdraft", f"deepspeed --module {args.user_script}: not ours"
        # the launcher starts `python -u -m specdraft --local_rank=K USER_ARGS` per rank
        check_specdraft(["--local_rank=0", *args.user_args], world)
    else:
        check_script(args.user_script, args.user_args)


def check_torchrun(argv, world):
    from torch.distributed.run import get_args_parser

    args = parsed(get_args_parser().parse_args, argv, "torchrun")
    if args.module:
        assert args.training_script == "specdraft", f"torchrun -m {args.training_script}: not ours"
        check_specdraft(args.training_script_args, world)
    else:
        check_script(args.training_script, args.training_script_args)


class _Parsed(Exception):
    pass


def check_script(script: str, argv):
    """`python SCRIPT ARGS`: the script's own parser reads ARGS (its main() stops once parsed)."""
    path = REPO / script
    assert path.is_file() and path.suffix == ".py", f"{script}: no such script in this repository"
    spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    if not hasattr(module, "main"):
        spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        mock.patch.object(sys, "argv", [str(path), *argv]),
        redirect_stderr(err),
        redirect_stdout(io.StringIO()),
    ):
        try:
            module.main()
        except _Parsed:
            return
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return
            raise AssertionError(
                f"python {script} {shlex.join(argv)}: {err.getvalue().strip().splitlines()[-1]}"
            ) from None
    raise AssertionError(f"python {script}: main() returned without parsing its arguments")


def check_python_code(code: str):
    """`python -c CODE`: it compiles, and each `from X import Y` finds Y in X."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"python -c: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


def check_python(argv, world):
    if argv[:2] == ["-m", "specdraft"]:
        return check_specdraft(argv[2:], world)
    if argv[:1] == ["-m"]:
        module = argv[1]
        if module.split(".")[0] in EXTERNAL_MODULES:
            return
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        return
    if argv[:1] == ["-c"]:
        return check_python_code(argv[1])
    check_script(argv[0], argv[1:])


EXTERNAL_MODULES = {"sglang"}  # servers of their own venvs, not installed here


def check_vllm(argv, world):
    """vLLM is not installed here; what it reads of ours is the JSON of --speculative-config."""
    assert argv[:1] == ["serve"], f"vllm {shlex.join(argv)}"
    for flag, value in zip(argv, argv[1:]):
        if flag == "--speculative-config":
            config = json.loads(value)
            assert config.get("method") in {"eagle3", "dflash", "mtp", "dspark"}, config


def check_make(argv, world):
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    for word in argv:
        if not ASSIGNMENT.match(word):
            assert word in targets, f"make {word}: no such target in the Makefile"


def check_activate(argv, world):
    """`. VENV/bin/activate`"""
    assert len(argv) == 1 and argv[0].endswith("/bin/activate"), argv


def check_pip(argv, world):
    """`pip install -e '.[a,b]'`: those extras exist."""
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for word in argv:
        match = re.fullmatch(r"(?:\.|specdraft)\[([\w,]+)\]", word)
        if match:
            assert set(match.group(1).split(",")) <= extras, f"pip: {word}: no such extra"


PROGRAMS = {
    "specdraft": check_specdraft,
    "deepspeed": check_deepspeed,
    "torchrun": check_torchrun,
    "python": check_python,
    "python3": check_python,
    "vllm": check_vllm,
    "make": check_make,
    "pip": check_pip,
    ".": check_activate,
    "source": check_activate,
}
WRAPPERS = {"nice", "srun"}


def check_command(words, world):
    while words and ASSIGNMENT.match(words[0]):  # VAR=value before the program
        words = words[1:]
    while words and words[0] in WRAPPERS:
        words = words[1:]
    if not words:
        return None  # an assignment alone
    program = words[0] if words[0] == "." else Path(words[0]).name  # .venv/bin/specdraft is specdraft
    assert program in PROGRAMS, (
        f"`{words[0]}` is not a command this test reads: prose inside a bash "
        f"block (a broken fence?), or a program to teach the test"
    )
    PROGRAMS[program](without_placeholders(words[1:]), world)
    return program


LINES = bash_lines()


def commands_shown():
    """Each simple command of the pages, its VAR=value prefix dropped."""
    return [
        words
        for _, line in LINES
        for words in simple_commands(line)
        for words in [[w for w in words if not ASSIGNMENT.match(w)]]
        if words
    ]


def test_the_pages_show_every_kind_of_command():
    shown = [Path(words[0]).name for words in commands_shown()]
    assert shown.count("specdraft") >= 20 and shown.count("deepspeed") >= 5 and shown.count("torchrun") >= 3
    assert shown.count("python") >= 10
    lines = [line for _, line in LINES]
    assert any("-m specdraft" in line and line.startswith("torchrun") for line in lines)
    assert any("--module specdraft" in line for line in lines)
    subcommands = {words[1] for words in commands_shown() if words[0] == "specdraft"}
    assert subcommands >= {"train", "eval", "regenerate", "config", "data", "demo", "export"}


@pytest.mark.parametrize("where, line", LINES, ids=[where for where, _ in LINES])
def test_every_command_shown_is_read_by_its_parser(where, line, world):
    for words in simple_commands(line):
        try:
            check_command(words, world)
        except AssertionError as err:
            raise AssertionError(f"{where}: {err}") from None


# -- the checks themselves, on planted commands ----------------------------------------------------


@pytest.mark.parametrize(
    "bad, says",
    [
        ("deepspeed --num_gpus 8 -m specdraft train configs/qwen3-8b-eagle3.yaml", "unrecognized arguments: -m"),
        ("torchrun --nproc_per_node 8 specdraft train configs/demo.yaml", "no such script"),
        ("specdraft train configs/demo.yaml max_stepz=3", "max_stepz"),
        ("specdraft train configs/demo.yaml draft.max_lag=three", "max_lag"),
        ("specdraft train configs/demo-eagle3.yaml draft.max_lag=3", "max_lag"),  # another family's key
        ("specdraft train configs/nowhere.yaml", "not shipped"),
        ("specdraft train my.yaml draft.type=eagle3 draft.ttt_stepz=2", "ttt_stepz"),
        ("specdraft eval runs/x --prompts p.jsonl --temprature 0.7", "unrecognized arguments"),
        ("specdraft export runs/x --out runs/x/exports", "inside the run"),
        ("python -m specdraft tran configs/demo.yaml", "invalid choice"),
        ("OMP_NUM_THREADS=1 python bench/acceptance.py --preset bench --gama 4", "unrecognized arguments"),
        ("python bench/nowhere.py", "no such script"),
        ("python -c 'from specdraft.demo.assets import no_such_name'", "no_such_name"),
        ("make dmeo", "no such target"),
        ("Each rank takes the GPU of its LOCAL_RANK", "not a command"),
    ],
)
def test_a_planted_bad_command_fails(bad, says, world):
    with pytest.raises(AssertionError, match=re.escape(says)):
        for words in simple_commands(bad):
            check_command(words, world)


def test_a_good_command_passes_and_the_lines_are_read_as_a_shell_reads_them(world, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n  ```bash\n  OMP_NUM_THREADS=1 specdraft train configs/demo.yaml \\\n"
        "      max_steps=3 draft.max_lag=2   # a comment\n  # or: torchrun --nproc_per_node 2 -m "
        "specdraft train configs/demo.yaml ...\n  # prose\n  ```\n"
    )
    lines = bash_lines([page])
    assert [where.split(":")[1] for where, _ in lines] == ["4", "6"]
    assert simple_commands(lines[0][1]) == [
        ["OMP_NUM_THREADS=1", "specdraft", "train", "configs/demo.yaml", "max_steps=3", "draft.max_lag=2"]
    ]
    for _, line in lines:
        for words in simple_commands(line):
            check_command(words, world)
    assert simple_commands("EXPORT=$(ls -d runs/x/step_* | sort -V | tail -1)") == []
    assert simple_commands("python -m specdraft.commands.config_reference > docs/x.md") == [
        ["python", "-m", "specdraft.commands.config_reference"]
    ]
    assert without_placeholders(["train", "CONFIG.yaml", "[key=value", "...]", "x=[1,2]"]) == [
        "train",
        "CONFIG.yaml",
        "x=[1,2]",
    ]


def test_the_deepspeed_launcher_is_the_one_that_reads_the_command():
    """`deepspeed --module specdraft` hands `--local_rank=K` to our parser before the command."""
    from deepspeed.launcher.runner import parse_args

    from specdraft.cli import build_parser

    args = parse_args(["--num_gpus", "8", "--module", "specdraft", "train", "configs/demo.yaml", "max_steps=3"])
    assert args.module and args.user_script == "specdraft"
    ours = build_parser().parse_args(["--local_rank=3", *args.user_args])
    assert (ours.command, ours.overrides) == ("train", ["max_steps=3"])
    assert os.environ.get("RANK", "0") == "0"  # our parser's usage errors are printed on rank 0 only
