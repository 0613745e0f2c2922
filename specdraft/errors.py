"""The one exception type for user mistakes: the CLI prints it as one line and exits with code 2."""


class SpecdraftError(ValueError):
    """A problem with the user's input (config, files, checkpoints) — never an internal bug."""
