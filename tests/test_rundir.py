"""specdraft/rundir at the unit level: what makes a write crash-safe (the order of fsyncs and
renames, the old file never written into) and whose folder a command may replace. The commands'
own refusals and failures are pinned end to end in tests/test_user_files.py; these pin what a crash
or a power loss would show and an end-to-end run cannot (issue 55, item 7)."""

import os
import shutil
from pathlib import Path

import pytest

from specdraft.errors import SpecdraftError
from specdraft.rundir import atomic
from specdraft.rundir.layout import MARKER, REGENERATE, RUN, marker_text
from specdraft.rundir.ownership import check_export_out


@pytest.fixture
def syscalls(monkeypatch):
    """Every fsync (the path its fd names), rename and tree removal, in order."""
    events = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(source, target):
        events.append(("replace", os.path.realpath(source), os.path.realpath(target)))
        return real_replace(source, target)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", os.path.realpath(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return events


def test_write_atomic_replaces_the_file_and_never_writes_into_the_old_one(tmp_path):
    """A reader holding the old file (here a hard link to it) keeps its bytes: the new content is
    a new file renamed over the name, so a crash midway leaves the old or the new, never a mix."""
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    reader = tmp_path / "held"
    os.link(path, reader)
    atomic.write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and reader.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "held"]  # no temp file left


def test_write_atomic_makes_the_data_durable_before_the_rename_and_the_rename_after(tmp_path, syscalls):
    """fsync(temp) -> rename -> fsync(directory): a power loss never leaves an empty file under
    the final name (data after the rename), nor brings the old file back (rename not synced)."""
    tmp_path = tmp_path.resolve()  # the paths the fds name
    path = tmp_path / "COMMITTED"
    atomic.write_atomic(path, "{}")
    (replace,) = [e for e in syscalls if e[0] == "replace"]
    temp = replace[1]
    assert replace[2] == str(path) and Path(temp).parent == tmp_path
    at = syscalls.index(replace)
    assert ("fsync", temp) in syscalls[:at]
    assert ("fsync", str(tmp_path)) in syscalls[at + 1 :]


def test_publish_dir_syncs_every_file_before_the_rename_and_deletes_the_old_one_last(tmp_path, syscalls):
    tmp_path = tmp_path.resolve()
    final = tmp_path / "step_2"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"old")
    new = atomic.temp_dir_beside(final)
    (new / "sub").mkdir()
    (new / "sub" / "config.json").write_text("{}")
    (new / "model.safetensors").write_bytes(b"new")
    files = [str(new / "sub" / "config.json"), str(new / "model.safetensors")]
    atomic.publish_dir(new, final)
    into_place = syscalls.index(("replace", str(new), str(final)))
    assert all(("fsync", name) in syscalls[:into_place] for name in files), syscalls
    removed = [i for i, e in enumerate(syscalls) if e[0] == "rmtree"]
    assert removed and min(removed) > into_place  # the old one goes only once the new one is in place
    assert (final / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_a_publish_that_fails_at_the_rename_keeps_the_old_export(tmp_path, monkeypatch):
    """The rename into place fails (a full disk, a crash): the old export's bytes are still on disk
    (moved aside, not yet deleted)."""
    final = tmp_path / "export_step_2"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"old weights")
    new = atomic.temp_dir_beside(final)
    (new / "model.safetensors").write_bytes(b"new weights")
    real_replace = os.replace

    def replace(source, target):
        if Path(source) == new:
            raise OSError(28, "No space left on device")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        atomic.publish_dir(new, final)
    kept = [p for p in tmp_path.rglob("model.safetensors") if p.read_bytes() == b"old weights"]
    assert kept, sorted(tmp_path.rglob("*"))


@pytest.mark.parametrize("kind", [REGENERATE, RUN])
def test_export_out_is_never_a_folder_of_our_other_kinds(tmp_path, kind):
    """Our marker of another kind (a regenerate output, a run) is ours but not an export: `export
    --out` does not replace it."""
    out = tmp_path / "rows"
    out.mkdir()
    (out / MARKER).write_text(marker_text(kind))
    (out / "rows.jsonl").write_text("{}\n")
    with pytest.raises(SpecdraftError, match="not an export specdraft wrote|is the specdraft run"):
        check_export_out(out, tmp_path / "run", tmp_path / "run" / "export_step_1")
