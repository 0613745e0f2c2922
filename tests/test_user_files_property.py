"""A property test that hunts for the next way a command loses a user's file.

A tree of user things (folders and files named X, X.old, X.tmp, X.bak, a `specdraft.jsonl`, a
`specdraft.json` of the user's own, symlinks to folders and files, an immutable folder) beside
things of ours (a run with two committed slots, a copy of it whose newest slot is damaged, an
export, a `regenerate` output); then sequences of `export --out`, `export`, `consolidate`,
`regenerate --out`, `eval --plot`, and `train` / `demo` with `output_dir` and `resume` pointed into
the tree, run in-process as the CLI runs: first every command at every kind of target (TARGETS),
once each from the template, then seeded random sequences (hypothesis).

After every command:
- every byte of every user file survives, every symlink still points where it did;
- every committed slot there was (COMMITTED and every file) is still there, byte for byte, unless
  the command trained that slot's run and did what a resume may do there: a rollback
  (resume=<slot of this run>) moves the later slots aside (.abandoned), resume=auto moves a
  damaged slot aside (.rejected), and a save prunes a slot that has keep_last newer committed ones;
- every regenerated row survives;
- new paths appear only where the command may write (ownership.py): a folder that was new or
  empty, or one whose marker says specdraft made it for that command (through a link, where it
  points); the run's export_step_<N> / consolidated/step_<N>; the plot file named;
- it exits 0, or refuses with exit 2 in one line (no traceback) and changed nothing at all, but
  for the damaged slots a resume=auto set aside (.rejected) before refusing: plan_resume moves
  them before it checks the next slot, and before claim_run_dir.

Over the whole test, enough commands succeed (FLOOR) and each path a resume can take is reached: a
regression that refuses everything fails it too.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import run_overrides, train_run
from specdraft.cli import main
from speculators_env import in_ci

OURS = ("run", "damaged", "export", "regen")  # the template's things of ours; everything else is the user's
# where a command may be pointed, by kind: the grid sends every command to the first of each kind
TARGETS = {
    "new": ["new", "new/deeper"],
    "empty": ["empty"],
    "user_dir": ["X", "X.old", "X.tmp", "X.bak", "empty.old", "data_only", "own_marker", "."],
    "new_in_user_dir": ["X/new"],
    "locked": ["locked", "locked/new"],
    "file": ["specdraft.jsonl", "link_file"],
    "link_dir": ["link_dir"],
    "dangling_link": ["link_dangling"],
    "run": ["run"],
    "damaged_run": ["damaged"],
    "link_run": ["link_run"],
    "in_run": ["run/new", "run/step_1", "run/ckpt"],
    "export": ["export"],
    "in_export": ["export/new"],
    "regen": ["regen"],
}
AGAIN = "again"  # a random step's target: the previous step's (a run it made, an export it wrote ...)
RESUMES = ["auto", "no", "run_slot", "own_slot"]
TRAINING = ("train", "demo")
POINTED = ("export", "regenerate", "eval_plot", *TRAINING)  # the commands a target is given to
KEEP_LAST = 2  # the trains' keep_last: a resume of `run` (step_1, step_2) to step 3 prunes step_1
EXAMPLES = int(os.environ.get("SPECDRAFT_PROPERTY_EXAMPLES", "60"))
# what must have succeeded over the whole test (the grid alone reaches each)
FLOOR = {"train": 18, "demo": 4, "export": 4, "regenerate": 4, "eval_plot": 6, "export_default": 1, "consolidate": 1}
# the kinds of target each command must succeed at: a new or empty folder, one of its own
MUST_SUCCEED = {
    "train": ("new", "empty", "new_in_user_dir", "run", "damaged_run", "link_run", "in_export"),
    "demo": ("new", "empty"),
    "export": ("new", "empty", "export"),
    "regenerate": ("new", "empty", "regen"),
    "eval_plot": ("empty", "user_dir", "run"),  # the plot file named: a new file in any folder
}
ROW_SHARD = re.compile(r"(?:.+/)?shard-[^/]*\.jsonl")
SLOT_CHANGES = ("pruned", "abandoned", "rejected")


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


# a committed slot, where it is or moved aside: <run>/ckpt/step_<N>[.abandoned|.rejected[-k]]
SLOT_DIR = re.compile(
    r"(?P<ckpt>(?:.+/)?ckpt)/(?P<slot>step_(?P<step>\d+))(?P<aside>\.(?:abandoned|rejected)(?:-\d+)?)?"
)


@dataclass(frozen=True)
class Slot:
    files: frozenset  # {(path in the slot, sha256)}, COMMITTED included
    damaged: bool  # a file differs from what its COMMITTED lists: resume=auto sets it aside


@dataclass
class Tree:
    """Everything under the root, and its committed slots, read at one moment."""

    paths: dict
    slots: dict  # {slot path: Slot}
    rows: dict  # {path: sha256} of the row shards of every `regenerate` output


def read_tree(root: Path) -> Tree:
    paths = snapshot(root)
    slots = {}
    for rel in paths:
        slot = rel[: -len("/COMMITTED")]
        if rel.endswith("/COMMITTED") and SLOT_DIR.fullmatch(slot):
            slots[slot] = read_slot(root, slot, paths)
    return Tree(paths, slots, row_shards(root, paths))


def read_slot(root: Path, slot: str, paths: dict) -> Slot:
    files = {rel[len(slot) + 1 :]: v for rel, v in paths.items() if rel.startswith(slot + "/") and v != "dir"}
    listed = json.loads((root / slot / "COMMITTED").read_text()).get("files", {})
    return Slot(frozenset(files.items()), any(files.get(name) != entry["sha256"] for name, entry in listed.items()))


@dataclass
class Resumed:
    """What a train / demo may do to the committed slots of the run it trains in."""

    run: Optional[Path]  # that run (resolved); None for a command that trains nothing
    slot: Optional[Path]  # the slot resume= named (resolved), None for auto / no
    auto: bool

    def owns(self, root: Path, slot: str) -> bool:
        return self.run is not None and Path(os.path.realpath(root / slot)).parent == self.run / "ckpt"

    def may_set_aside(self, root: Path, slot: str, aside: str, kept: Slot) -> bool:
        """A rollback to an earlier slot of this run sets the later ones aside; resume=auto, a damaged one."""
        if not self.owns(root, slot):
            return False
        if ".abandoned" in aside:
            rolled_back = self.slot is not None and self.slot.parent == self.run / "ckpt"
            return rolled_back and step_of(self.slot.name) < step_of(slot)
        return self.auto and kept.damaged

    def may_prune(self, root: Path, slot: str, after: Tree) -> bool:
        """Deleted whole, with keep_last newer committed slots left in its ckpt/ (never one set aside)."""
        here = SLOT_DIR.fullmatch(slot)
        if not self.owns(root, slot) or here["aside"] or slot in after.paths:
            return False
        newer = [
            s
            for s in after.slots
            if (m := SLOT_DIR.fullmatch(s))["ckpt"] == here["ckpt"]
            and not m["aside"]
            and int(m["step"]) > int(here["step"])
        ]
        return len(newer) >= KEEP_LAST


def step_of(slot) -> int:
    return int(SLOT_DIR.fullmatch(f"ckpt/{Path(slot).name}")["step"])


def slot_changes(root: Path, before: Tree, after: Tree, resumed: Resumed, tally: Counter) -> list:
    """Every committed slot of `before` lost or changed beyond what `resumed` allows; tallies the allowed."""
    lost = []
    for slot, kept in before.slots.items():
        if after.slots.get(slot) == kept:
            continue
        aside = set_aside_as(slot, kept, before, after)
        if aside is not None and resumed.may_set_aside(root, slot, aside, kept):
            tally["abandoned" if ".abandoned" in aside else "rejected"] += 1
        elif aside is None and resumed.may_prune(root, slot, after):
            tally["pruned"] += 1
        else:
            lost.append((slot, f"now {aside or ('changed' if slot in after.slots else 'gone')}"))
    return lost


def set_aside_as(slot: str, kept: Slot, before: Tree, after: Tree) -> Optional[str]:
    """The new name (<slot>.abandoned|.rejected[-k]) under which `after` holds the slot unchanged, if any."""
    found = (s for s in after.slots if s not in before.slots and is_aside_of(s, slot) and after.slots[s] == kept)
    return next(found, None)


def rejected_before_refusing(root: Path, before: Tree, after: Tree, resumed: Resumed) -> dict:
    """{slot: its new name} of the damaged slots a refused resume=auto set aside: plan_resume moves
    them first, then refuses the next slot (incompatible) or the output_dir (claim_run_dir)."""
    moved = {}
    for slot, kept in before.slots.items():
        aside = set_aside_as(slot, kept, before, after)
        if (
            slot not in after.paths
            and aside
            and ".rejected" in aside
            and resumed.may_set_aside(root, slot, aside, kept)
        ):
            moved[slot] = aside
    return moved


def renamed(paths: dict, moved: dict) -> dict:
    """`paths` with each moved folder (and everything in it) under its new name."""
    out = {}
    for rel, value in paths.items():
        old = next((slot for slot in moved if rel == slot or rel.startswith(slot + "/")), None)
        out[rel if old is None else moved[old] + rel[len(old) :]] = value
    return out


def is_aside_of(name: str, slot: str) -> bool:
    match = SLOT_DIR.fullmatch(name)
    return bool(match and match["aside"]) and name[: -len(match["aside"])] == slot


def row_shards(root: Path, paths: dict) -> dict:
    outputs = {os.path.dirname(rel) for rel in paths if os.path.basename(rel) == "specdraft.json"}
    outputs = {out for out in outputs if our_kind(root / out) == "regenerate"}
    return {rel: v for rel, v in paths.items() if os.path.dirname(rel) in outputs and ROW_SHARD.fullmatch(rel)}


def immutable_works(tmp_path: Path) -> Optional[str]:
    """None where a folder can be made immutable here, else why not (root: chattr +i, which needs
    CAP_LINUX_IMMUTABLE and a filesystem with the attribute; others: chmod 555)."""
    if os.geteuid() != 0:
        return None
    probe = tmp_path / "chattr_probe"
    probe.mkdir()
    proc = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"chattr +i failed here ({proc.stderr.strip() or f'exit {proc.returncode}'})"
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    probe.rmdir()
    return None


class immutable:
    """chattr +i as root (which ignores mode bits); chmod 555 otherwise."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(self.path)], check=True, capture_output=True)
        else:
            self.path.chmod(0o555)

    def __exit__(self, *exc):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


def damage_newest_slot(run: Path) -> None:
    """One byte more in a file rank 0 loads: its COMMITTED no longer matches (resume=auto sets it aside)."""
    states = next((run / "ckpt" / "step_2").glob("*model_states.pt"))
    states.write_bytes(states.read_bytes() + b"\0")


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
    train_run(tiny_target_dir, data_dir, root, "run", max_steps=2, save_steps=1, keep_last=3)
    shutil.copytree(root / "run", root / "damaged")
    damage_newest_slot(root / "damaged")
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
                tiny_target_dir,
                data_dir,
                root / "unused",
                inputs / "cache",
                max_steps=3,
                save_steps=2,
                keep_last=KEEP_LAST,
            )
        )
    )
    tree = read_tree(root)  # what the checks compare is there to compare
    committed = {"run/ckpt/step_1": False, "run/ckpt/step_2": False, "damaged/ckpt/step_1": False}
    assert {slot: kept.damaged for slot, kept in tree.slots.items()} == {**committed, "damaged/ckpt/step_2": True}
    assert len(tree.rows) == 2, tree.rows  # one row a shard
    return root, dict(
        prompts=prompts,
        config=config,
        home=Path(tiny_target_dir).parents[1],
        target=tiny_target_dir,
        cache=inputs / "cache",
    )


# -- where each command may write ----------------------------------------------------------------


def our_kind(directory: Path) -> Optional[str]:
    """The kind our marker in `directory` names; None for a user's own specdraft.json or none."""
    try:
        marker = json.loads((directory / "specdraft.json").read_text())
    except (OSError, ValueError):
        return None
    return marker.get("kind") if isinstance(marker, dict) and "specdraft_version" in marker else None


def takes_files(path: Path, kind: str) -> bool:
    """Whether a command making a `kind` may write in `path` as it is now: a new folder (not a
    dangling link), an empty one (but for our marker), or one our marker says is a `kind`."""
    if not path.exists():
        return not path.is_symlink()
    if not path.is_dir():
        return False
    names = [p.name for p in path.iterdir()]
    return not names or our_kind(path) == kind or (names == ["specdraft.json"] and our_kind(path) is not None)


def newest_step(run: Path) -> int:
    return max(
        int(p.parent.name[len("step_") :]) for p in (run / "ckpt").glob("step_*/COMMITTED") if "." not in p.parent.name
    )


def command(kind: str, where: str, resume: str, root: Path, inputs: dict) -> tuple:
    """(argv, the paths it may write under, what it may do to slots if it succeeds) for one command
    pointed at `where`, decided from the tree as it is before the command."""
    path, run = root / where, root / "run"
    nothing = Resumed(None, None, False)
    if kind == "export":
        return ["export", run, "--out", path], [path] if takes_files(path, "export") else [], nothing
    if kind == "export_default":
        return ["export", run], [run / f"export_step_{newest_step(run)}"], nothing
    if kind == "consolidate":
        return ["consolidate", run], [run / "consolidated" / f"step_{newest_step(run)}"], nothing
    if kind == "regenerate":
        argv = ["regenerate", "--target", inputs["target"], "--data", inputs["prompts"], "--out", path]
        argv += ["--max-new-tokens", "4", "--rows-per-shard", "1"]
        return argv, [path] if takes_files(path, "regenerate") else [], nothing
    if kind == "eval_plot":
        plot = path / "acc.png" if path.is_dir() or not path.exists() else path  # a user's file: refused
        argv = ["eval", run, "--prompts", inputs["prompts"], "--max-prompts", "1", "--max-new-tokens", "4"]
        return [*argv, "--device", "cpu", "--plot", plot], [] if plot.exists() else [plot], nothing
    named = {"run_slot": run / "ckpt" / "step_1", "own_slot": path / "ckpt" / "step_1"}.get(resume)
    resumed = Resumed(Path(os.path.realpath(path)), named and Path(os.path.realpath(named)), resume == "auto")
    overrides = [f"output_dir={path}", f"resume={named or resume}"]
    allowed = [path] if takes_files(path, "run") else []
    if kind == "demo":  # the tiny preset's assets, trained as briefly as the config above
        argv = ["demo", "--preset", "tiny", *overrides, "max_steps=3", "save_steps=2", f"keep_last={KEEP_LAST}"]
        argv += ["eval_steps=-1", "max_seq_length=64", "per_device_batch_size=4", f"data_cache_dir={inputs['cache']}"]
        return argv, allowed, resumed
    return ["train", inputs["config"], *overrides], allowed, resumed


def under(rel: str, roots: list, root: Path) -> bool:
    """Whether root/rel is one of `roots` or inside one (where they point, for a link), or a new
    folder made to hold one (a missing parent)."""
    here = root / rel
    for allowed in roots:
        real = Path(os.path.realpath(allowed))
        if here == real or real in here.parents:
            return True
        if here.is_dir() and not here.is_symlink() and (here in allowed.parents or here in real.parents):
            return True
    return False


# -- the property ----------------------------------------------------------------------------------


def check_command(step: tuple, root: Path, inputs: dict, users: dict, capsys, tally: Counter) -> None:
    kind, target, where, resume = step
    argv, allowed, resumed = command(kind, where, resume, root, inputs)
    before = read_tree(root)
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    after = read_tree(root)
    what = f"{' '.join(map(str, argv))} -> {code}: {err.strip()[-500:]}"
    assert code in (0, 2), what
    if code == 2:
        lines = [l for l in err.strip().splitlines() if "error" in l.lower()]
        assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("specdraft: error: "), what
        moved = rejected_before_refusing(root, before, after, resumed)
        tally["rejected, then refused"] += len(moved)
        expected = renamed(before.paths, moved)
        assert after.paths == expected, (what, "a refusal changed", set(after.paths.items()) ^ set(expected.items()))
        return
    tally[kind] += 1
    tally[kind, target if kind in POINTED else "run"] += 1
    for rel, value in users.items():  # the user's files and links, as they were
        assert after.paths.get(rel) == value, (what, "user file or link changed or gone", rel)
    lost = slot_changes(root, before, after, resumed, tally)
    assert not lost, (what, "committed slot lost or changed", lost)
    for rel, value in before.rows.items():
        assert after.paths.get(rel) == value, (what, "regenerated rows changed or gone", rel)
    for rel in set(after.paths) - set(before.paths):
        assert under(rel, allowed, root), (what, "written where it may not write", rel, allowed)


steps = st.lists(
    st.tuples(
        st.sampled_from(
            [*["train"] * 4, "demo", "export", "export", "export_default", "consolidate", "regenerate", "eval_plot"]
        ),
        st.sampled_from([*TARGETS, *[AGAIN] * 5]),
        st.integers(0, 7),  # which of the kind's paths
        st.sampled_from(RESUMES),
    ),
    min_size=2,  # the grid runs each command alone
    max_size=3,
)


def grid() -> list:
    """Every command once at the first target of every kind: train with every resume, demo (the
    same code after its own start-up) with resume=auto and its own slot."""
    resumes = {"train": RESUMES, "demo": ["auto", "own_slot"]}
    cells = [[("export_default", "run", 0, "auto")], [("consolidate", "run", 0, "auto")]]
    for kind in POINTED:
        for target in TARGETS:
            cells += [[(kind, target, 0, resume)] for resume in resumes.get(kind, ["auto"])]
    return cells


def resolved(sequence: list) -> list:
    """The steps as (command, target kind, where, resume): AGAIN is the previous step's target."""
    out, target, where = [], "new", "new"
    for kind, drawn, index, resume in sequence:
        if drawn != AGAIN:
            target, where = drawn, TARGETS[drawn][index % len(TARGETS[drawn])]
        out.append((kind, target, where, resume))
    return out


def with_grid(test):
    for cell in reversed(grid()):
        test = example(sequence=cell)(test)
    return test


class Copies:
    """Copies of the template tree to run examples in: a copy an example left as it found it (every
    command refused) serves the next one, the rest are deleted (a copy costs more than most refusals)."""

    def __init__(self, template: Path, where: Path):
        self.template, self.where, self.made, self.spare = template, where, 0, None
        self.pristine = snapshot(template)

    def take(self) -> Path:
        if self.spare is not None:
            root, self.spare = self.spare, None
            return root
        self.made += 1
        root = self.where / f"ex{self.made}"
        shutil.copytree(self.template, root, symlinks=True)
        return root

    def put_back(self, root: Path) -> None:
        if snapshot(root) == self.pristine:
            self.spare = root
        else:
            shutil.rmtree(root)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=steps)
@with_grid
def check_sequences(sequence, inputs, copies, capsys, tally):
    root = copies.take()
    users = {rel: value for rel, value in copies.pristine.items() if is_user_path(rel) and value != "dir"}
    with immutable(root / "locked"):
        for step in resolved(sequence):
            check_command(step, root, inputs, users, capsys, tally)
    copies.put_back(root)  # not after a failure: the tree stays for a look


def test_no_command_sequence_loses_a_byte_of_the_users_or_a_committed_slot(template, tmp_path, monkeypatch, capsys):
    why_not = immutable_works(tmp_path)
    if why_not and in_ci():
        pytest.fail(f"{why_not}; under CI=true this test must run (give the runner CAP_LINUX_IMMUTABLE)", pytrace=False)
    if why_not:
        pytest.skip(why_not)
    monkeypatch.setenv("SPECDRAFT_HOME", str(template[1]["home"]))  # `demo --preset tiny`: the test's own assets
    tally = Counter()
    copies = Copies(template[0], tmp_path)
    check_sequences(inputs=template[1], copies=copies, capsys=capsys, tally=tally)
    short = {kind: (tally[kind], least) for kind, least in FLOOR.items() if tally[kind] < least}
    assert not short, f"too few commands succeeded ({{command: (succeeded, floor)}}): {short}; {dict(tally)}"
    refused = [
        (kind, target) for kind, targets in MUST_SUCCEED.items() for target in targets if not tally[kind, target]
    ]
    assert not refused, f"these commands never succeeded at these kinds of target: {refused}; {dict(tally)}"
    unreached = [change for change in SLOT_CHANGES if not tally[change]]
    assert not unreached, f"no command reached these slot changes: {unreached}; {dict(tally)}"
