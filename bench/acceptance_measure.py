"""How bench/acceptance.py measures: the target's own answers rated first, then every drafter x
shape x temperature against plain decoding (specdraft/decode/measure.py compare, its draft forwards
counted), then each earlier --tokens-seen export greedy."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdraft.commands.evaluate import load_tokenizer, resolve_device  # noqa: E402
from specdraft.decode.measure import compare, make_drafter, run_plain  # noqa: E402
from specdraft.decode.prompts import (  # noqa: E402
    encode_conversation,
    pad_with_earlier_conversations,
    read_prompts,
    stop_tokens,
)
from specdraft.decode.speculative import speculative_generate  # noqa: E402
from specdraft.demo.quality import measure_answer_quality  # noqa: E402
from specdraft.drafts.registry import draft_from_export_config  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.export.files import load_exported_draft, read_export_config  # noqa: E402


@dataclass
class Measured:
    """What the report reads: the target, its answers rated, and every drafter's reports."""

    quality: object  # the target's greedy answers rated (specdraft/demo/quality.py)
    target_params: int
    prompts: int
    rows: list  # one compare() report per drafter x shape x stop x temperature, labelled
    plain_speed: dict  # temperature -> plain decoding tok/s
    learning: dict  # --tokens-seen: label -> {tokens seen: report}


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


def measure_everything(args, plan, trained) -> Measured:
    """The target loaded on --device, its prompts (padded to --context), its own answers rated;
    then every drafter (the exports, prompt lookup, --untrained) and the tokens-seen curve."""
    from specdraft.target.model import load_frozen_target

    target = load_frozen_target(str(plan.target_dir), "fp32", resolve_device(args.device))
    tokenizer = load_tokenizer(next(iter(trained.exports.values()), None), Path(plan.target_dir))
    prompts = read_prompts(plan.prompts_file, tokenizer, args.max_prompts)
    if args.context:
        prompts = padded_to_context(prompts, plan.data_glob, tokenizer, args.context)
        print(
            f"[bench] prompts padded to {args.context} tokens with earlier conversations of {plan.data_glob}",
            flush=True,
        )
    stop = stop_tokens(target, tokenizer)
    # is this target worth measuring on? (a target that repeats itself flatters every drafter)
    quality = measure_answer_quality(target, tokenizer, prompts, max_new_tokens=args.max_new_tokens, stop=stop)[0]
    print(f"[bench] target answers: {quality.line()}", flush=True)
    device = target.get_input_embeddings().weight.device
    drafters = load_drafters(trained.exports, args.untrained, device)
    rows, plain_speed, baselines = measure_drafters(target, drafters, prompts, stop, args, plan)
    learning = measure_curve(target, prompts, stop, rows, baselines.get(0.0), trained.curve, plan.counts, args, device)
    params = sum(p.numel() for p in target.parameters())
    return Measured(quality, params, len(prompts), rows, plain_speed, learning)


def load_drafters(exports: dict, untrained: bool, device) -> dict:
    """label -> (method, draft): every export, prompt lookup, and with --untrained the first
    draft with fresh weights (a floor)."""
    drafters = {label: ("draft", load_exported_draft(export)[0].to(device)) for label, export in exports.items()}
    drafters["prompt lookup"] = ("prompt_lookup", None)
    if untrained and exports:
        label, export = next(iter(exports.items()))
        drafters[f"{label} (untrained)"] = (
            "untrained",
            draft_from_export_config(read_export_config(export)).eval().to(device),
        )
    return drafters


def measure_drafters(target, drafters: dict, prompts, stop, args, plan):
    """Per temperature one plain-decoding baseline, then every drafter at each of its shapes:
    (rows, temperature -> plain tok/s, temperature -> baseline)."""
    rows, plain_speed, baselines = [], {}, {}
    for temperature in plan.temperatures:
        settings = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, stop=stop)
        baseline = baselines[temperature] = run_plain(target, prompts, **settings)
        for label, (method, draft) in drafters.items():
            rows += measure_drafter(target, label, method, draft, prompts, baseline, settings, args.gamma, plan)
        plain_speed[temperature] = rows[-1]["baseline_tokens_per_second"]
    return rows, plain_speed, baselines


def measure_drafter(target, label, method, draft, prompts, baseline, settings, gamma, plan) -> list:
    """One drafter at one temperature: a chain of gamma, a block drafter's whole block as the
    chain, the tree; a drafter with a confidence head also at each of its stops."""
    rows = []
    shapes = [dict(gamma=gamma)]
    block = getattr(getattr(draft, "layout", None), "predictions", None)  # a block drafter
    if block is not None and block != gamma:
        shapes.append(dict(gamma=block))
    shapes += [dict(tree=plan.tree)] if plan.tree else []
    # a drafter with a confidence head: also with its stop
    stops = [None] + (plan.thresholds if hasattr(draft, "confidence_head") else [])
    for shape in shapes:
        for stop_at in stops:
            report = measure(target, method, draft, prompts, baseline, shape, settings, stop_at)
            name = label if stop_at is None else f"{label} (stop c={stop_at:g})"
            rows.append(dict(report, label=name, method=method, whole_block=shape.get("gamma") == block))
            print(
                f"[bench] T={settings['temperature']:g} {name} {shape}: tau {report['tau']:.2f}, accepted/proposed "
                f"{report['accepted_per_proposed']:.3f}",
                flush=True,
            )
    return rows


def measure_curve(target, prompts, stop, rows, greedy_baseline, curve, counts, args, device) -> dict:
    """tau against tokens seen: each earlier export, greedy chain (the last one is in `rows`)."""
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
                target, "draft", draft, prompts, greedy_baseline, dict(gamma=args.gamma), greedy
            )
            print(f"[bench] {label} at {count:,} tokens: tau {learning[label][count]['tau']:.2f}", flush=True)
    return learning
