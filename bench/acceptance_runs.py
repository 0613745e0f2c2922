"""How the benches train their drafts (bench/acceptance.py first, and curve, offline, regenerate,
versus after it): every family's packaged demo config on the bench's target and data, the preset's
CPU budget, a run per family or one run of several drafts, trained anew each time; a draft's label
and its key on a bench's last line."""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdraft.config import family_demo_configs  # noqa: E402
from specdraft.drafts.objective_options import objective_from_options, validate_objective_options  # noqa: E402
from specdraft.drafts.registry import FAMILIES  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402

CONFIGS = family_demo_configs()  # every family with a packaged demo config takes part
LABELS = {family: cls.label for family, cls in FAMILIES.items()}
# What a preset's bench runs with on 2 CPU cores: "*" for every family (the same tokens per step),
# then each family's cheaper shape. SmolLM2 (vocab 49,152): EAGLE-3's and P-EAGLE's heads over an
# 8k draft vocab, DFlash / DSpark with 2 layers and 32 blocks a sequence, P-EAGLE 4 depths.
# One sequence a step: at this few tokens more updates teach more per token (46k tokens of answers,
# greedy chain tau: GLIDE 1.27 / 1.36 / 1.47 at 4 / 2 / 1 sequences a step, EAGLE-3 1.28 / 1.35 /
# 1.42), for ~1.3x the seconds a token (docs/benchmarks/acceptance.md#sequences-a-step).
# GLIDE, EAGLE-3 and P-EAGLE learn the target's distribution at every token, prompts too
# (distill_tokens=all; GLIDE soft CE for it): 123k tokens of 1,000 answers, greedy chain tau GLIDE
# 1.53 -> 1.64, EAGLE-3 1.59 -> 1.66, for ~1.5x the seconds a step (docs/benchmarks/acceptance.md).
# DFlash and DSpark stay on answer tokens: taught at every token they gave 1.25 -> 1.31 (DFlash, soft
# CE) and 1.32 -> 1.31 (DSpark).
PRESET_OVERRIDES = {
    "smollm2": {
        "*": [
            "max_seq_length=256",
            "per_device_batch_size=1",
            "learning_rate=1e-3",
            "warmup_proportion=0.05",
            "logging_steps=10",
        ],
        "glide": ["draft.loss=soft_ce", "draft.distill_tokens=all"],
        "eagle3": ["draft.draft_vocab_size=8192", "draft.ttt_steps=5", "draft.distill_tokens=all"],
        "peagle": ["draft.draft_vocab_size=8192", "draft.num_depths=4", "draft.distill_tokens=all"],
        "dflash": ["draft.num_layers=2", "draft.max_anchors=32"],
        "dspark": ["draft.num_layers=2", "draft.max_anchors=32", "draft.markov_rank=64"],
    },
}
PRESET_FAMILIES = {"smollm2": "glide,eagle3,peagle,dflash,dspark"}  # no MTP layer in SmolLM2


def slug(label: str) -> str:
    """A key for the last line: 'EAGLE-3' -> 'eagle_3'."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def split_objective(text: str):
    """'0.9*tv + 0.1*ce@0.7:all' -> the draft.loss, draft.distill_temperature and
    draft.distill_tokens overrides, and a label; validated like the config (one line, exit 2)."""
    from omegaconf import OmegaConf

    body, _, tokens = text.partition(":")
    spec, _, temperature = body.partition("@")
    try:
        keys = dict(
            loss=spec.strip(), distill_temperature=float(temperature or 1.0), distill_tokens=tokens.strip() or "answers"
        )
    except ValueError:
        raise SpecdraftError(f"--objectives {text!r}: the temperature after '@' must be a number") from None
    draft_cfg = OmegaConf.create(keys)
    validate_objective_options(draft_cfg, f"--objectives {text!r}")
    overrides = [f"draft.{key}={value}" for key, value in keys.items()]
    return overrides, str(objective_from_options(draft_cfg, "ce"))


def family_config(
    family: str,
    target_dir,
    data_glob,
    prompts_file,
    out_dir: Path,
    steps: int,
    overrides=(),
    save_steps: Optional[int] = None,
):
    """The family's demo config on this target and data for `steps` steps (an export every
    save_steps, default: one at the end), the preset's overrides given in `overrides`."""
    from specdraft.config import load_config

    return load_config(
        CONFIGS[family], [*run_keys(target_dir, data_glob, prompts_file, out_dir, steps, save_steps), *overrides]
    )


def check_shared_overrides(items: List[str]) -> None:
    """--set: keys of the run's own config, before any asset is built; not a draft's key (each family
    has its own), nor one this bench sets for every run (run_keys)."""
    from specdraft.config.load import check_overrides

    reserved = {key.split("=", 1)[0] for key in run_keys("", "", "", "", 1, None)}
    for item in items:
        key = item.split("=", 1)[0]
        if key in reserved:
            raise SpecdraftError(f"--set '{item}': the bench sets {key} for every run")
        if key.split(".", 1)[0] in ("draft", "drafts"):
            raise SpecdraftError(f"--set '{item}': a draft key differs by family; --set takes a run's keys")
    try:
        check_overrides(items)
    except SpecdraftError as err:
        raise SpecdraftError(f"--set: {err}") from None


def run_keys(target_dir, data_glob, prompts_file, out_dir, steps: int, save_steps: Optional[int]) -> List[str]:
    """What every run of this bench sets: its inputs, length, exports, a fresh start and seed 0."""
    return [
        f"target={target_dir}",
        f"data_files={data_glob}",
        f"eval_prompts={prompts_file}",
        f"output_dir={out_dir}",
        f"max_steps={steps}",
        f"save_steps={save_steps or steps}",
        "eval_steps=0",
        "logging_steps=50",
        "resume=no",
        "seed=0",
    ]


def train_draft(
    family: str,
    target_dir,
    data_glob,
    prompts_file,
    out_dir: Path,
    steps: int,
    overrides=(),
    save_steps: Optional[int] = None,
) -> Path:
    """family_config trained; its last export. A run this bench left in out_dir before is trained
    anew (resume=no never mixes into it): out_dir lies in a directory the caller has checked is
    the bench's (check_bench_out)."""
    from specdraft.rundir.layout import is_run_dir
    from specdraft.train.loop import train

    if is_run_dir(out_dir):
        shutil.rmtree(out_dir)
    cfg = family_config(family, target_dir, data_glob, prompts_file, out_dir, steps, overrides, save_steps)
    return Path(train(cfg).export_dir)


def several_drafts_config(
    families: List[str],
    target_dir,
    data_glob,
    prompts_file,
    out_dir: Path,
    steps: int,
    shared=(),
    per_family=None,
    save_steps: Optional[int] = None,
):
    """One run training every family from one target pass (`drafts:`, named by family): each
    family's demo config's draft section with its `draft.*` overrides from per_family; `shared`
    (top-level keys) and the first family's config set the rest. Written beside out_dir
    (<out_dir>.yaml), loaded and validated as `specdraft train` would."""
    from omegaconf import OmegaConf

    from specdraft.config import load_config

    per_family = per_family or {}
    drafts = {}
    for family in families:
        overrides = list(per_family.get(family, []))
        misplaced = [o for o in overrides if not o.startswith("draft.")]
        if misplaced:  # a top-level key would be shared by every draft of the run
            raise SpecdraftError(f"{family}: {misplaced} are not draft.* keys; a run of several drafts shares them")
        entry = OmegaConf.merge(
            OmegaConf.load(CONFIGS[family]).get("draft") or {},
            OmegaConf.from_dotlist([o[len("draft.") :] for o in overrides]),
        )
        drafts[family] = OmegaConf.to_container(entry)
    base = OmegaConf.load(CONFIGS[families[0]])
    base.pop("draft", None)
    base.drafts = drafts
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir.parent / f"{out_dir.name}.yaml"
    OmegaConf.save(base, path)
    return load_config(str(path), [*run_keys(target_dir, data_glob, prompts_file, out_dir, steps, save_steps), *shared])


def train_together(families: List[str], target_dir, data_glob, prompts_file, out_dir: Path, steps: int, **kw) -> Path:
    """several_drafts_config trained (anew, as train_draft); its last step's directory, one
    export per family in <family>/."""
    from specdraft.rundir.layout import is_run_dir
    from specdraft.train.loop import train

    if is_run_dir(out_dir):
        shutil.rmtree(out_dir)
    cfg = several_drafts_config(families, target_dir, data_glob, prompts_file, out_dir, steps, **kw)
    return Path(train(cfg).export_dir)


def tokens_per_step(cfg) -> int:
    """Tokens one optimizer step reads on one rank (the bench trains on one)."""
    return cfg.max_seq_length * cfg.per_device_batch_size * cfg.gradient_accumulation_steps


@dataclass
class Trained:
    """The drafts a bench measures, given or trained here, and what their training took."""

    steps: List[int]  # the steps measured, in order (the last: the run's length)
    exports: Dict[str, Path] = field(default_factory=dict)  # label -> export dir
    keys: Dict[str, str] = field(default_factory=dict)  # label -> its name on the last line
    train_seconds: Dict[str, float] = field(default_factory=dict)  # label -> training wall seconds
    curve: Dict[str, Dict[int, Path]] = field(default_factory=dict)  # --tokens-seen: label -> {count: export}
