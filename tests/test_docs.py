"""The documentation: the README stays short, the site builds with --strict, what the pages show a
user to copy (YAML configs, commands, config files) exists and loads, the configuration reference
names exactly the schema's keys, and the troubleshooting page quotes errors the code still raises."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.config import load_config
from specdraft.drafts.registry import FAMILIES

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
USER_TEXT = [REPO / "README.md", *PAGES]


def code_blocks(language: str):
    """(file name, block) of every fenced block in that language, README and docs pages."""
    return [
        (path.relative_to(REPO).as_posix(), block)
        for path in USER_TEXT
        for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)
    ]


def test_readme_reads_in_five_minutes():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_site_builds_with_strict_links_anchors_and_nav(tmp_path):
    """mkdocs --strict: a broken link or anchor, or a page left out of nav, fails the build."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "config-reference" / "index.html").is_file()


# -- the configuration reference -----------------------------------------------------------------


def schema_keys():
    from omegaconf import DictConfig, OmegaConf

    from specdraft.config.schema import TrainConfig, _all_keys

    schema = OmegaConf.structured(TrainConfig)
    return {key for key in _all_keys(schema) if not isinstance(OmegaConf.select(schema, key), DictConfig)}


def reference_page_keys():
    text = (DOCS / "config-reference.md").read_text()
    return re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M)


def test_the_reference_names_every_schema_key_once_and_no_other():
    keys = reference_page_keys()
    assert len(keys) == len(set(keys))
    assert set(keys) == schema_keys()
    assert {
        "eval_prompts",
        "eval_steps",
        "keep_last",
        "seed",
        "thinking",
        "export_formats",
        "draft.type",
        "draft.init_from",
        "draft.markov_rank",
        "wandb.project",
    } <= set(keys)


def test_the_reference_page_is_the_generated_one():
    from specdraft.commands.config_reference import reference_markdown

    assert (DOCS / "config-reference.md").read_text() == reference_markdown(), (
        "docs/config-reference.md is stale: run `make docs` (python -m specdraft.commands.config_reference)"
    )


def test_every_key_has_a_type_a_default_its_families_and_a_meaning():
    from specdraft.commands.config_reference import reference_rows

    rows = {row[0]: row for row in reference_rows()}
    assert all(
        kind and default and families and meaning.strip() for _, kind, default, families, meaning in rows.values()
    )
    assert rows["draft.max_lag"][1:4] == ("int", "4", "glide")
    assert rows["draft.block_size"][3] == "dflash, dspark, dflash2"
    from specdraft.drafts import family_keys

    with_loss = [family for family, cls in FAMILIES.items() if "loss" in family_keys(cls)]  # MTP: CE only
    assert rows["draft.loss"][3] == ("all" if len(with_loss) == len(FAMILIES) else ", ".join(with_loss))
    assert rows["target"][2] == "required"
    assert rows["draft.draft_vocab_size"][1:3] == ("int or null", "null")
    # a key two families read with other meanings gets each family's
    assert (
        rows["draft.target_layers"][4].startswith("eagle3, peagle: ")
        and "dflash, dspark, dflash2: " in rows["draft.target_layers"][4]
    )


def test_a_field_s_meaning_is_its_trailing_comment_or_the_comment_lines_above_it():
    from dataclasses import dataclass

    from specdraft.commands.config_reference import field_comments

    @dataclass
    class Base:
        a: int = 1  # trailing

    @dataclass
    class Options(Base):
        # above, line one
        # and line two
        b: str = "x"
        c: int = 2  # c's own
        # not c's: it is below c
        d: bool = False

    assert field_comments(Options) == {
        "a": "trailing",
        "b": "above, line one and line two",
        "c": "c's own",
        "d": "not c's: it is below c",
    }


# -- what the pages show a user to copy ----------------------------------------------------------

YAML_BLOCKS = code_blocks("yaml")


def test_the_pages_show_yaml_configs():
    assert len(YAML_BLOCKS) >= 5  # the training config and each family's draft section


@pytest.mark.parametrize(
    "index", range(len(YAML_BLOCKS)), ids=[f"{name}#{i}" for i, (name, _) in enumerate(YAML_BLOCKS)]
)
def test_every_yaml_block_is_a_valid_config(index, tmp_path):
    """What a page shows a user to copy must load: its keys, types and values (the target and
    data are this test's; the target has no config.json, so layer ids are checked at training)."""
    (tmp_path / "t").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    block = tmp_path / "block.yaml"
    block.write_text(YAML_BLOCKS[index][1])
    cfg = load_config(str(block), [f"target={tmp_path / 't'}", f"data_files={tmp_path}/d.jsonl", "eval_prompts=null"])
    assert cfg.draft.type in FAMILIES


def test_every_config_file_the_pages_name_is_shipped():
    named = {m for path in USER_TEXT for m in re.findall(r"configs/([\w.-]+\.yaml)", path.read_text())}
    assert named and all((REPO / "configs" / m).is_file() for m in named), sorted(named)


def test_every_error_quoted_in_troubleshooting_is_still_raised_by_the_code():
    import ast

    texts = []  # the code's string literals (implicit concatenations joined), f-strings' literal runs
    for path in (REPO / "specdraft").rglob("*.py"):
        texts += [
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
    source = "\n".join(texts)
    text = (DOCS / "troubleshooting.md").read_text()
    # the first column's quoted fragments; a parenthesis there holds an example, not the message
    quoted = [
        re.findall(r"`([^`]+)`", re.sub(r"\(`[^)]*\)", "", row.split(" | ")[0]))
        for row in text.splitlines()
        if row.startswith("| `")
    ]
    fragments = [f for row in quoted for f in row]
    assert len(fragments) >= 40
    missing = [f for f in fragments if f not in source]
    assert not missing, missing


# -- the install story: pyproject's ranges are what the suite runs ----------------------------------


def test_each_dependency_floor_is_the_pinned_version_and_its_ceiling_the_next_major():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    torch_pin = re.search(r"TORCH\s+\?=\s+torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    pins["torch"] = torch_pin
    requirements = project["dependencies"] + [
        r for extra, reqs in project["optional-dependencies"].items() if extra != "wandb" for r in reqs
    ]
    for requirement in requirements:
        name, floor, ceiling = re.fullmatch(r"([\w-]+)(?:\[\w+\])?>=([\d.]+),<([\d.]+)", requirement).groups()
        assert floor == pins[name.lower()], requirement
        major = int(floor.split(".")[0])
        assert ceiling == (str(major + 1) if major else "1"), requirement
    assert not any(r.startswith("matplotlib") for r in project["dependencies"])  # an extra: specdraft[plots]


def test_every_file_of_ours_the_pages_name_exists():
    """A path into this repository (specdraft/..., tests/..., bench/..., drafts/..., a test_*.py)
    names a file that is there: moving a module means updating the pages that name it."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    ours = r"(?:(?:specdraft|tests|bench|drafts|train|decode|data|target|demo)/[\w./-]*|test_\w*)\.py"
    named = {
        (path.relative_to(REPO).as_posix(), m)
        for path in USER_TEXT
        for m in re.findall(rf"(?<![\w/.-])({ours})\b", path.read_text())
    }
    missing = sorted((page, m) for page, m in named if not any(f == m or f.endswith("/" + m) for f in files))
    assert len(named) >= 30 and not missing, missing


# -- pages that speak of the product, not of how it was made -----------------------------------------

PROCESS_WORDS = re.compile(
    r"\bissues?\s*#?\d+"  # issue 4, issues 12
    r"|(?<![\w/&])(?<!\]\()#\d+\b"  # #45 (a link's anchor, a URL's fragment, &#8212; are not)
    r"|\b(?:the|this|that|our|an?)\s+issues?\b|\bissue's"  # "the issue's goals"
    r"|\bbranch\b|\bsessions?\b|\bworktrees?\b"  # (a tree's "branches" are the product's)
    r"|\bhelpers?\b(?!\.py)|\bagents?\b|\breviewers?\b|\bengineers?\b"  # who ran what
    r"|\b(?:reached|into|onto|on|after)\s+main\b",  # a branch by its name
    flags=re.I,
)


def process_words(text: str):
    return [m.group(0) for m in PROCESS_WORDS.finditer(text)]


def test_no_page_names_an_issue_a_branch_a_session_or_who_ran_what():
    found = {
        path.relative_to(REPO).as_posix(): words
        for path in USER_TEXT
        for words in [process_words(path.read_text())]
        if words
    }
    assert not found, found


@pytest.mark.parametrize(
    "text",
    [
        "as issue 4 asked",
        "fixed in #45.",
        "(#45)",
        "The issue's goals hold",
        "(sppeagle branch; every other row)",
        "load average 1.7 from an editor session",
        "beside three other helpers' jobs",
        "other agents' tests",
        "LK had not reached main",
        "merged after main",
    ],
)
def test_the_process_words_test_finds_a_planted_one(text):
    assert process_words(text)


@pytest.mark.parametrize(
    "text",
    [
        "[the main table](acceptance.md#acceptance-on-the-bench-target)",
        "tests/helpers.py builds it",
        "https://github.com/sgl-project/SpecForge/pull/271",
        "a tree's branches",
        "&#8212;",
        "[x](#45-steps)",
    ],
)
def test_the_process_words_test_passes_product_text(text):
    assert process_words(text) == []


def test_every_code_fence_closes_at_its_own_indentation():
    """An unclosed or mis-indented fence turns the prose after it into code (and the next block's
    code into prose)."""
    for path in USER_TEXT:
        opened = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fence = re.match(r"([ \t]*)```(\w*)\s*$", line)
            if not fence:
                continue
            if opened is None:
                opened = (number, fence.group(1))
            else:
                assert fence.group(1) == opened[1] and not fence.group(2), (
                    f"{path.relative_to(REPO)}:{opened[0]}: the fence opened here closes at line {number} as {line!r}"
                )
                opened = None
        assert opened is None, f"{path.relative_to(REPO)}:{opened[0]}: a fence that never closes"


def test_pages_stay_short_enough_to_read():
    """A page of the site is at most ~300 lines (the benchmarks were one page of 1,286)."""
    long = {
        path.relative_to(REPO).as_posix(): n
        for path in PAGES
        for n in [len(path.read_text().splitlines())]
        if n > (300 if "benchmarks" in path.parts else 320)
    }
    assert not long, long


def test_requires_python_is_the_floor_our_dependencies_set():
    """pyproject's requires-python is the highest floor of the dependencies at their pinned versions
    (what pip would refuse anyway), and the README says the same version."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, metadata

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for requirement in project["dependencies"]:
        name = re.match(r"[\w-]+", requirement).group(0)
        try:
            needs = metadata(name).get("Requires-Python") or ""
        except PackageNotFoundError:
            continue
        match = re.search(r">=\s*(\d+)\.(\d+)", needs)
        if match:
            floors[name] = (int(match.group(1)), int(match.group(2)))
    ours = tuple(int(n) for n in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    assert len(floors) >= 5 and ours == max(floors.values()), (project["requires-python"], floors)
    assert f"Python {ours[0]}.{ours[1]}" in (REPO / "README.md").read_text()
