"""A property test that hunts for the next way a command loses a user's file.

A tree of user things (folders and files named X, X.old, X.tmp, X.bak, a `specdraft.jsonl`, a
`specdraft.json` of the user's own, symlinks to folders and files, an immutable folder) beside
things of ours (a run with a committed slot, an export, a `regenerate` output); then seeded random
sequences (hypothesis) of `export --out`, `train` / `demo` with `output_dir` and `resume` pointed
into the tree, `consolidate`, `regenerate --out` and `eval --plot`, run in-process as the CLI runs.

After every command:
- every byte of every user file survives, every symlink still points where it did;
- every file of every committed slot survives (a rollback may move a later slot aside, within
  its run's ckpt/, byte for byte), and so does every regenerated row;
- the command wrote only inside what it owns: new paths appear only under the directory or file it
  was pointed at (its run's consolidated/ for `consolidate`);
- it exits 0, or refuses with exit 2 in one line (no traceback) and changed nothing at all.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_overrides, train_run
from specdraft.cli import main

OURS = ("run", "export", "regen")  # the template's things of ours; everything else is the user's
# where a command may be pointed: user things, ours, new names beside and inside them
TARGETS = [
    "X",
    "X.old",
    "X.tmp",
    "X.bak",
    "X/new",
    "empty",
    "empty",
    "empty.old",
    "new",
    "new/deeper",
    "link_dir",
    "link_file",
    "link_dangling",
    "link_run",
    "data_only",
    "own_marker",
    "locked",
    "locked/new",
    "specdraft.jsonl",
    "run",
    "run/new",
    "run/step_1",
    "run/ckpt",
    "export",
    "export/new",
    "regen",
    ".",
]
EXAMPLES = int(os.environ.get("SPECDRAFT_PROPERTY_EXAMPLES", "200"))


def snapshot(root: Path) -> dict:
    """{relative path: sha256 | "dir" | "-> target"} of everything under root (links not followed)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def is_user_path(rel: str) -> bool:
    return rel.split("/", 1)[0] not in OURS


SLOT_FILE = re.compile(r"(?P<run>.*?)ckpt/(?P<slot>step_\d+)(?P<aside>\.abandoned(-\d+)?)?/(?P<file>.+)")


def committed_slot_files(root: Path, shot: dict) -> dict:
    """{(run, slot, file): {sha256, ...}} of the files of every committed slot (moved aside or not)."""
    found = {}
    for rel, value in shot.items():
        match = SLOT_FILE.fullmatch(rel)
        if match and value not in ("dir",) and not value.startswith("-> "):
            slot_dir = root / match["run"] / "ckpt" / (match["slot"] + (match["aside"] or ""))
            if (slot_dir / "COMMITTED").is_file():
                found.setdefault((match["run"], match["slot"], match["file"]), set()).add(value)
    return found


def rows(shot: dict) -> dict:
    return {
        rel: v for rel, v in shot.items() if rel.startswith("regen/") and rel.endswith(".jsonl") and "/." not in rel
    }


class immutable:
    """chattr +i as root (which ignores mode bits); chmod 555 otherwise."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        if os.geteuid() == 0:
            proc = subprocess.run(["chattr", "+i", str(self.path)], capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"chattr +i failed here ({proc.stderr.strip()})")
        else:
            self.path.chmod(0o555)

    def __exit__(self, *exc):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


@pytest.fixture(scope="module")
def template(tiny_target_dir, tiny_data, data_dir, tmp_path_factory):
    """The tree every example starts from (copied), and the files the commands read."""
    root = tmp_path_factory.mktemp("property") / "tree"
    inputs = root.parent / "inputs"
    inputs.mkdir()
    prompts = inputs / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": line["prompt"]}) + "\n"
            for line in map(json.loads, Path(tiny_data.prompts_file).read_text().splitlines()[:2])
        )
    )
    train_run(tiny_target_dir, data_dir, root, "run", max_steps=1, save_steps=1, keep_last=3)
    assert main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    assert (
        main(
            [
                "regenerate",
                "--target",
                str(tiny_target_dir),
                "--data",
                str(prompts),
                "--out",
                str(root / "regen"),
                "--max-new-tokens",
                "4",
                "--rows-per-shard",
                "1",
            ]
        )
        == 0
    )
    for name in ("X", "X.old", "X.tmp", "X.bak"):
        (root / name).mkdir()
        (root / name / "weights.bin").write_bytes(os.urandom(48))
    (root / "X" / "a.txt").write_text("mine\n")
    (root / "empty").mkdir()
    for name in ("empty.old", "empty.tmp"):  # the names an atomic writer would reach for beside `empty`
        (root / name).mkdir()
        (root / name / "backup.bin").write_bytes(os.urandom(16))
    (root / "data_only").mkdir()
    (root / "data_only" / "specdraft.jsonl").write_text('{"prompt": "hello"}\n')
    (root / "specdraft.jsonl").write_text('{"prompt": "hi"}\n')
    (root / "own_marker").mkdir()
    (root / "own_marker" / "specdraft.json").write_text('{"kind": "export", "note": "my settings"}\n')
    (root / "locked").mkdir()
    (root / "locked" / "keep.txt").write_text("locked\n")
    for link, target in (("link_dir", "X"), ("link_file", "X/a.txt"), ("link_dangling", "gone"), ("link_run", "run")):
        (root / link).symlink_to(target)
    config = inputs / "train.yaml"
    config.write_text(
        "".join(
            f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}\n"
            for o in run_overrides(
                tiny_target_dir, data_dir, root / "unused", inputs / "cache", max_steps=2, save_steps=1, keep_last=3
            )
        )
    )
    return root, dict(
        prompts=prompts,
        config=config,
        home=Path(tiny_target_dir).parents[1],
        target=tiny_target_dir,
        cache=inputs / "cache",
    )


def command(kind: str, where: str, resume: str, root: Path, inputs: dict) -> tuple:
    """(argv, the paths it may write under) for one command pointed at `where`."""
    path, run = root / where, root / "run"
    if kind == "export":
        return ["export", run, "--out", path], [path]
    if kind == "export_default":
        return ["export", run], [run / "export_step_1", run / "export_step_2"]
    if kind == "consolidate":
        return ["consolidate", run], [run / "consolidated"]
    if kind == "regenerate":
        return (
            [
                "regenerate",
                "--target",
                inputs["target"],
                "--data",
                inputs["prompts"],
                "--out",
                path,
                "--max-new-tokens",
                "4",
                "--rows-per-shard",
                "1",
            ],
            [path],
        )
    if kind == "eval_plot":
        plot = path / "acc.png" if path.is_dir() or not path.exists() else path  # a user's file: refused
        return (
            [
                "eval",
                run,
                "--prompts",
                inputs["prompts"],
                "--max-prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
                "--plot",
                plot,
            ],
            [plot],
        )
    resume_value = {
        "auto": "auto",
        "no": "no",
        "run_slot": run / "ckpt" / "step_1",
        "own_slot": path / "ckpt" / "step_1",
    }[resume]
    overrides = [f"output_dir={path}", f"resume={resume_value}"]
    if kind == "demo":  # the tiny preset's assets, trained as briefly as the config above
        return [
            "demo",
            "--preset",
            "tiny",
            *overrides,
            "max_steps=2",
            "save_steps=1",
            "keep_last=3",
            "eval_steps=-1",
            "max_seq_length=64",
            "per_device_batch_size=4",
            f"data_cache_dir={inputs['cache']}",
        ], [path]
    return ["train", inputs["config"], *overrides], [path]


def under(rel: str, roots: list, root: Path) -> bool:
    """Whether root/rel is one of `roots`, inside one (where it points, for a link), or a folder
    made to hold one (a missing parent)."""
    here, full = root / rel, Path(os.path.realpath(root / rel))
    for allowed in map(Path, roots):
        real = Path(os.path.realpath(allowed))
        if here == allowed or allowed in here.parents or full == real or real in full.parents:
            return True
        if here.is_dir() and not here.is_symlink() and here in allowed.parents:
            return True
    return False


steps = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "export",
                "export",
                "export_default",
                "train",
                "train",
                "demo",
                "consolidate",
                "regenerate",
                "regenerate",
                "eval_plot",
            ]
        ),
        st.sampled_from(TARGETS),
        st.sampled_from(["auto", "no", "run_slot", "own_slot"]),
    ),
    min_size=1,
    max_size=3,
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=steps)
def test_no_command_sequence_loses_a_byte_of_the_users_or_a_committed_slot(
    template, tmp_path, monkeypatch, capsys, sequence
):
    source, inputs = template
    monkeypatch.setenv("SPECDRAFT_HOME", str(inputs["home"]))  # `demo --preset tiny`: the test's own assets
    root = tmp_path / f"ex{len(list(tmp_path.iterdir()))}"
    shutil.copytree(source, root, symlinks=True)
    with immutable(root / "locked"):
        for kind, where, resume in sequence:
            argv, allowed = command(kind, where, resume, root, inputs)
            before = snapshot(root)
            capsys.readouterr()
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exit_:  # argparse
                code = exit_.code
            err = capsys.readouterr().err
            after = snapshot(root)
            what = f"{' '.join(map(str, argv))} -> {code}: {err.strip()[-500:]}"
            assert code in (0, 2), what
            if code == 2:
                lines = [l for l in err.strip().splitlines() if "error" in l.lower()]
                assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("specdraft: error: "), what
                assert after == before, (what, set(after.items()) ^ set(before.items()))
                continue
            for rel, value in before.items():  # every link of the user's still points where it did
                if is_user_path(rel) and value.startswith("-> "):
                    assert after.get(rel) == value, (what, "link moved or gone", rel)
            user_files = {
                rel: v for rel, v in before.items() if is_user_path(rel) and v != "dir" and not v.startswith("-> ")
            }
            for rel, value in user_files.items():
                assert after.get(rel) == value, (what, "user file changed or gone", rel)
            slots_before, slots_after = committed_slot_files(root, before), committed_slot_files(root, after)
            for key, values in slots_before.items():
                assert values <= slots_after.get(key, set()), (what, "committed slot file changed or gone", key)
            for rel, value in rows(before).items():
                assert after.get(rel) == value, (what, "regenerated rows changed or gone", rel)
            for rel in set(after) - set(before):
                assert under(rel, allowed, root), (what, "written outside what it was pointed at", rel)
