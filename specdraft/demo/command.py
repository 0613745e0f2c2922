"""`specdraft demo`: a preset's assets, built once and cached under $SPECDRAFT_HOME, then `train` on a
demo config against them.

    1. what the command line and the disk refuse    the config's keys and values, the run directory,
                                                    a run of another target   (nothing built yet)
    2. the assets                                   the preset's target, its answers or the stdlib
                                                    text (minutes; smollm2's answers, ~20)
    3. train                                        the config + target, data_files, eval_prompts

Each target and data trains in a run of its own (own_run): a run's checkpoints resume on their own
target and data only, and `make demo`'s runs/demo is never resumed on smollm2's; an output_dir on
the command line wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from specdraft.checkpoint.slots import newest_committed, read_commit, resolve_slot
from specdraft.config import load_config
from specdraft.demo.assets import SEED, ensure_demo_assets, ensure_held_out_prompts, target_key
from specdraft.demo.cache import read_stamp, stamp_matches
from specdraft.demo.presets import PRESETS
from specdraft.demo.text_data import distillation_overrides, ensure_text_data
from specdraft.errors import SpecdraftError
from specdraft.paths import specdraft_home
from specdraft.rundir.layout import ckpt_dir
from specdraft.rundir.ownership import claim_run_dir
from specdraft.target.weights import target_identity
from specdraft.train.loop import train


def demo(config_path: str, preset: Optional[str], data: str, answer_temperature: float, overrides: List[str]) -> None:
    """data "answers": the target's own answers (answer_temperature > 0: sampled); "text": the
    stdlib functions as written, learnt through a distillation objective."""
    if data == "text" and answer_temperature > 0:
        raise SpecdraftError("--answer-temperature: the answers' temperature; --data text generates none")
    own = preset_of(config_path)
    preset = preset or own
    overrides = [*(distillation_overrides(config_path) if data == "text" else []), *overrides]
    target = f"target={specdraft_home() / preset / 'target'}"
    cfg = load_config(config_path, [target, *overrides], inputs_built=False)  # keys, values: nothing built yet
    if not any(item.split("=", 1)[0] == "output_dir" for item in overrides):
        cfg.output_dir = own_run(cfg.output_dir, preset, own, data, answer_temperature)
        overrides.append(f"output_dir={cfg.output_dir}")
    refuse_before_build(cfg, preset)

    if data == "text":  # no answers: the target and the held-out prompts suffice
        target_dir, prompts_file = ensure_held_out_prompts(preset=preset)
        files = ensure_text_data(specdraft_home(), preset, prompts_file, SEED)
    else:
        target_dir, built = ensure_demo_assets(preset=preset, answer_temperature=answer_temperature)
        files, prompts_file = built.train_files, built.prompts_file
    inputs = [f"target={target_dir}", f"data_files=[{','.join(str(f) for f in files)}]", f"eval_prompts={prompts_file}"]
    train(load_config(config_path, [*inputs, *overrides]))


def own_run(output_dir: str, preset: str, config_preset: str, data: str, answer_temperature: float) -> str:
    """The run a demo trains in: the config's output_dir for its own preset's greedy answers
    (demo.yaml: runs/demo), named also for any other preset, text or temperature it trains on
    (runs/demo-smollm2, runs/demo-smollm2-text, runs/demo-T0.7)."""
    tags = []
    if preset != config_preset:
        tags.append(preset)
    if data == "text":
        tags.append("text")
    if answer_temperature > 0:
        tags.append(f"T{answer_temperature:g}")
    return "-".join([output_dir, *tags])


def preset_of(config_path: str) -> str:
    """The preset whose cached target a demo config names (`${specdraft_home:}/<preset>/target`:
    demo-mtp.yaml's is "mtp"), else "demo"."""
    target = OmegaConf.load(config_path).get("target")
    path = Path(str(target)) if target else None
    if (
        path is not None
        and path.name == "target"
        and path.parent.parent == specdraft_home()
        and path.parent.name in PRESETS
    ):
        return path.parent.name
    return "demo"


def refuse_before_build(cfg: DictConfig, preset: str) -> None:
    """What train() would refuse after the build, said before it when the disk already tells: the
    run directory (train's own claim_run_dir), a `resume:` that names no committed slot, and a run
    whose checkpoints trained against another target than the preset's. The slot records the
    directory and identity of its target; while that directory still holds it, its build stamp says
    whether it is what the preset builds (a directory without one is no preset's)."""
    claim_run_dir(Path(cfg.output_dir), str(cfg.resume))
    if cfg.resume == "no":
        return
    slot = newest_committed(ckpt_dir(cfg.output_dir)) if cfg.resume == "auto" else resolve_slot(Path(cfg.resume))
    if slot is None:
        return
    record = read_commit(slot)
    trained_on = Path(record["target"]) if record.get("target") else None
    try:
        still_there = trained_on is not None and target_identity(trained_on) == record.get("target_identity")
    except SpecdraftError:  # moved or deleted since: train() compares the built target with the record
        return
    if still_there and not stamp_matches(read_stamp(trained_on), target_key(preset)):
        raise SpecdraftError(
            f"output_dir {cfg.output_dir}: its checkpoint {slot.name} trained against {trained_on}, not the "
            f"target the {preset} preset builds; choose another output_dir"
        )
