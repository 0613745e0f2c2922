"""The cached demo assets: build target and dataset once, reuse them on every later call."""

from __future__ import annotations

import math
import time
from pathlib import Path

from specdraft.demo.cache import log_stderr, read_stamp, reuse_or_build
from specdraft.paths import specdraft_home
from specdraft.demo.dataset import DemoData, build_dataset, build_held_out_prompts, data_inputs, prompts_inputs
from specdraft.demo.gguf_target import ensure_gguf_target, gguf_target_key
from specdraft.demo.presets import GgufPreset, get_preset
from specdraft.demo.target import build_target, target_inputs
from specdraft.errors import SpecdraftError

SEED = 0  # the demo is one fixed build; tests and users get the same target for a preset


def ensure_demo_assets(
    home=None, preset: str = "demo", log=log_stderr, answer_temperature: float = 0.0, progress_bar: bool = True
) -> tuple[Path, DemoData]:
    """(target_dir, data) under `home/<preset>/{target,data}`, built on first use.

    `home` defaults to `$SPECDRAFT_HOME` (or ~/.cache/specdraft). A directory is reused when its
    stamp says it was built from the current preset, seed and Python (the corpus is its stdlib);
    otherwise it is rebuilt. A rebuilt target also rebuilds the dataset (its answers come from it).
    answer_temperature > 0: a dataset of answers sampled at that temperature instead of greedy
    ones, in `data-T<temperature>/` beside `data/` (the same held-out prompts).
    progress_bar: a bar on stderr for each long build (the target's pre-training, its answers).
    """
    get_preset(preset)  # an unknown preset fails before anything is touched
    if not (answer_temperature >= 0 and math.isfinite(answer_temperature)):  # nan and inf too
        raise SpecdraftError(f"answer temperature must be a finite number >= 0, got {answer_temperature}")
    root = Path(home) if home is not None else specdraft_home()
    data_name = f"data-T{answer_temperature:g}" if answer_temperature > 0 else "data"
    target_dir, data_dir = root / preset / "target", root / preset / data_name

    t0 = time.perf_counter()
    ensure_demo_target(root, preset, log, progress_bar)
    target_stamp = read_stamp(target_dir)

    reuse_or_build(
        data_dir,
        data_inputs(preset, SEED, target_stamp, answer_temperature),
        lambda: build_dataset(target_dir, data_dir, preset, SEED, log, answer_temperature, progress_bar),
        "dataset",
        log,
    )
    log(f"[demo] {preset} assets ready in {time.perf_counter() - t0:.1f}s")
    return target_dir, DemoData.from_dir(data_dir)


def ensure_held_out_prompts(
    home=None, preset: str = "demo", log=log_stderr, progress_bar: bool = True
) -> tuple[Path, Path]:
    """(target_dir, prompts_file): the preset's target and its held-out prompts alone,
    `home/<preset>/prompts/prompts.jsonl`, the same prompts as its dataset's, built without the
    dataset's answers (what `--data text` needs: the answers cost the target's generation)."""
    root = Path(home) if home is not None else specdraft_home()
    target_dir = ensure_demo_target(root, preset, log, progress_bar)
    prompts_dir = root / preset / "prompts"
    reuse_or_build(
        prompts_dir,
        prompts_inputs(preset, SEED, read_stamp(target_dir)),
        lambda: build_held_out_prompts(target_dir, prompts_dir, preset, SEED, log),
        "held-out prompts",
        log,
    )
    return target_dir, prompts_dir / "prompts.jsonl"


def ensure_demo_target(home=None, preset: str = "demo", log=log_stderr, progress_bar: bool = True) -> Path:
    """The preset's target alone, `home/<preset>/target`, built on first use (as above)."""
    p = get_preset(preset)
    root = Path(home) if home is not None else specdraft_home()
    if isinstance(p, GgufPreset):  # a real model converted, not pre-trained (transformers' bar)
        return ensure_gguf_target(root, p, log)
    target_dir = root / preset / "target"
    reuse_or_build(
        target_dir,
        target_key(preset),
        lambda: build_target(target_dir, preset, SEED, log, progress_bar),
        "target",
        log,
    )
    return target_dir


def target_key(preset: str) -> dict:
    """What the preset's cached target is built from (the inputs its stamp must record): a target
    directory whose stamp records others holds another model."""
    p = get_preset(preset)
    return gguf_target_key(p) if isinstance(p, GgufPreset) else target_inputs(preset, SEED)
