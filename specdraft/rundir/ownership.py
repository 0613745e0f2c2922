"""Where a command may write: a new or empty directory, or one specdraft wrote for that purpose
(what counts as ours is decided in specdraft/rundir/layout.py). Nothing a user owns is replaced, deleted or
mixed into; each refusal is one line, before anything is touched or any compute is spent.

    claim_run_dir(output_dir, resume)    `train`, `demo` (rank 0, before the target is loaded)
    start_run_dir(output_dir)            then creates it, with its marker
    check_export_out(out, run_dir, default)   `export --out`
    claim_regenerate_out(out)            `regenerate --out`
    check_plot_file(path, flag)          `eval --plot`
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

from specdraft.rundir.atomic import is_temp_of, temp_target, write_atomic
from specdraft.errors import SpecdraftError, write_error
from specdraft.rundir.layout import (
    MARKER,
    REGENERATE,
    RUN,
    ckpt_dir,
    committed_slots,
    enclosing_run,
    is_export_dir,
    is_our_plot,
    is_regenerate_dir,
    is_run_dir,
    marker_kind,
    marker_text,
    step_of,
)


def claim_run_dir(run_dir, resume: str) -> None:
    """`output_dir` of a training run: new, empty, or a specdraft run this run may continue; and
    writable (so a bad output_dir fails in seconds, not after the target is loaded). Writes nothing:
    start_run_dir creates it once start-up has passed."""
    run_dir = Path(run_dir)
    flag = f"output_dir {run_dir}"
    _refuse_file(run_dir, flag)
    # resolved first: `.` from inside a run is that run, and a symlink's run is where it points
    outer = enclosing_run(run_dir.resolve().parent)
    if outer is not None:
        raise SpecdraftError(f"{flag}: inside the specdraft run {outer}; choose an output_dir outside any run")
    if _non_empty(run_dir):
        if not is_run_dir(run_dir):
            raise SpecdraftError(
                f"{flag}: exists, is not empty and is not a specdraft run ({_what(run_dir)}); "
                f"specdraft never writes into it: choose a new or empty output_dir"
            )
        slots = committed_slots(ckpt_dir(run_dir))
        if slots and resume == "no":
            raise SpecdraftError(
                f"{flag}: holds committed checkpoints (newest {slots[-1]}); resume=no would mix a "
                f"new run into them: choose a new output_dir (resume=auto continues this run)"
            )
        if slots and resume != "auto" and not _within(Path(resume), run_dir):
            raise SpecdraftError(
                f"{flag}: holds committed checkpoints of its own (newest {slots[-1]}) that "
                f"resuming {resume} would overwrite: choose a new output_dir"
            )
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    for directory in (existing, ckpt_dir(run_dir)):
        if directory.is_dir():
            try:
                probe_writable(directory)
            except OSError as err:
                raise SpecdraftError(f"{flag}: cannot write in {directory}: {err.strerror}") from None
        elif directory.exists():  # a file where a directory must be
            raise SpecdraftError(f"{flag}: {directory} is a file, not a directory")


def start_run_dir(run_dir) -> None:
    """Create the run directory with its marker (rank 0, after claim_run_dir)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if marker_kind(run_dir) != RUN:
        write_atomic(run_dir / MARKER, marker_text(RUN))
    for path in run_dir.iterdir():  # a training export a crash left half-written: ours, never an export
        final = temp_target(path.name)
        if final is not None and step_of(final) is not None and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def probe_writable(directory: Path) -> None:
    """Raise the OS's error if no file can be created in `directory` (read-only, immutable, no
    permission), leaving nothing behind: an unnamed O_TMPFILE, else os.access where the
    filesystem has no O_TMPFILE."""
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        if not os.access(directory, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(directory)) from None


def check_export_out(out, run_dir, default) -> None:
    """`export --out`: new, empty, or an export we wrote (replaced whole, atomically); never a run,
    inside one (but the run's own export_step_<N>, the default) or holding one."""
    out, flag = Path(out), f"--out {out}"
    _refuse_file(out, flag)
    run = enclosing_run(out)
    if run is not None and out.resolve() != Path(default).resolve():
        where = "is the specdraft run" if run == out.resolve() else "is inside the specdraft run"
        raise SpecdraftError(
            f"{flag}: {where} {run}; its checkpoints and exports are never replaced: choose a "
            f"directory outside any run (default: {default})"
        )
    if not _non_empty(out):
        return
    if not is_export_dir(out):
        raise SpecdraftError(
            f"{flag}: exists, is not empty and is not an export specdraft wrote ({_what(out)}); "
            f"specdraft never replaces it: choose a new or empty directory"
        )
    inner = next((Path(d) for d, _, _ in os.walk(out) if is_run_dir(d)), None)
    if inner is not None:
        raise SpecdraftError(f"{flag}: holds the specdraft run {inner}; replacing the export would delete it")


def claim_regenerate_out(out, rank: int = 0) -> None:
    """`regenerate --out`: new, empty, or a regenerate output (its rows are resumed, never replaced).
    Every rank checks; rank 0 writes the marker (the others may see it half-written: not a refusal)."""
    out = Path(out)
    flag = f"--out {out}"
    _refuse_file(out, flag)
    if _non_empty(out) and not is_regenerate_dir(out):
        raise SpecdraftError(
            f"{flag}: exists, is not empty and is not a `specdraft regenerate` output "
            f"({_what(out)}); choose a new or empty directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        if rank == 0 and marker_kind(out) != REGENERATE:
            write_atomic(out / MARKER, marker_text(REGENERATE))
    except OSError as err:
        raise write_error(err, doing="preparing --out") from None


def check_plot_file(path, flag: str = "--plot") -> None:
    """A file we are about to write: new, or one specdraft wrote (a PNG it tagged)."""
    path = Path(path)
    flag = f"{flag} {path}"
    if path.is_dir():
        raise SpecdraftError(f"{flag}: is a directory; give a file name such as {path / 'acceptance.png'}")
    if path.exists() and not is_our_plot(path):
        raise SpecdraftError(f"{flag}: the file exists and specdraft did not write it; choose a new file name")
    if not path.resolve().parent.is_dir():
        raise SpecdraftError(f"{flag}: the directory {path.parent} does not exist")


# -- helpers -----------------------------------------------------------------------------------------


def _refuse_file(path: Path, flag: str) -> None:
    if path.is_symlink() and not path.exists():
        raise SpecdraftError(
            f"{flag}: is a symlink to {os.readlink(path)}, which does not exist; specdraft never "
            f"replaces a link: create what it points to, or choose another path"
        )
    if path.exists() and not path.is_dir():
        raise SpecdraftError(f"{flag}: is a file, not a directory; specdraft never replaces it")


def _non_empty(path: Path) -> bool:
    """Holds anything but our own marker (or its temp file, while another rank writes it). A
    `specdraft.json` we cannot read as ours, or a `specdraft.jsonl`, is the user's."""
    return path.is_dir() and any(not _is_our_marker(p) for p in path.iterdir())


def _is_our_marker(path: Path) -> bool:
    if path.name == MARKER:
        return marker_kind(path.parent) is not None
    return is_temp_of(path.name, MARKER)


def _within(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def _what(directory: Path) -> str:
    """Why a directory is not ours, for the refusal: what its marker says, or that it has none."""
    kind: Optional[str] = marker_kind(directory)
    if kind is not None:
        return f"its {MARKER} says it is a specdraft {kind}"
    inner = next((p for p in directory.iterdir() if is_run_dir(p)), None)
    return f"it holds the specdraft run {inner}" if inner is not None else f"no {MARKER}"
