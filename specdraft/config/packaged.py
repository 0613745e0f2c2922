"""The demo configs shipped inside the package (configs/demo*.yaml at the repository root link to
them), so `specdraft demo --config NAME` finds every one an installed package ships."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from specdraft.drafts import DEFAULT_FAMILY
from specdraft.errors import SpecdraftError


PACKAGED_CONFIGS = Path(__file__).parent.parent / "configs"


DEMO_CONFIG = PACKAGED_CONFIGS / "demo.yaml"


def demo_config_path(name: Optional[str]) -> str:
    """`specdraft demo --config`: a bare name (demo-eagle3) is a packaged config, else a path."""
    if name is None:
        return str(DEMO_CONFIG)
    packaged = PACKAGED_CONFIGS / f"{name}.yaml"
    if packaged.is_file():
        return str(packaged)
    if not os.path.isfile(name):
        shipped = sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml"))
        raise SpecdraftError(f"--config {name}: neither a packaged demo config ({', '.join(shipped)}) nor a file")
    return name


def family_demo_configs() -> dict:
    """{draft.type: path} of the packaged demo configs: each family brings its own demo*.yaml."""
    found = {}
    for path in sorted(PACKAGED_CONFIGS.glob("demo*.yaml")):
        found.setdefault(str(OmegaConf.load(path).draft.get("type", DEFAULT_FAMILY)), str(path))
    return found
