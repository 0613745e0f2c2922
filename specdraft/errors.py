"""The one exception type for user mistakes: the CLI prints it as one line and exits with code 2.
A failed write (a full disk, a read-only or immutable directory) becomes one too: the path and
the OS's reason, never a traceback."""

from typing import Optional


class SpecdraftError(ValueError):
    """A problem with the user's input (config, files, checkpoints) — never an internal bug."""


def write_failure(err: Optional[BaseException]) -> Optional[str]:
    """The OS's reason a write failed ("No space left on device"), looking through the causes of
    `err`; None when no write failed."""
    while err is not None:
        if isinstance(err, OSError):
            return err.strerror or str(err)
        if isinstance(err, RuntimeError) and "file write failed" in str(err):  # torch.save's wording
            return "a file write failed (disk full?)"
        err = err.__cause__ or err.__context__
    return None


def failed_path(err: Optional[BaseException]) -> Optional[str]:
    """The file an OSError in `err`'s causes names, if any."""
    while err is not None:
        if isinstance(err, OSError) and err.filename is not None:
            return str(err.filename)
        err = err.__cause__ or err.__context__
    return None


def write_error(err: BaseException, path=None, doing: str = "writing") -> SpecdraftError:
    """One line for a failed file operation: 'PATH: writing failed: No space left on device'."""
    where = path if path is not None else failed_path(err)
    reason = write_failure(err) or str(err)
    return SpecdraftError(f"{where}: {doing} failed: {reason}" if where is not None else f"{doing} failed: {reason}")
