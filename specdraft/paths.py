"""Where specdraft keeps what it builds once and reuses (demo target, tokenised data)."""

import os
from pathlib import Path


def specdraft_home() -> Path:
    """`$SPECDRAFT_HOME`, default `~/.cache/specdraft`."""
    return Path(os.environ.get("SPECDRAFT_HOME") or Path.home() / ".cache" / "specdraft")
