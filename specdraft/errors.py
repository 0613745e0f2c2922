"""The one exception type for user mistakes: the CLI prints it as one line and exits with code 2.
A failed write (a full disk, a read-only or immutable directory) becomes one too: the path and
the OS's reason, never a traceback."""

from typing import Optional


class SpecdraftError(ValueError):
    """A problem with the user's input (config, files, checkpoints) — never an internal bug."""


# torch.save's C++ writer reports a failed write (a full disk, measured on a tmpfs) in these words,
# without the OS's errno
TORCH_WRITE_FAILURES = ("file write failed", "iostream error", "inline_container.cc")


def write_failure(err: Optional[BaseException], where=None) -> Optional[str]:
    """The OS's reason a write failed ("No space left on device"), looking through the causes of
    `err`; None when no write failed. `where`: the path written, to name a full disk behind
    torch.save's errno-less wording."""
    while err is not None:
        if isinstance(err, OSError):
            return err.strerror or str(err)
        if isinstance(err, RuntimeError) and any(words in str(err) for words in TORCH_WRITE_FAILURES):
            return "No space left on device" if where is not None and _disk_full(where) else "a file write failed"
        err = err.__cause__ or err.__context__
    return None


def _disk_full(path) -> bool:
    import shutil
    from pathlib import Path

    existing = next((p for p in (Path(path), *Path(path).parents) if p.exists()), Path("/"))
    return shutil.disk_usage(existing).free < (1 << 20)


def failed_path(err: Optional[BaseException]) -> Optional[str]:
    """The file an OSError in `err`'s causes names, if any."""
    while err is not None:
        if isinstance(err, OSError) and err.filename is not None:
            return str(err.filename)
        err = err.__cause__ or err.__context__
    return None


def write_error(err: BaseException, path=None, doing: Optional[str] = None) -> SpecdraftError:
    """One line for a failed file operation: 'PATH: [DOING failed: ]No space left on device'."""
    where = path if path is not None else failed_path(err)
    reason = write_failure(err, where) or str(err)
    what = f"{doing} failed: {reason}" if doing else reason
    return SpecdraftError(f"{where}: {what}" if where is not None else what)
