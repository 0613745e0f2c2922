"""The offline demo: a tiny target LLM and a chat dataset, built from this machine's Python stdlib.

    target_dir, data = ensure_demo_assets(preset="demo")   # cached under $SPECDRAFT_HOME

`build_target` / `build_dataset` build one piece into a given directory (no caching).
"""

from specdraft.demo.assets import ensure_demo_assets
from specdraft.paths import specdraft_home
from specdraft.demo.dataset import DemoData, build_dataset
from specdraft.demo.presets import PRESETS, DemoPreset
from specdraft.demo.target import build_target

__all__ = ["DemoData", "DemoPreset", "PRESETS", "build_dataset", "build_target",
           "ensure_demo_assets", "specdraft_home"]
