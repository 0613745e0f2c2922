"""Acceptance benchmark: draft families and training objectives trained the same way, side by side,
against prompt lookup (no model), greedy and sampled.

    python bench/acceptance.py                                  # demo preset: GLIDE, EAGLE-3, DFlash
    python bench/acceptance.py --preset tiny                    # a quick run
    python bench/acceptance.py --preset bench                   # the bench target (~15 CPU-minute build, cached)
    python bench/acceptance.py --families glide --objectives ce "0.9*tv + 0.1*ce@0.7" "kl@1.0:all" \\
        --gamma 4 --tree ""                                     # one GLIDE per objective
    python bench/acceptance.py --draft GLIDE=runs/demo --draft runs/demo-eagle3   # existing runs / exports
    python bench/acceptance.py --preset smollm2 --tokens-seen 30.72k,92.16k,122.88k \\
        --max-prompts 8 --max-new-tokens 48 --tree 3,6,6,6,6 --confidence-threshold ""
                                            # a real chat model, every family: tau against tokens seen
                                            # (steps 120, 360, 480 of one sequence: see PRESET_OVERRIDES)

--tokens-seen: each family trains once, to the largest count, on the same batches (same seed, the
same max_seq_length x per_device_batch_size tokens a step); its exports at each count are measured
greedy with a chain (the learning curve: what more data buys), the last one also as below. A
preset's CPU budget (PRESET_OVERRIDES) sets what every family shares and each family's cheaper
shape (EAGLE-3 / P-EAGLE draft vocab, DFlash / DSpark anchors and layers).

Training: every family in one run of several drafts (`drafts:`: the target's forward once a step
for all of them; bench/several_drafts.py measures what that saves), or with --apart (and always
with several --objectives) a run each; each family with its demo config (configs/demo.yaml,
demo-eagle3.yaml, demo-dflash.yaml) for --train-steps on the same data with the same seed, with
its default objective or once per --objectives entry ('SPEC[@T][:all]': a draft.loss value, its draft.distill_temperature and, with
':all', draft.distill_tokens=all: the teacher terms on every token). The data is the preset's demo
set: the target's greedy answers, or with --answer-temperature T its answers sampled at T (a
dataset of its own, cached beside the greedy one); the held-out eval prompts are the same.

First the target's own greedy answers to the prompts are rated (specdraft/demo/quality.py:
distinct-2, degenerate share, prompt lookup τ): a target that repeats itself flatters every drafter.
Every number comes from this one run. Per temperature, plain target decoding of the prompts is
measured once; then every drafter x shape (chain gamma; a block drafter's whole block as the chain;
tree) reports tau (tokens per target forward: accepted + 1), acceptance per position, mean TV(target
p, draft q) over the checked chain positions (T > 0), draft forward passes per generated token,
tok/s and speedup, and whether greedy output is token-identical to the target's ("lossless").
Prints a markdown table, tau ratios, and a last line of key=value pairs (bench/summary.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import shutil
import time
from math import gcd
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdraft.decode.measure import compare, make_drafter, run_plain  # noqa: E402
from specdraft.decode.prompts import (
    encode_conversation,
    pad_with_earlier_conversations,
    read_prompts,  # noqa: E402
    stop_tokens,
)
from specdraft.decode.report import plot_acceptance, require_matplotlib  # noqa: E402
from specdraft.decode.speculative import speculative_generate  # noqa: E402
from specdraft.demo.machine import machine_line  # noqa: E402
from specdraft.demo.presets import PRESETS  # noqa: E402
from specdraft.demo.quality import measure_answer_quality  # noqa: E402
from specdraft.config import family_demo_configs  # noqa: E402
from specdraft.drafts.registry import FAMILIES, draft_from_export_config  # noqa: E402
from specdraft.export.files import load_exported_draft, read_export_config  # noqa: E402
from specdraft.drafts.objective_options import objective_from_options, validate_objective_options  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.commands.evaluate import load_tokenizer, resolve_device, resolve_export  # noqa: E402

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


def parse_count(text: str) -> int:
    """'30k' -> 30000, '1.5M' -> 1500000, '2048' -> 2048."""
    text = text.strip()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise SpecdraftError(f"--tokens-seen {text!r}: a count such as 30k, 0.3M or 2048") from None
    if value < 1:
        raise SpecdraftError(f"--tokens-seen {text!r}: must be at least one token")
    return int(round(value))


# written in --out/<preset> when the bench makes it: the runs there are the bench's, trained anew
# each time; a non-empty directory without it is someone else's, and nothing in it is deleted
BENCH_MARKER = "specdraft_bench.json"


def check_bench_out(out: Path) -> None:
    """--out/<preset>: new, empty, or one this bench wrote (its marker); else one line, before
    anything is written or deleted."""
    if out.exists() and not out.is_dir():
        raise SpecdraftError(f"--out: {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / BENCH_MARKER).is_file():
        raise SpecdraftError(
            f"--out: {out} exists, is not empty and was not written by this bench (no {BENCH_MARKER}); "
            f"the bench retrains the runs in it, so it never writes there: choose a new or empty --out"
        )


def mark_bench_out(out: Path, script: str = "bench/acceptance.py") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / BENCH_MARKER).write_text(json.dumps({"written_by": script}) + "\n")


SAVES_PER_POINT = 4  # --tokens-seen: at most this many exports saved per measured point


def steps_for_tokens(counts: List[int], tokens_per_step: int) -> List[int]:
    """Optimizer steps that see (at least) each count of tokens, in order, each at least 1."""
    steps = [max(1, -(-count // tokens_per_step)) for count in counts]
    if steps != sorted(set(steps)):
        raise SpecdraftError(
            f"--tokens-seen: {counts} are {steps} steps of {tokens_per_step} tokens; "
            f"give increasing counts at least one step apart"
        )
    # the run exports every gcd(steps) steps to have each point: steps sharing no divisor would
    # save five drafts at (nearly) every step
    divisor = gcd(*steps)
    saves = steps[-1] // divisor
    if saves > SAVES_PER_POINT * len(steps):
        first = steps[0]
        multiples = [first * -(-step // first) for step in steps]
        suggestion = ",".join(f"{step * tokens_per_step / 1000:g}k" for step in multiples)
        raise SpecdraftError(
            f"--tokens-seen: {counts} are steps {steps} of {tokens_per_step} tokens, which share the "
            f"divisor {divisor}: the run would save {saves} exports; give counts whose steps are "
            f"multiples of one step count, e.g. {suggestion}"
        )
    return steps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument(
        "--families",
        default=None,
        help="draft families to train (default: glide,eagle3,dflash; the preset's own, e.g. "
        "smollm2: every family but MTP)",
    )
    parser.add_argument(
        "--objectives",
        nargs="+",
        default=[],
        help="train each family once per objective 'SPEC[@T][:all]', e.g. ce '0.9*tv + 0.1*ce@0.7' "
        "kl:all (default: once, with the family's default objective)",
    )
    parser.add_argument(
        "--draft",
        action="append",
        default=[],
        help="[LABEL=]run or export dir of an existing draft (repeatable; then nothing is trained)",
    )
    parser.add_argument("--data", help="training data glob (default: the preset's demo data)")
    parser.add_argument(
        "--data-source",
        choices=["answers", "text"],
        default=None,
        help="the preset's data: the target's regenerated answers, or stdlib text as written learnt by "
        "distillation (specdraft/demo/text_data.py); default: answers, which taught more a token "
        "(SmolLM2, 46k tokens: GLIDE tau 1.47 against 1.10)",
    )
    parser.add_argument(
        "--answer-temperature",
        type=float,
        default=0.0,
        help="train on the demo target's answers sampled at this temperature (default 0: greedy)",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="train each family in a run of its own (default: every family in one run of several "
        "drafts, the target's forward shared; always apart with several --objectives)",
    )
    parser.add_argument(
        "--set",
        dest="shared_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key every family's run takes, after the preset's (repeatable), e.g. "
        "learning_rate=3e-3 per_device_batch_size=1",
    )
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument(
        "--tokens-seen",
        default="",
        metavar="N,N,...",
        help="train to the largest count and measure the exports at each (e.g. 30.72k,92.16k,122.88k: "
        "steps 120, 360, 480 of 256 tokens, exported every 120): tau against tokens seen; overrides "
        "--train-steps",
    )
    parser.add_argument("--gamma", type=int, default=5, help="chain length of every drafter")
    parser.add_argument("--tree", default="4,16,16,16,16", help="tree widths per depth ('' for chains only)")
    parser.add_argument("--temperatures", default="0,0.7", help="comma-separated sampling temperatures")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where target and drafts decode (cuda, cuda:1; the tables of docs/benchmarks/: cpu)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        metavar="N",
        help="pad each prompt to N tokens with earlier conversations of --data (long-context tau)",
    )
    parser.add_argument("--untrained", action="store_true", help="add the first draft, untrained (a floor)")
    parser.add_argument(
        "--confidence-threshold",
        default="0.5",
        help="drafters with a confidence head (DSpark) are measured again with each of these "
        "stops (comma-separated, e.g. 0.05,0.1,0.5)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="bar charts of acceptance per draft position and tau per drafter (specdraft[plots])",
    )
    parser.add_argument("--out", default="runs/bench-acceptance", help="where the trained drafts and results go")
    return parser.parse_args(argv)


# -- training ----------------------------------------------------------------------------------


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


# -- measuring ---------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_forwards(draft):
    """Counts draft forward passes: calls of its first layer (`layers`, MTP's `mtp_layers`; the
    draft itself when it has neither, as GLIDE's single block). None (prompt lookup) counts nothing."""
    counter = {"calls": 0}
    layers = getattr(draft, "layers", None) or getattr(draft, "mtp_layers", None)  # MTP's one layer
    module = None if draft is None else (layers[0] if layers is not None else draft)
    handle = (
        None
        if module is None
        else module.register_forward_pre_hook(lambda *_: counter.__setitem__("calls", counter["calls"] + 1))
    )
    try:
        yield counter
    finally:
        if handle is not None:
            handle.remove()


def measure(target, method, draft, prompts, baseline, shape, settings, confidence_threshold=None) -> dict:
    """compare() plus draft forwards per generated token (accepted + one per target forward).
    confidence_threshold: the stop of a drafter with a confidence head (None: its default, 0)."""
    drafter = make_drafter(method, target, draft)
    if confidence_threshold is not None:
        drafter.confidence_threshold = confidence_threshold
    with counting_forwards(draft) as counter:
        # compare() starts with a 2-token greedy warm-up generation: the same one, counted alone
        speculative_generate(target, drafter, prompts[0], max_new_tokens=2, **shape)
        warmup = counter["calls"]
        # TV(p, q) of sampled chains only: greedy p and q are one-hot, their TV is just "rejected"
        report = compare(
            target,
            drafter,
            prompts,
            baseline=baseline,
            record_tv="gamma" in shape and settings["temperature"] > 0,
            **shape,
            **settings,
        )
        forwards = counter["calls"] - 2 * warmup
    produced = report["accepted_tokens"] + report["target_forwards"]
    return dict(report, draft_forwards_per_token=forwards / produced if produced else 0.0)


def padded_to_context(prompts, data_glob, tokenizer, context: int):
    """Each prompt after earlier conversations of the training data, `context` tokens in all
    (decode/prompts.py's pad_with_earlier_conversations); prompt i's history starts at conversation i."""
    import glob

    from specdraft.data.sources import iter_jsonl_records, normalise_conversation

    if data_glob is None:
        raise SpecdraftError("--context needs --data: the conversations that pad the prompts")
    conversations, tokens = [], 0
    for path in sorted(glob.glob(data_glob)):
        for where, record in iter_jsonl_records(Path(path)):
            messages = normalise_conversation(record, where, require_answer=False)
            conversations.append(
                encode_conversation(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
            )
            tokens += len(conversations[-1])
            if tokens >= context:  # every prompt's rotation of them holds enough
                break
        else:
            continue
        break
    return [
        pad_with_earlier_conversations(prompt, conversations[i:] + conversations[:i], context)
        for i, prompt in enumerate(prompts)
    ]


def slug(label: str) -> str:
    """A key for the last line: 'EAGLE-3' -> 'eagle_3'."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


# -- the run -----------------------------------------------------------------------------------


def main(argv=None) -> dict:
    """The bench; a SpecdraftError (bad input, found early or where a run's config is built) ends
    it in one line, exit 2."""
    try:
        return run_bench(parse_args(argv))
    except SpecdraftError as err:
        print(f"bench/acceptance.py: {err}", file=sys.stderr)
        sys.exit(2)


def run_bench(args) -> dict:
    started = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tree = [int(w) for w in args.tree.split(",")] if args.tree else None
    temperatures = [float(t) for t in args.temperatures.split(",")]
    thresholds = [float(c) for c in args.confidence_threshold.split(",") if c.strip()]
    if any(not 0.0 <= c <= 1.0 for c in thresholds):
        sys.exit(f"--confidence-threshold {args.confidence_threshold}: each stop must lie in [0, 1]")
    if args.plot:
        require_matplotlib()
    objectives = [split_objective(text) for text in args.objectives]
    families = [f for f in (args.families or PRESET_FAMILIES.get(args.preset, "glide,eagle3,dflash")).split(",") if f]
    counts = [parse_count(c) for c in args.tokens_seen.split(",") if c.strip()]
    check_shared_overrides(args.shared_overrides)
    budget = PRESET_OVERRIDES.get(args.preset, {})
    budget = {**budget, "*": [*budget.get("*", []), *args.shared_overrides]}
    unknown = sorted(set(families) - set(CONFIGS))
    if unknown:
        sys.exit(f"--families: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if args.data and args.answer_temperature > 0:
        sys.exit("--data and --answer-temperature: give one (the latter builds its own data set)")
    out = Path(args.out) / (
        args.preset if args.answer_temperature <= 0 else f"{args.preset}-answers-T{args.answer_temperature:g}"
    )
    check_bench_out(out)

    # -- assets: target, prompts, data, drafts --------------------------------------------------
    target_dir, prompts_file, data_glob = args.target, args.prompts, args.data
    # text as written teaches the target's distribution only through a teacher term
    distilled = args.data_source == "text"
    if distilled and args.data is None and args.answer_temperature > 0:
        sys.exit("--answer-temperature: the answers' temperature; the text data generates none (--data-source answers)")
    if distilled and args.data is None:  # the preset's text needs no answers: none are generated
        from specdraft.demo.assets import SEED, ensure_held_out_prompts
        from specdraft.demo.text_data import ensure_text_data
        from specdraft.paths import specdraft_home

        demo_target, demo_prompts = ensure_held_out_prompts(preset=args.preset)
        target_dir, prompts_file = target_dir or str(demo_target), prompts_file or str(demo_prompts)
        text = ensure_text_data(specdraft_home(), args.preset, demo_prompts, SEED)
        data_glob = str(text[0].parent / "shard-*.jsonl")
    if target_dir is None or prompts_file is None or (not args.draft and data_glob is None):
        from specdraft.demo.assets import ensure_demo_assets

        demo_target, demo_data = ensure_demo_assets(preset=args.preset, answer_temperature=args.answer_temperature)
        target_dir = target_dir or str(demo_target)
        prompts_file = prompts_file or str(demo_data.prompts_file)
        data_glob = data_glob or str(Path(demo_data.train_files[0]).parent / "shard-*.jsonl")
    exports, keys, train_seconds = {}, {}, {}  # label -> export dir, last-line key, training wall seconds
    if distilled:
        from specdraft.demo.text_data import distillation_overrides

        budget = {**budget, **{f: [*budget.get(f, []), *distillation_overrides(CONFIGS[f])] for f in families}}
    for item in args.draft:
        label, _, path = item.rpartition("=")
        export = resolve_export(path)[0]
        label = label or LABELS[draft_from_export_config(read_export_config(export)).family]
        exports[label], keys[label] = export, slug(label)
    curve, steps = {}, [args.train_steps]  # label -> {tokens seen: export}; the steps measured
    if not args.draft:
        if counts:  # every family reads the same tokens a step: one count of steps for all
            per_step = {
                tokens_per_step(
                    family_config(
                        f, target_dir, data_glob, prompts_file, out / f, 1, budget.get("*", []) + budget.get(f, [])
                    )
                )
                for f in families
            }
            if len(per_step) != 1:
                sys.exit(
                    f"--tokens-seen: the families read {sorted(per_step)} tokens a step; give them one "
                    f"max_seq_length x per_device_batch_size"
                )
            steps = steps_for_tokens(counts, per_step.pop())
        save_every = gcd(*steps) if counts else None  # every point of the curve is an export
        mark_bench_out(out)
        together = len(families) > 1 and len(objectives) <= 1 and not args.apart
        if together:  # one run, one target pass a step for every family (`drafts:`)
            overrides, name = objectives[0] if objectives else ([], None)
            t0 = time.perf_counter()
            run_dir = out / "together"
            last = train_together(
                families,
                target_dir,
                data_glob,
                prompts_file,
                run_dir,
                steps[-1],
                shared=budget.get("*", []),
                per_family={f: [*budget.get(f, []), *overrides] for f in families},
                save_steps=save_every,
            )
            seconds = time.perf_counter() - t0
            for family in families:
                label = LABELS[family] + (f" {name}" if name else "")
                keys[label], exports[label] = family, last / family
                if counts:
                    curve[label] = {count: run_dir / f"step_{s}" / family for count, s in zip(counts, steps)}
            train_seconds["all in one run"] = seconds
            print(f"[bench] trained {', '.join(families)} together for {steps[-1]} steps in {seconds:.0f}s", flush=True)
        for family in [] if together else families:
            variants = objectives or [([], None)]
            for i, (overrides, name) in enumerate(variants):
                label = LABELS[family] + (f" {name}" if name else "")
                keys[label] = family + (f"_objective{i}" if i else "")
                t0 = time.perf_counter()
                run_dir = out / (family + (f"-{i}" if i else ""))
                exports[label] = train_draft(
                    family,
                    target_dir,
                    data_glob,
                    prompts_file,
                    run_dir,
                    steps[-1],
                    [*budget.get("*", []), *budget.get(family, []), *overrides],
                    save_every,
                )
                if counts:
                    curve[label] = {count: run_dir / f"step_{s}" for count, s in zip(counts, steps)}
                train_seconds[label] = time.perf_counter() - t0
                print(
                    f"[bench] trained {label} for {steps[-1]} steps in {train_seconds[label]:.0f}s: {exports[label]}",
                    flush=True,
                )

    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(target_dir), "fp32", resolve_device(args.device))
    tokenizer = load_tokenizer(next(iter(exports.values()), None), Path(target_dir))
    prompts = read_prompts(prompts_file, tokenizer, args.max_prompts)
    if args.context:
        prompts = padded_to_context(prompts, data_glob, tokenizer, args.context)
        print(f"[bench] prompts padded to {args.context} tokens with earlier conversations of {data_glob}", flush=True)
    stop = stop_tokens(target, tokenizer)
    # is this target worth measuring on? (a target that repeats itself flatters every drafter)
    quality = measure_answer_quality(target, tokenizer, prompts, max_new_tokens=args.max_new_tokens, stop=stop)[0]
    print(f"[bench] target answers: {quality.line()}", flush=True)
    device = target.get_input_embeddings().weight.device
    drafters = {label: ("draft", load_exported_draft(export)[0].to(device)) for label, export in exports.items()}
    drafters["prompt lookup"] = ("prompt_lookup", None)
    if args.untrained and exports:
        label, export = next(iter(exports.items()))
        drafters[f"{label} (untrained)"] = (
            "untrained",
            draft_from_export_config(read_export_config(export)).eval().to(device),
        )

    # -- per temperature: one baseline, then every drafter x shape ------------------------------
    rows, plain_speed, baselines = [], {}, {}
    for temperature in temperatures:
        settings = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, stop=stop)
        baseline = baselines[temperature] = run_plain(target, prompts, **settings)
        for label, (method, draft) in drafters.items():
            shapes = [dict(gamma=args.gamma)]
            block = getattr(getattr(draft, "layout", None), "predictions", None)  # a block drafter
            if block is not None and block != args.gamma:
                shapes.append(dict(gamma=block))
            shapes += [dict(tree=tree)] if tree else []
            # a drafter with a confidence head: also with its stop
            stops = [None] + (thresholds if hasattr(draft, "confidence_head") else [])
            for shape in shapes:
                for stop_at in stops:
                    report = measure(target, method, draft, prompts, baseline, shape, settings, stop_at)
                    name = label if stop_at is None else f"{label} (stop c={stop_at:g})"
                    rows.append(dict(report, label=name, method=method, whole_block=shape.get("gamma") == block))
                    print(
                        f"[bench] T={temperature:g} {name} {shape}: tau {report['tau']:.2f}, accepted/proposed "
                        f"{report['accepted_per_proposed']:.3f}",
                        flush=True,
                    )
        plain_speed[temperature] = rows[-1]["baseline_tokens_per_second"]

    # -- tau against tokens seen: each earlier export, greedy chain (the last is in `rows`) ------
    greedy = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, stop=stop)
    learning = {}  # label -> {tokens seen: report}
    for label, by_count in curve.items():
        learning[label] = {}
        for count, export in by_count.items():
            if count == counts[-1]:
                learning[label][count] = next(
                    r for r in rows if r["label"] == label and r["temperature"] == 0.0 and r["gamma"] == args.gamma
                )
                continue
            draft = load_exported_draft(export)[0].to(device)
            learning[label][count] = measure(
                target, "draft", draft, prompts, baselines.get(0.0), dict(gamma=args.gamma), greedy
            )
            print(f"[bench] {label} at {count:,} tokens: tau {learning[label][count]['tau']:.2f}", flush=True)

    # -- report --------------------------------------------------------------------------------
    trained = ", ".join(f"{label} {s:.0f}s" for label, s in train_seconds.items())
    lines = [
        machine_line(),
        f"target {target_dir} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params), "
        f"{len(prompts)} prompts x {args.max_new_tokens} new tokens; "
        + (f"prompts padded to {args.context} tokens with earlier conversations; " if args.context else "")
        + (
            f"drafts trained {steps[-1]} steps on {data_glob} ({trained}); "
            if trained
            else "drafts: " + ", ".join(f"{label}: {export}" for label, export in exports.items()) + "; "
        )
        + "plain decoding "
        + ", ".join(f"{s:.1f} tok/s at T={t:g}" for t, s in plain_speed.items()),
        f"target's greedy answers: {quality.line()}",
        "",
        "| drafter | shape | T | τ | acceptance per position | mean TV | draft fwd / token | proposed / round "
        "| accepted ÷ proposed | tok/s | speedup | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = (
            f"tree {','.join(map(str, r['tree']))}"
            if r["tree"]
            else f"chain γ={r['gamma']}" + (" (its whole block)" if r["whole_block"] else "")
        )
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        tv = "-" if r.get("mean_tv") is None else f"{r['mean_tv']:.3f}"
        lossless = "-" if r["matches_target"] is None else ("yes" if r["matches_target"] else "NO")
        lines.append(
            f"| {r['label']} | {shape} | {r['temperature']:g} | {r['tau']:.2f} | {acc} | {tv} | "
            f"{r['draft_forwards_per_token']:.2f} | {r['proposed_per_round']:.2f} | "
            f"{r['accepted_per_proposed']:.3f} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x "
            f"| {lossless} |"
        )

    def tau(label, temperature, is_tree=False):
        """τ of a drafter's chain γ (or its tree) at a temperature."""
        return next(
            r["tau"]
            for r in rows
            if r["label"] == label
            and r["temperature"] == temperature
            and bool(r["tree"]) == is_tree
            and r["gamma"] in (args.gamma, None)
        )

    # ratios: each draft ÷ prompt lookup (greedy); each GLIDE objective ÷ the first one (per T)
    comparisons, headline = [], []  # (what, τ, reference τ); the last line's key=value pairs
    for label in exports:
        headline += [f"tau_{keys[label]}_T{t:g}".replace(".", "") + f"={tau(label, t):.2f}" for t in temperatures]
        if 0.0 in temperatures:
            for is_tree in (False, True)[: 2 if tree else 1]:
                shape = "tree" if is_tree else f"chain γ={args.gamma}"
                comparisons.append(
                    (
                        f"{label} ÷ prompt lookup ({shape}, T=0)",
                        tau(label, 0.0, is_tree),
                        tau("prompt lookup", 0.0, is_tree),
                    )
                )
            headline.append(f"lookup_ratio_{keys[label]}={tau(label, 0.0) / tau('prompt lookup', 0.0):.2f}")
    for family in families if len(objectives) > 1 else []:  # each objective ÷ the family's first
        trained = [label for label in exports if label.startswith(LABELS[family] + " ")]
        for label in trained[1:]:
            for t in temperatures:
                ours, ref = tau(label, t), tau(trained[0], t)
                comparisons.append((f"{label} ÷ {trained[0]} (chain γ={args.gamma}, T={t:g})", ours, ref))
                headline.append(f"ratio_{keys[label]}_T{t:g}".replace(".", "") + f"={ours / ref:.2f}")
    for label, c in ((label, c) for label in exports for c in thresholds):  # each stop vs no stop
        stopped = f"{label} (stop c={c:g})"
        for t in temperatures if any(r["label"] == stopped for r in rows) else []:
            comparisons.append((f"{stopped} ÷ {label} (chain γ={args.gamma}, T={t:g})", tau(stopped, t), tau(label, t)))
            headline.append(
                f"stop_ratio_{keys[label]}_c{c:g}_T{t:g}".replace(".", "") + f"={tau(stopped, t) / tau(label, t):.2f}"
            )
    if learning:  # prompt lookup does not learn: its greedy chain τ stands beside every count
        lookup = tau("prompt lookup", 0.0) if 0.0 in temperatures else None
        lines += [
            "",
            f"τ against tokens seen (greedy, chain γ={args.gamma}; each family's exports of one run, "
            f"{steps[-1]} steps in all):",
            "",
            "| drafter | " + " | ".join(f"{c:,} tokens ({s} steps)" for c, s in zip(counts, steps)) + " | lossless |",
            "|---|" + "---|" * (len(counts) + 1),
        ]
        for label, reports in learning.items():
            lossless = all(r["matches_target"] for r in reports.values())
            lines.append(
                f"| {label} | "
                + " | ".join(f"{reports[c]['tau']:.2f}" for c in counts)
                + f" | {'yes' if lossless else 'NO'} |"
            )
            headline += [f"curve_{keys[label]}_{c}={reports[c]['tau']:.2f}" for c in counts]
        if lookup is not None:
            same = next(
                r
                for r in rows
                if r["label"] == "prompt lookup" and r["temperature"] == 0.0 and r["gamma"] == args.gamma
            )["matches_target"]
            lines.append(
                "| prompt lookup | " + " | ".join(f"{lookup:.2f}" for _ in counts) + f" | {'yes' if same else 'NO'} |"
            )
    total = time.perf_counter() - started
    training = sum(train_seconds.values())
    lines += ["", f"bench wall time {total:.0f}s: training {training:.0f}s, the rest {total - training:.0f}s"]
    lines.append("")
    lines += [f"τ {what}: {ours:.2f} / {ref:.2f} = {ours / ref:.2f}" for what, ours, ref in comparisons]
    ratios = {what: ours / ref for what, ours, ref in comparisons}
    text = "\n".join(lines)
    print(text)
    print(" ".join(headline))
    mark_bench_out(out)
    results = {
        "rows": rows,
        "ratios": ratios,
        "answer_quality": dataclasses.asdict(quality),
        "exports": {k: str(v) for k, v in exports.items()},
        "target": str(target_dir),
        "data": data_glob,
        "train_seconds": train_seconds,
        "wall_seconds": total,
        "tokens_seen": {label: {str(c): r["tau"] for c, r in reports.items()} for label, reports in learning.items()},
        "steps": steps,
    }
    (out / "acceptance.json").write_text(json.dumps(results, indent=2))
    (out / "acceptance.md").write_text(text + "\n")
    if args.plot:

        def plot_label(r):
            return f"{r['label']}, {'tree' if r['tree'] else 'γ=' + str(r['gamma'])}, T={r['temperature']:g}"

        plot_acceptance([(plot_label(r), r) for r in rows], args.plot)
        print(f"[bench] plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
