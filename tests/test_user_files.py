"""Nothing a user owns is ever lost (issue 30, items 1, 2, 5, 7): each refusal or failure is exit
code 2, one line on stderr, and every file that was there before is byte-identical afterwards.

The CLI runs in-process (specdraft.cli.main); refusals happen before the target is loaded (the
loader is made to fail loudly if it is reached)."""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from speculators_env import in_ci

from helpers import REPO, run_overrides, torchrun, train_run
from specdraft.cli import main
from specdraft.rundir.layout import MARKER, committed_slots

IMMUTABLE_NOTE = "root ignores permission bits: chattr +i makes the directory refuse writes instead"


# -- helpers -----------------------------------------------------------------------------------


def tree(*roots) -> dict:
    """sha256 of every file (and the name of every directory) under each root."""
    found = {}
    for root in map(Path, roots):
        if root.is_file():
            found[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for path in sorted(root.rglob("*")):
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


def refused(capsys, argv, line, *roots, code=2):
    """Run the CLI; assert the exit code, one stderr line holding `line`, and nothing under roots changed."""
    before = tree(*roots)
    capsys.readouterr()
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err  # `demo` logs its asset cache lines first
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [l for l in lines if "error" in l.lower()] == lines[-1:], err
    assert lines[-1].startswith("specdraft: error: ") and line in lines[-1], err
    assert tree(*roots) == before
    return lines[-1]


@pytest.fixture
def no_target_load(monkeypatch):
    """Refusals must come before the target, the data or DeepSpeed's engine are touched."""

    def reached(*args, **kwargs):
        raise AssertionError("the target was loaded / the data tokenised before the refusal")

    from specdraft.train import loop

    for name in ("load_frozen_target", "prepare_data", "build_engine", "load_target_tokenizer"):
        monkeypatch.setattr(loop, name, reached)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("userfiles")


@pytest.fixture(scope="module")
def run_dir(tiny_target_dir, data_dir, work):
    """A finished 2-step run: ckpt/step_2 committed, step_2/ exported."""
    train_run(tiny_target_dir, data_dir, work, "run", max_steps=2, save_steps=2)
    return work / "run"


def config_file(tmp_path, target, data_dir, out, cache, **extra) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(
        "".join(
            f"{o.split('=', 1)[0]}: {o.split('=', 1)[1]}\n"
            for o in run_overrides(target, data_dir, out, cache, **extra)
        )
    )
    return path


@pytest.fixture
def user_dir(tmp_path):
    """A folder of the user's own files."""
    folder = tmp_path / "mine"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "todo.txt").write_text("keep me\n")
    (folder / "config.yaml").write_text("not: ours\n")
    (folder / "step_1").mkdir()
    (folder / "step_1" / "weights.bin").write_bytes(os.urandom(64))
    return folder


# -- 1. never delete or replace what we did not write ------------------------------------------


def test_export_refuses_a_users_folder_a_file_and_any_run(run_dir, user_dir, tmp_path, capsys):
    refused(
        capsys,
        ["export", run_dir, "--out", user_dir],
        f"--out {user_dir}: exists, is not empty and is not an export specdraft wrote (no {MARKER})",
        user_dir,
        run_dir,
    )
    a_file = tmp_path / "draft.bin"
    a_file.write_bytes(b"\x00" * 10)
    refused(
        capsys,
        ["export", run_dir, "--out", a_file],
        f"--out {a_file}: is a file, not a directory; specdraft never replaces it",
        a_file,
        run_dir,
    )
    assert not (tmp_path / "draft.bin.old").exists()
    refused(
        capsys,
        ["export", run_dir, "--out", run_dir],
        f"--out {run_dir}: is the specdraft run {run_dir.resolve()}",
        run_dir,
    )
    refused(
        capsys,
        ["export", run_dir, "--out", run_dir / "step_2"],
        f"--out {run_dir / 'step_2'}: is inside the specdraft run {run_dir.resolve()}",
        run_dir,
    )
    refused(
        capsys,
        ["export", run_dir, "--out", run_dir / "new"],
        f"--out {run_dir / 'new'}: is inside the specdraft run",
        run_dir,
    )
    assert not (run_dir / "new").exists()
    refused(
        capsys,
        ["export", run_dir, "--out", run_dir.parent],
        f"--out {run_dir.parent}: exists, is not empty and is not an export specdraft wrote (it holds the "
        f"specdraft run",
        run_dir.parent,
    )


def test_export_replaces_only_its_own_earlier_export_whose_marker_names_run_and_step(run_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert (marker["kind"], marker["run"], marker["step"]) == ("export", str(run_dir.resolve()), 2)
    first = tree(out)
    (out / "model.safetensors").write_bytes(b"stale")  # replaced whole by the next export
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert tree(out) == first and not list(tmp_path.glob("*exported.*"))  # no .old / .tmp left
    # the run's own default, export_step_<N>, is inside the run and allowed
    assert main(["export", str(run_dir)]) == 0 and (run_dir / "export_step_2" / MARKER).is_file()
    # training's exports carry the marker too
    assert json.loads((run_dir / "step_2" / MARKER).read_text())["step"] == 2
    # an export of ours that someone trained a run inside is not replaced either
    shutil.copytree(run_dir / "ckpt", out / "inner" / "ckpt")
    refused(capsys, ["export", run_dir, "--out", out], f"--out {out}: holds the specdraft run {out / 'inner'}", out)


def test_train_refuses_a_users_folder_before_loading_anything(
    tiny_target_dir, data_dir, user_dir, tmp_path, capsys, no_target_load
):
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, user_dir, tmp_path / "cache")
    refused(
        capsys,
        ["train", cfg],
        f"output_dir {user_dir}: exists, is not empty and is not a specdraft run "
        f"(no {MARKER}); specdraft never writes into it",
        user_dir,
    )


def test_demo_refuses_a_users_folder(tiny_target_dir, user_dir, capsys, monkeypatch, no_target_load):
    monkeypatch.setenv("SPECDRAFT_HOME", str(Path(tiny_target_dir).parents[1]))  # the tiny demo's cache
    refused(
        capsys,
        ["demo", "--preset", "tiny", f"output_dir={user_dir}"],
        f"output_dir {user_dir}: exists, is not empty and is not a specdraft run",
        user_dir,
    )


@pytest.fixture(scope="module")
def other_run(tiny_target_dir, data_dir, work):
    return train_run(tiny_target_dir, data_dir, work, "other", max_steps=1, save_steps=1).run_dir


def test_resume_no_into_committed_checkpoints_is_refused_naming_the_newest(
    tiny_target_dir, data_dir, run_dir, other_run, tmp_path, capsys, no_target_load
):
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, run_dir, tmp_path / "cache", max_steps=4)
    refused(
        capsys,
        ["train", cfg, "resume=no"],
        f"output_dir {run_dir}: holds committed checkpoints (newest {run_dir / 'ckpt' / 'step_2'}); resume=no "
        f"would mix a new run into them: choose a new output_dir",
        run_dir,
    )
    other = other_run
    refused(
        capsys,
        ["train", cfg, f"resume={other / 'ckpt' / 'step_1'}"],
        f"output_dir {run_dir}: holds committed checkpoints of its own (newest {run_dir / 'ckpt' / 'step_2'}) "
        f"that resuming {other / 'ckpt' / 'step_1'} would overwrite",
        run_dir,
        other,
    )
    refused(
        capsys,
        ["train", cfg, f"output_dir={run_dir / 'nested'}"],
        f"output_dir {run_dir / 'nested'}: inside the specdraft run {run_dir.resolve()}",
        run_dir,
    )


def test_regenerate_refuses_a_users_folder_and_a_file(tiny_target_dir, tiny_data, user_dir, tmp_path, capsys):
    prompts = tiny_data.prompts_file
    refused(
        capsys,
        ["regenerate", "--target", tiny_target_dir, "--data", prompts, "--out", user_dir],
        f"--out {user_dir}: exists, is not empty and is not a `specdraft regenerate` output",
        user_dir,
    )
    a_file = tmp_path / "rows.jsonl"
    a_file.write_text("{}\n")
    refused(
        capsys,
        ["regenerate", "--target", tiny_target_dir, "--data", prompts, "--out", a_file],
        f"--out {a_file}: is a file, not a directory",
        a_file,
    )


def test_eval_plot_refuses_a_users_file_and_a_directory(run_dir, tiny_data, user_dir, capsys, monkeypatch):
    import specdraft.commands.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_frozen_target", lambda *a, **k: pytest.fail("target loaded"))
    picture = user_dir / "notes" / "todo.txt"
    refused(
        capsys,
        ["eval", run_dir, "--prompts", tiny_data.prompts_file, "--plot", picture],
        f"--plot {picture}: the file exists and specdraft did not write it",
        user_dir,
    )
    refused(
        capsys,
        ["eval", run_dir, "--prompts", tiny_data.prompts_file, "--plot", user_dir],
        f"--plot {user_dir}: is a directory",
        user_dir,
    )


def test_eval_plot_replaces_its_own_png(run_dir, tiny_data, tmp_path):
    plot = tmp_path / "acc.png"
    args = [
        "eval",
        str(run_dir),
        "--prompts",
        str(tiny_data.prompts_file),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
        "--plot",
        str(plot),
    ]
    assert main(args) == 0 and plot.is_file()
    from specdraft.rundir.layout import is_our_plot

    assert is_our_plot(plot)
    assert main(args) == 0  # ours: replaced


def test_consolidate_into_a_run_whose_consolidated_is_a_file(run_dir, capsys):
    blocker = run_dir / "consolidated"
    blocker.write_text("a user's file")
    try:
        refused(capsys, ["consolidate", run_dir], f"{blocker / 'step_2'}: Not a directory", run_dir)
    finally:
        blocker.unlink()


# -- 1b. names beside the output, markers that are not ours, rollbacks, links ------------------------


def test_export_never_touches_the_users_x_old_and_x_tmp_beside_its_out(run_dir, tmp_path):
    """`X.old` is what people call their backup: neither it nor `X.tmp` is ours to use or delete."""
    user = tmp_path / "u"
    (user / "draft").mkdir(parents=True)
    for name in ("draft.old", "draft.tmp", "draft.bak"):
        (user / name).mkdir()
        (user / name / "weights.bin").write_bytes(os.urandom(32))
    (user / "draft.json.tmp").write_text("mine")
    theirs = tree(*(user / n for n in ("draft.old", "draft.tmp", "draft.bak", "draft.json.tmp")))
    assert main(["export", str(run_dir), "--out", str(user / "draft")]) == 0  # an empty folder: taken
    assert main(["export", str(run_dir), "--out", str(user / "draft")]) == 0  # our export: replaced
    assert tree(*(user / n for n in ("draft.old", "draft.tmp", "draft.bak", "draft.json.tmp"))) == theirs
    assert sorted(p.name for p in user.iterdir()) == [
        "draft",
        "draft.bak",
        "draft.json.tmp",
        "draft.old",
        "draft.tmp",
    ]  # nothing of ours left beside it
    assert json.loads((user / "draft" / MARKER).read_text())["kind"] == "export"


def test_a_users_specdraft_jsonl_or_own_specdraft_json_is_never_taken_for_our_marker(
    run_dir, tiny_target_dir, tiny_data, data_dir, tmp_path, capsys, no_target_load
):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "specdraft.jsonl").write_text('{"prompt": "hi"}\n')
    refused(
        capsys,
        ["export", run_dir, "--out", dataset],
        f"--out {dataset}: exists, is not empty and is not an export specdraft wrote",
        dataset,
    )
    own = tmp_path / "own"
    own.mkdir()
    (own / MARKER).write_text('{"kind": "run", "note": "my own settings file"}')  # no specdraft_version
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, own, tmp_path / "cache")
    refused(capsys, ["train", cfg], f"output_dir {own}: exists, is not empty and is not a specdraft run", own)
    refused(
        capsys,
        ["regenerate", "--target", tiny_target_dir, "--data", tiny_data.prompts_file, "--out", own],
        f"--out {own}: exists, is not empty and is not a `specdraft regenerate` output",
        own,
    )
    refused(capsys, ["export", run_dir, "--out", own], f"--out {own}: exists, is not empty", own)


def test_export_through_a_symlink_writes_where_it_points_and_keeps_the_link(run_dir, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    for _ in range(2):  # into the empty folder, then over our own export
        assert main(["export", str(run_dir), "--out", str(link)]) == 0
        assert link.is_symlink() and os.readlink(link) == str(real)
        assert json.loads((real / MARKER).read_text())["kind"] == "export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_output_dir_dot_inside_a_run_is_that_run_and_a_link_into_another_run_is_refused(
    run_dir, tiny_target_dir, data_dir, tmp_path, monkeypatch, capsys, no_target_load
):
    from specdraft.rundir.ownership import claim_run_dir

    monkeypatch.chdir(run_dir)
    claim_run_dir(Path("."), "auto")  # `.` is the run itself: continued, not "inside" it
    monkeypatch.chdir(tmp_path)
    (run_dir / "sub").mkdir()
    link = tmp_path / "innocent"
    link.symlink_to(run_dir / "sub", target_is_directory=True)
    try:
        cfg = config_file(tmp_path, tiny_target_dir, data_dir, link, tmp_path / "cache")
        refused(capsys, ["train", cfg], f"output_dir {link}: inside the specdraft run {run_dir.resolve()}", run_dir)
    finally:
        (run_dir / "sub").rmdir()


@pytest.fixture(scope="module")
def stepped_run(tiny_target_dir, data_dir, work):
    """4 steps, a slot and an export each step, keep_last=4: (run dir, its losses)."""
    result = train_run(tiny_target_dir, data_dir, work, "stepped", max_steps=4, save_steps=1, keep_last=4)
    return result.run_dir, result.losses


def test_a_rollback_to_an_older_slot_sets_the_later_ones_aside_and_continues_exactly(
    stepped_run, tiny_target_dir, data_dir, tmp_path, capsys
):
    run, losses = stepped_run
    later = {n: tree(run / "ckpt" / n, run / n) for n in ("step_3", "step_4")}
    cfg = config_file(
        tmp_path, tiny_target_dir, data_dir, run, tmp_path / "cache", max_steps=4, save_steps=1, keep_last=2
    )
    capsys.readouterr()
    assert main(["train", str(cfg), f"resume={run / 'ckpt' / 'step_2'}"]) == 0
    out = capsys.readouterr().out
    assert "resume: rolled back to step_2" in out, out
    # the new trajectory: committed step_3 and step_4, keep_last=2 of it; latest names the newest
    assert [s.name for s in committed_slots(run / "ckpt")] == ["step_3", "step_4"]
    assert (run / "ckpt" / "latest").read_text() == "step_4"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics[-2:]] == losses[2:]  # the same steps again, exactly
    # the abandoned ones, byte for byte, out of the slot namespace
    for name, before in later.items():
        moved = {
            k.replace(f"/{name}.abandoned", f"/{name}"): v
            for k, v in tree(run / "ckpt" / f"{name}.abandoned", run / f"{name}.abandoned").items()
        }
        assert moved == before
    assert main(["train", str(cfg)]) == 0  # resume=auto: the new step_4, already the last step
    assert "already reached step 4" in capsys.readouterr().out


def test_resuming_another_runs_slot_elsewhere_writes_nothing_into_that_run(
    other_run, tiny_target_dir, data_dir, tmp_path, capsys
):
    """Another ZeRO stage needs DeepSpeed's universal copy: it goes into the resuming run's ckpt/,
    so an immutable (read-only, shared) checkpoint still resumes."""
    before = tree(other_run)
    listing = sorted(str(p) for p in other_run.rglob("*"))
    cfg = config_file(
        tmp_path, tiny_target_dir, data_dir, tmp_path / "new", tmp_path / "cache", max_steps=1, zero_stage=3
    )
    with unwritable(other_run / "ckpt"):
        assert main(["train", str(cfg), f"resume={other_run / 'ckpt' / 'step_1'}"]) == 0
    assert "converted step_1" in capsys.readouterr().out
    assert tree(other_run) == before and sorted(str(p) for p in other_run.rglob("*")) == listing
    assert (tmp_path / "new" / "ckpt" / "step_1.universal" / "COMMITTED").is_file()


def test_a_restarted_run_clears_the_half_written_export_a_crash_left_and_nothing_else(
    tiny_target_dir, data_dir, tmp_path
):
    """A SIGKILL while the export thread writes step_N/ leaves its temp folder (.step_N.<random>.tmp):
    ours, and never an export. The next start of the run removes it; other hidden names stay."""
    run = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=1, save_steps=1).run_dir
    stale = run / ".step_2.0badc0de.tmp"
    (stale / "speculators").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    kept = [run / ".step_2.notes.tmp", run / ".export_step_1.0badc0de.tmp"]  # not ours / an export command's
    for path in kept:
        path.mkdir()
        (path / "x").write_text("x")
    train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=2, save_steps=1)
    assert not stale.exists() and all((path / "x").is_file() for path in kept)
    assert (run / "step_2" / MARKER).is_file()


# -- 2. write failures: one line, nothing lost -------------------------------------------------


def test_output_dir_that_is_a_file_or_under_an_unwritable_parent(
    tiny_target_dir, data_dir, tmp_path, capsys, no_target_load
):
    a_file = tmp_path / "out.txt"
    a_file.write_text("mine")
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, a_file, tmp_path / "cache")
    refused(capsys, ["train", cfg], f"output_dir {a_file}: is a file, not a directory", a_file)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "theirs.txt").write_text("x")
    with unwritable(locked) as reason:
        refused(
            capsys,
            ["train", cfg, f"output_dir={locked / 'run'}"],
            f"output_dir {locked / 'run'}: cannot write in {locked}: {reason}",
            locked,
        )


class unwritable:
    """A directory that refuses writes: chattr +i as root (which ignores mode bits), chmod 555 else."""

    def __init__(self, path):
        self.path = Path(path)

    def __enter__(self):
        if os.geteuid() == 0:
            proc = subprocess.run(["chattr", "+i", str(self.path)], capture_output=True, text=True)
            if proc.returncode != 0:
                why = f"chattr +i failed here ({proc.stderr.strip()}); {IMMUTABLE_NOTE}"
                if in_ci():  # CI must run what it claims to (give the runner CAP_LINUX_IMMUTABLE)
                    pytest.fail(f"{why}; under CI=true this test must run")
                pytest.skip(why)
            return "Operation not permitted"
        self.path.chmod(0o555)
        return "Permission denied"

    def __exit__(self, *exc):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)
        else:
            self.path.chmod(0o755)


def test_an_immutable_ckpt_dir_fails_at_start_and_the_run_resumes_once_writable(
    tiny_target_dir, data_dir, tmp_path, capsys
):
    run = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=2, save_steps=2).run_dir
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, run, tmp_path / "cache", max_steps=4, save_steps=2)
    with unwritable(run / "ckpt") as reason:
        refused(
            capsys,
            ["train", cfg],
            f"output_dir {run}: cannot write in {run / 'ckpt'}: {reason}",
            run / "ckpt",
            run / "step_2",
        )
    assert main(["train", str(cfg)]) == 0  # resumes from step_2
    assert [s.name for s in committed_slots(run / "ckpt")] == ["step_2", "step_4"]


def full_disk(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_on_each_write_path_is_one_line_and_the_run_resumes(
    tiny_target_dir, data_dir, tmp_path, capsys, monkeypatch
):
    """ENOSPC on the config, the metrics log, a checkpoint file and the export: each one line naming
    the path, exit 2, the committed slot and its export byte-identical, and the run resumes after."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    import specdraft.config.identity
    import specdraft.export.files
    import specdraft.train.metrics

    run = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=2, save_steps=2).run_dir
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, run, tmp_path / "cache", max_steps=4, save_steps=2)
    kept = (run / "ckpt" / "step_2", run / "step_2")

    def fail_on_write(path, *args, **kwargs):
        raise full_disk(path)

    class FullFile:  # metrics.jsonl on a full disk: opens, then every write fails
        def __init__(self, *args, **kwargs):
            pass

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            pass

    real_save = TorchCheckpointEngine.save

    def save(self, state_dict, path):  # the step-4 save's first file
        if "step_4" in str(path):
            raise full_disk(path)
        return real_save(self, state_dict, path)

    def export_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    cases = [
        (
            "config",
            specdraft.config.identity,
            "write_atomic",
            fail_on_write,
            f"{run / 'config.yaml'}: No space left on device",
        ),
        (
            "metrics",
            specdraft.train.metrics,
            "open",
            FullFile,
            f"{run / 'metrics.jsonl'}: writing metrics failed: No space left on device",
        ),
        (
            "checkpoint",
            TorchCheckpointEngine,
            "save",
            save,
            f"{run / 'ckpt' / 'step_4'}: saving step 4 failed: No space left on device; this save is discarded, "
            f"the committed slots (step_2) and the exports are untouched",
        ),
        (
            "export",
            specdraft.export.files,
            "publish_dir",
            export_full,
            f"{run / 'step_4'}: writing the draft export failed (No space left on device)",
        ),
    ]
    for name, owner, attr, replacement, line in cases:
        with monkeypatch.context() as m:
            m.setattr(owner, attr, replacement, raising=attr != "open")  # a module's open is the builtin
            refused(capsys, ["train", cfg], line, *kept)
        if name == "export":  # the slot was committed before its export failed: the rerun trains it again
            assert [s.name for s in committed_slots(run / "ckpt")] == ["step_2", "step_4"]
            shutil.rmtree(run / "ckpt" / "step_4")
        assert [s.name for s in committed_slots(run / "ckpt")] == ["step_2"], name
        assert not (run / "ckpt" / "step_4").exists() and not (run / "step_4").exists(), name
    assert main(["train", str(cfg)]) == 0  # step_2 resumes
    assert [s.name for s in committed_slots(run / "ckpt")] == ["step_2", "step_4"]
    assert (run / "step_4" / "model.safetensors").is_file()


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path`: mounted directly as root, else with `sudo -n`. Where neither can,
    the test skips saying why, except under CI=true, where it fails: CI must run it."""
    path.mkdir()
    owner = f"uid={os.getuid()},gid={os.getgid()}"
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},{owner}", "tmpfs", str(path)]
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    proc = subprocess.run(sudo + mount, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = f"cannot mount a {size} tmpfs here: {' '.join(sudo + mount[:3])} said {proc.stderr.strip()!r}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; under CI=true this test must run (give the runner root or passwordless sudo)")
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(sudo + ["umount", "-l", str(path)], check=True)


def fill(directory: Path, leave: int) -> Path:
    """Fill the filesystem of `directory` up to `leave` free bytes with one ballast file."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
        os.fsync(f.fileno())
    while shutil.disk_usage(directory).free < leave:
        os.truncate(ballast, max(ballast.stat().st_size - (1 << 16), 0))
    return ballast


def test_a_real_full_disk_fails_the_save_in_one_line_and_the_run_resumes_after(
    tiny_target_dir, data_dir, tmp_path, capsys
):
    with small_filesystem(tmp_path / "small", "64m") as small:
        run = train_run(tiny_target_dir, data_dir, tmp_path, "small/run", max_steps=2, save_steps=2).run_dir
        cfg = config_file(tmp_path, tiny_target_dir, data_dir, run, tmp_path / "cache", max_steps=4, save_steps=2)
        ballast = fill(small, leave=256 << 10)  # start-up fits (config, metrics), the step-4 save does not
        line = refused(
            capsys,
            ["train", cfg],
            f"{run / 'ckpt' / 'step_4'}: saving step 4 failed: No space left on "
            f"device; this save is discarded, the committed slots (step_2)",
            run / "ckpt" / "step_2",
            run / "step_2",
        )
        assert not (run / "ckpt" / "step_4").exists(), line  # its partial files gave their space back
        ballast.unlink()
        capsys.readouterr()
        assert main(["train", str(cfg)]) == 0, capsys.readouterr().err
        assert [s.name for s in committed_slots(run / "ckpt")] == ["step_2", "step_4"]


# -- 5. runs that cannot work are refused at start-up -----------------------------------------


def target_copy(tiny_target_dir, where: Path, tokenizer=True, **config) -> Path:
    """The tiny target with some config.json fields changed (and its tokenizer files, or none)."""
    copy = where / "target"
    shutil.copytree(tiny_target_dir, copy, ignore=None if tokenizer else shutil.ignore_patterns("tokenizer*"))
    fields = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**fields, **config}))
    return copy


@pytest.mark.parametrize(
    "rope, seq, allowed",
    [
        (None, 64, False),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, 64, True),
        ({"rope_type": "linear", "factor": 1.5, "rope_theta": 10000.0}, 64, False),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}, 64, True),
    ],
)
def test_max_seq_length_above_the_targets_positions_unless_rope_scaling_covers_it(
    tiny_target_dir, data_dir, tmp_path, capsys, rope, seq, allowed
):
    from specdraft.config import load_config

    extra = {} if rope is None else {"rope_parameters": rope}
    target = target_copy(tiny_target_dir, tmp_path, max_position_embeddings=32, **extra)
    overrides = run_overrides(target, data_dir, tmp_path / "out", tmp_path / "cache", max_seq_length=seq)
    if allowed:
        assert load_config(None, overrides).max_seq_length == seq
        return
    scaled = "" if rope is None else " (48 with its rope scaling)"
    cfg = config_file(tmp_path, target, data_dir, tmp_path / "out", tmp_path / "cache", max_seq_length=seq)
    refused(
        capsys,
        ["train", cfg],
        f"key 'max_seq_length': {seq} is above the target's max_position_embeddings 32{scaled}",
        target,
    )
    assert not (tmp_path / "out").exists()


def test_the_legacy_rope_scaling_field_counts_too(tiny_target_dir, data_dir, tmp_path):
    from specdraft.config import load_config

    target = target_copy(
        tiny_target_dir, tmp_path, max_position_embeddings=32, rope_scaling={"type": "linear", "factor": 2.0}
    )
    assert load_config(None, run_overrides(target, data_dir, tmp_path / "o", tmp_path / "c", max_seq_length=64))


def test_a_target_without_a_tokenizer_is_refused_in_train_and_regenerate(
    tiny_target_dir, tiny_data, data_dir, tmp_path, capsys
):
    target = target_copy(tiny_target_dir, tmp_path, tokenizer=False)
    cfg = config_file(tmp_path, target, data_dir, tmp_path / "out", tmp_path / "cache")
    refused(
        capsys,
        ["train", cfg],
        f"key 'target': {target} has no tokenizer (none of tokenizer.json, "
        f"tokenizer_config.json, tokenizer.model, vocab.json)",
        target,
    )
    refused(
        capsys,
        ["regenerate", "--target", target, "--data", tiny_data.prompts_file, "--out", tmp_path / "rows"],
        f"--target: {target} has no tokenizer",
        target,
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "rows").exists()


# -- 7. errors name the right thing ------------------------------------------------------------


def test_an_unknown_key_names_the_override_or_the_file_that_gave_it(tiny_target_dir, data_dir, tmp_path, capsys):
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache")
    refused(
        capsys,
        ["train", cfg, "max_steps=3", "draft.max_lagg=2"],
        "specdraft: error: override 'draft.max_lagg=2': unknown key 'draft.max_lagg' (did you mean 'draft.max_lag'?)",
        cfg,
    )
    refused(
        capsys,
        ["train", cfg, "zero_stage=4"],
        "specdraft: error: override 'zero_stage=4': key 'zero_stage': 4 is not one of 0, 1, 2, 3",
        cfg,
    )
    cfg.write_text(cfg.read_text() + "warmup_ratio: 0.1\n")
    refused(capsys, ["train", cfg, "max_steps=3"], f"specdraft: error: {cfg}: unknown key 'warmup_ratio'", cfg)


def test_yaml_syntax_errors_give_file_line_and_column(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("max_steps: 3\ndraft:\n  type: glide\n   max_lag: 2\n")
    refused(
        capsys,
        ["train", broken],
        f"specdraft: error: {broken}:4:11: not valid YAML: mapping values are not allowed in this context",
        broken,
    )
    refused(capsys, ["regenerate", "--config", broken], f"{broken}:4:11: not valid YAML", broken)


def test_a_directory_as_config_or_data_files_says_so(tiny_target_dir, data_dir, tmp_path, capsys):
    refused(
        capsys, ["train", data_dir], f"specdraft: error: {data_dir}: is a directory, not a YAML config file", data_dir
    )
    refused(capsys, ["regenerate", "--config", data_dir], f"{data_dir}: is a directory, not a YAML config file")
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache")
    refused(
        capsys,
        ["train", cfg, f"data_files={data_dir}"],
        f"key 'data_files': {data_dir} is a directory; name its files or a glob such as {data_dir}/*.jsonl",
        data_dir,
    )
    refused(
        capsys,
        ["regenerate", "--target", tiny_target_dir, "--data", data_dir, "--out", tmp_path / "rows"],
        f"--data: {data_dir} is a directory",
        data_dir,
    )


def test_a_resume_refused_for_a_changed_config_names_each_key_and_both_values(
    tiny_target_dir, data_dir, run_dir, tmp_path, capsys, no_target_load
):
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, run_dir, tmp_path / "cache", max_steps=4)
    refused(
        capsys,
        ["train", cfg, "draft.max_lag=2", "max_seq_length=48"],
        f"{run_dir / 'ckpt' / 'step_2'}: saved with other settings (draft.max_lag: saved 4, this run 2, "
        f"max_seq_length: saved 64, this run 48); set them back to resume, or choose a new output_dir",
        run_dir,
    )


def test_under_torchrun_rank_0_alone_prints_and_every_rank_exits_2(tiny_target_dir, data_dir, user_dir, tmp_path):
    """A usage error, a config mistake (before the process group) and a refused output_dir (after it)."""
    cfg = config_file(tmp_path, tiny_target_dir, data_dir, user_dir, tmp_path / "cache")
    cases = [["train"], ["train", str(cfg), "max_stepz=3"], ["train", str(cfg)]]
    before = tree(user_dir)
    proc = torchrun(REPO / "tests" / "cli_ranks_script.py", tmp_path, json.dumps(cases))
    assert proc.returncode != 0
    codes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert codes == [[2, 2, 2], [2, 2, 2]], proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 3, proc.stderr
    assert not re.search(r'File ".*/(specdraft|tests)/', proc.stderr), proc.stderr  # only torchrun's own report
    assert "specdraft train: error: the following arguments are required: config" in errors[0]
    assert "specdraft: error: override 'max_stepz=3': unknown key" in errors[1]
    assert f"specdraft: error: output_dir {user_dir}: exists, is not empty and is not a specdraft run" in errors[2]
    assert tree(user_dir) == before
