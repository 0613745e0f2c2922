"""The offline demo: a tiny target LLM and a chat dataset, built from this machine's Python stdlib.

    target_dir, data = ensure_demo_assets(preset="demo")   # cached under $SPECDRAFT_HOME

`build_target` / `build_dataset` build one piece into a given directory (no caching).

The names below load on first use (PEP 562), so `specdraft --help`, which reads only the light
`demo.presets`, imports neither torch nor transformers.
"""

import importlib

_WHERE = {
    "ensure_demo_assets": "specdraft.demo.assets",
    "specdraft_home": "specdraft.paths",
    "DemoData": "specdraft.demo.dataset",
    "build_dataset": "specdraft.demo.dataset",
    "PRESETS": "specdraft.demo.presets",
    "DemoPreset": "specdraft.demo.presets",
    "build_target": "specdraft.demo.target",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
