"""bench/versus.py's parts: what one family trains on (Plan), its features in speculators' layout,
the two trainers' runs, the import of speculators' checkpoints as our exports, and the measure of
an export (Measure). Each returns what a Parts entry keeps (JSON), so a rerun reuses it.

Token counts: one optimizer step reads `max_seq_length x sequences` tokens (the count
bench/acceptance.py's --tokens-seen uses, padding included): specdraft's per_device_batch_size
windows, speculators' one packed sequence of --total-seq-len tokens. The counts are rounded so each
trainer reaches every one in whole steps (exact_counts).

Exports at each count, exactly:
- specdraft: one run to the largest count, an export every gcd(steps) steps (save_steps), like
  bench/acceptance.py's curve; resume=auto continues it from its newest checkpoint slot.
- speculators: a run per count, --max-steps N with --scheduler-total-steps of the largest N: the same
  seed, the same multipack batches and the same lr at every step, so run N is the first N steps of
  the largest run (its per-epoch checkpoints would give whole epochs only, and a mid-epoch one is
  overwritten by the epoch's end, S:train/trainer.py:700-705). Its --epochs is the count of epochs
  those N steps need, counted with its own sampler (speculators_train.epoch_batches). A run cannot
  resume on a CPU (bench/speculators_train.py: checkpoints map to cuda:0): an unfinished one is
  trained again from the start; a finished one is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from math import gcd, lcm
from pathlib import Path
from typing import Dict, List, Optional, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

import speculators_train  # noqa: E402
from acceptance_runs import PRESET_OVERRIDES, run_keys, tokens_per_step  # noqa: E402
from offline_parts import Judge, quiet  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from versus_settings import (  # noqa: E402
    BLOCK_FAMILIES,
    RunShape,
    recipe_digest,
    speculators_argv,
    specdraft_overrides,
)

# the draft keys of bench/acceptance.py's CPU budget (acceptance_runs.PRESET_OVERRIDES) that shape a draft, given to
# both trainers in both modes; its other keys (lr, TTT steps, distill_tokens) are recipe, left to the mode
SHAPE_KEYS = ("num_layers", "max_anchors", "markov_rank")
SPECDRAFT_SEED = 42  # specdraft's default (D:config/schema.py:91), speculators' too: run_keys sets 0


# -- what a family trains on ---------------------------------------------------------------------


@dataclass
class Plan:
    """One family's comparison: the same target layers, draft vocabulary, shape and rows for both."""

    family: str
    layers: List[int]
    draft_vocab_size: Optional[int]  # None: the whole target vocabulary (DFlash, DSpark)
    shape: Dict[str, int]
    seq_len: int
    vocab_size: int  # the target's; its last id is the matched MASK

    @property
    def features_name(self) -> str:
        vocab = "" if self.draft_vocab_size is None else f"-v{self.draft_vocab_size}"
        return f"features-L{'_'.join(map(str, self.layers))}{vocab}-T{self.seq_len}"

    def run_shape(self, assets, features: dict, steps: int, **kw) -> RunShape:
        return RunShape(
            target=str(assets.target),
            layers=self.layers,
            steps=steps,
            seq_len=self.seq_len,
            draft_vocab_size=self.draft_vocab_size,
            train_data_ratio=features["train_data_ratio"],
            family=self.family,
            shape=self.shape,
            mask_token_id=self.vocab_size - 1,
            **kw,
        )


def cpu_budget(preset: str) -> Dict[str, List[str]]:
    """bench/acceptance_runs.py's PRESET_OVERRIDES of the preset; smollm2's (the CPU budget) for a preset without its own."""
    return PRESET_OVERRIDES.get(preset, PRESET_OVERRIDES["smollm2"])


def plan_family(family: str, target: str, preset: str) -> Plan:
    from specdraft.drafts.eagle3.layer import DEFAULT_DRAFT_VOCAB
    from specdraft.target.checks import load_target_config

    text = load_target_config(target).get_text_config()
    budget = cpu_budget(preset)
    keys = dict(item.split("=", 1) for item in [*budget.get("*", []), *budget.get(family, [])])
    shape = {key: int(keys[f"draft.{key}"]) for key in SHAPE_KEYS if f"draft.{key}" in keys}
    if family in BLOCK_FAMILIES:
        from specdraft.drafts.dflash.options import default_target_layers

        layers, vocab = default_target_layers(text.num_hidden_layers), None
    else:
        from specdraft.drafts.eagle3.layer import default_target_layers

        layers = default_target_layers(text.num_hidden_layers)[0]
        wanted = int(keys.get("draft.draft_vocab_size", DEFAULT_DRAFT_VOCAB))
        vocab = min(wanted, text.vocab_size)
    return Plan(family, list(layers), vocab, shape, int(keys.get("max_seq_length", 512)), text.vocab_size)


def exact_counts(counts: Sequence[int], per_step: Sequence[int]) -> List[int]:
    """The first count rounded up to a multiple of every trainer's tokens a step, each later one to
    the nearest multiple of the first: every trainer reaches each count in whole steps, and
    specdraft's one run exports at every count (save_steps: the first count's steps).
    16k,64k,256k at 512 tokens a step -> 16384, 65536, 262144."""
    unit = lcm(*per_step)
    first = unit * -(-counts[0] // unit)
    exact = [first * max(1, round(count / first)) for count in counts]
    if exact != sorted(set(exact)):
        raise SpecdraftError(
            f"--tokens {list(counts)}: rounded to multiples of {first} tokens (the first count, in whole steps "
            f"of every trainer) they are {exact}; give increasing counts at least {first} tokens apart"
        )
    return exact


def data_overrides(assets, plan: Plan) -> List[str]:
    return [
        f"target={assets.target}",
        f"data_files={assets.data}",
        f"data_cache_dir={assets.out / 'data-cache'}",
        f"max_seq_length={plan.seq_len}",
    ]


# -- features, and speculators' epochs of them --------------------------------------------------


def write_features(assets, plan: Plan) -> dict:
    """Our rows in speculators' layout (bench/versus_features.py): versus.json's summary + the path."""
    import versus_features

    path = assets.out / plan.features_name
    if path.exists():  # an earlier run stopped while writing it
        shutil.rmtree(path)
    cfg = versus_features.run_config(None, data_overrides(assets, plan))
    summary = versus_features.write_features(path, cfg, plan.layers, plan.draft_vocab_size, log=quiet)
    return dict(summary, path=str(path))


# -- specdraft -----------------------------------------------------------------------------------


def specdraft_config(assets, plan: Plan, mode: str, features: dict, steps: int, save_steps: int, run_dir: Path):
    from specdraft.config.load import load_config

    run = plan.run_shape(assets, features, steps)
    keys = [
        *run_keys(assets.target, assets.data, assets.prompts, run_dir, steps, save_steps),
        "resume=auto",  # an interrupted run continues from its newest committed slot
        f"seed={SPECDRAFT_SEED}",
        f"logging_steps={steps}",
        f"data_cache_dir={assets.out / 'data-cache'}",
        *specdraft_overrides(mode, run),
    ]
    return load_config(None, keys)


def specdraft_tokens_per_step(assets, plan: Plan, mode: str, features: dict) -> int:
    return tokens_per_step(specdraft_config(assets, plan, mode, features, 1, 1, assets.out / "unused"))


def train_specdraft(assets, plan: Plan, mode: str, features: dict, counts: List[int], steps: List[int], run_dir: Path):
    """One run to the largest count, an export at each (step `steps[i]` is count i); resumed from
    its newest committed slot where an earlier run stopped."""
    from specdraft.checkpoint.slots import newest_committed
    from specdraft.rundir.layout import CKPT_DIR
    from specdraft.train.loop import train

    cfg = specdraft_config(assets, plan, mode, features, steps[-1], gcd(*steps), run_dir)
    slot = newest_committed(run_dir / CKPT_DIR) if (run_dir / CKPT_DIR).is_dir() else None
    started = time.perf_counter()
    train(cfg, log=quiet)
    return dict(
        steps=steps,
        tokens_per_step=tokens_per_step(cfg),
        seconds=time.perf_counter() - started,  # this call's: a resumed run counts what it trained
        resumed_from=None if slot is None else slot.name,
        exports={str(c): str(run_dir / f"step_{s}") for c, s in zip(counts, steps)},
    )


# -- speculators ---------------------------------------------------------------------------------


@dataclass
class SpeculatorsRun:
    """One `speculators train` run: `steps` of a schedule of `schedule_steps`, in `epochs` epochs."""

    name: str
    count: int
    steps: int
    schedule_steps: int
    epochs: int
    save_path: Path
    argv: List[str] = field(default_factory=list)

    @property
    def checkpoint(self) -> Path:  # the last epoch's: where --max-steps stopped it
        return self.save_path / str(self.epochs - 1)

    def finished(self) -> bool:
        state = self.checkpoint / "training_state.json"
        return state.is_file() and json.loads(state.read_text())["global_step"] == self.steps


def speculators_runs(assets, plan: Plan, mode: str, features: dict, counts: List[int], batches: List[int]):
    """The run of each count (SpeculatorsRun), in count order."""
    steps = [count // plan.seq_len for count in counts]  # one packed sequence of seq_len a step
    runs = []
    for count, n in zip(counts, steps):
        epochs = next(e for e in range(1, len(batches) + 1) if sum(batches[:e]) >= n)
        name = f"{plan.family}-{mode}-{recipe_digest(plan.family, mode)}-speculators-s{n}of{steps[-1]}"
        save_path = assets.out / "runs" / name
        run = plan.run_shape(assets, features, n, epochs=epochs, schedule_steps=steps[-1])
        argv = speculators_argv(mode, run, features["path"], save_path)
        runs.append(SpeculatorsRun(name, count, n, steps[-1], epochs, save_path, argv))
    return runs


def train_speculators(runs: Sequence[SpeculatorsRun], logs: Path) -> None:
    """Every run not finished yet, trained anew in one speculators process (run_many)."""
    todo = [run for run in runs if not run.finished()]
    if not todo:
        return
    logs.mkdir(parents=True, exist_ok=True)
    for run in todo:
        if run.save_path.exists():  # stopped part way: speculators cannot resume it on a CPU
            shutil.rmtree(run.save_path)
    speculators_train.run_many(
        [(run.argv, logs / f"{run.name}.log") for run in todo], logs / f"runs-{todo[0].name}.log"
    )


def import_speculators(assets, plan: Plan, run: SpeculatorsRun) -> dict:
    """A finished run's checkpoint as our export (bench/versus_draft.py)."""
    import versus_draft

    if not run.finished():
        raise SpecdraftError(f"{run.save_path}: no checkpoint of step {run.steps} (see its log under runs/logs/)")
    export = assets.out / "exports" / run.name
    if export.exists():
        shutil.rmtree(export)
    versus_draft.import_speculators(run.checkpoint, export, None, data_overrides(assets, plan), log=quiet)
    record = json.loads((run.save_path / speculators_train.RUN_RECORD).read_text())
    return dict(asdict(run), save_path=str(run.save_path), export=str(export), seconds=record["seconds"])


# -- measuring -----------------------------------------------------------------------------------


class Measure(Judge):
    """Judge's target, prompts and greedy baseline (bench/offline_parts.py), every drafter measured
    the three ways bench/acceptance.py measures its last export: greedy with a chain of --gamma,
    greedy with a --tree, and a chain sampled at --temperature; per prompt too (tau_ratio's
    paired bootstrap)."""

    def __init__(self, assets):
        super().__init__(assets)
        args = assets.args
        self.tree = [int(w) for w in args.tree.split(",")] if args.tree else None
        self.temperature = args.temperature

    def shapes(self) -> Dict[str, dict]:
        shapes = {"chain": dict(gamma=self.gamma, temperature=0.0)}
        if self.tree:
            shapes["tree"] = dict(tree=self.tree, temperature=0.0)
        if self.temperature > 0:
            shapes[f"T{self.temperature:g}"] = dict(gamma=self.gamma, temperature=self.temperature)
        return shapes

    def taus(self, export: Optional[str]) -> dict:
        """export None: prompt lookup."""
        from specdraft.decode.measure import make_drafter, run_speculative
        from specdraft.decode.report import acceptance_stats
        from specdraft.export.files import load_exported_draft

        draft = None if export is None else load_exported_draft(Path(export))[0]
        drafter = make_drafter("prompt_lookup" if draft is None else "draft", self.target, draft)
        result = {}
        for name, shape in self.shapes().items():
            settings = dict(self.settings, temperature=shape["temperature"])
            generations = run_speculative(
                self.target, drafter, self.prompts, gamma=shape.get("gamma"), tree=shape.get("tree"), **settings
            )
            report = acceptance_stats(generations, len(shape["tree"]) if "tree" in shape else shape["gamma"])
            greedy = shape["temperature"] == 0
            result[name] = dict(
                tau=report["tau"],
                lossless=all(g.tokens == b.tokens for g, b in zip(generations, self.baseline)) if greedy else None,
                per_prompt=[[sum(g.accepted) + len(g.accepted), len(g.accepted)] for g in generations],
            )
        return result


def judging_name(args) -> str:
    """The measuring settings, in a part's name: a part measured otherwise is not reused."""
    return (
        f"g{args.gamma}-t{(args.tree or 'none').replace(',', '_')}-T{args.temperature:g}-"
        f"p{args.max_prompts}x{args.max_new_tokens}"
    )


def set_threads() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
