"""Where specdraft keeps what it builds once and reuses (demo target, tokenised data)."""

import os
from pathlib import Path


def specdraft_home() -> Path:
    return Path(os.environ.get("SPECDRAFT_HOME", Path.home() / ".cache" / "specdraft"))
