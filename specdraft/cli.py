"""`specdraft train|capture|config|data|demo|inspect|export|consolidate|eval|regenerate`.

A user mistake (SpecdraftError) is one line on stderr and exit code 2, never a traceback.
Heavy imports (torch, DeepSpeed, transformers) happen inside the commands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from specdraft.demo.presets import PRESETS  # a light module: --help stays instant
from specdraft.errors import SpecdraftError, write_error, write_failure

EXIT_USER_ERROR = 2
EXIT_ROWS_FAILED = 1  # regenerate: rows the servers did not answer (rerun to retry them), or no row at all


def _cmd_train(args) -> int:
    from specdraft.config import load_config
    from specdraft.train.loop import train

    cfg = load_config(args.config, args.overrides)
    train(cfg)
    return 0


def _cmd_data(args) -> int:
    from specdraft.config import load_config
    from specdraft.commands.data_report import data_report

    refusal = data_report(load_config(args.config, args.overrides), show=args.show, as_json=args.json)
    return 2 if refusal else 0  # `specdraft data ... && specdraft train ...` stops where train would refuse


def _cmd_capture(args) -> int:
    from specdraft.config import load_config
    from specdraft.commands.capture import capture

    cfg = load_config(args.config, args.overrides)
    if args.source_format:  # another trainer's cache converted, not the target run
        from specdraft.commands.import_features import import_cache

        if not args.source:
            raise SpecdraftError("--from: --source DIR (the other trainer's cache) is required")
        import_cache(cfg, args.source_format, args.source, args.layer_ids, strict=args.strict)
        return 0
    capture(cfg)
    return 0


def _cmd_config(args) -> int:
    from specdraft.config import load_config, resolved_config_yaml

    print(resolved_config_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_demo(args) -> int:
    from specdraft.demo.command import demo
    from specdraft.config import demo_config_path

    demo(demo_config_path(args.config), args.preset, args.data, args.answer_temperature, args.overrides)
    return 0


def _cmd_inspect(args) -> int:
    from specdraft.target.weights import describe_target, format_target_description

    description = describe_target(args.target_dir)
    print(json.dumps(description, indent=2, default=str) if args.json else format_target_description(description))
    return 0


def _cmd_export(args) -> int:
    from specdraft.commands.export import export_from_run

    out = export_from_run(
        args.run_dir,
        step=args.step,
        fmt=args.format,
        out_dir=args.out,
        with_target_heads=args.with_target_heads,
        draft_name=args.draft,
    )
    print(f"draft exported to {out}")
    return 0


def _cmd_consolidate(args) -> int:
    from specdraft.checkpoint.consolidate import consolidate_run

    out = consolidate_run(args.run_dir, slot=args.slot, draft=args.draft)
    print(f"fp32 draft weights written to {out}")
    return 0


def _cmd_eval(args) -> int:
    from specdraft.commands.evaluate import evaluate
    from specdraft.export.locate import run_draft_names
    from specdraft.decode.report import format_comparison, format_report

    tree = [int(w) for w in args.tree.split(",")] if args.tree else None
    thinking = None if args.thinking is None else args.thinking == "on"
    names = run_draft_names(args.path, args.draft)
    common = dict(
        method=args.method,
        gamma=args.gamma,
        tree=tree,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        thinking=thinking,
        max_prompts=args.max_prompts,
        record_tv=args.tv,
        device=args.device,
        dtype=args.dtype,
        target=args.target,
        confidence_threshold=args.confidence_threshold,
        baseline=not args.no_baseline,
        progress=_prompt_bars,
    )
    if len(names) > 1:  # every draft of a several-draft run, side by side
        if args.plot:
            raise SpecdraftError("--plot: one draft at a time; add --draft NAME")
        reports = {name: evaluate(args.path, args.prompts, draft_name=name, **common) for name in names}
        print(json.dumps(reports, indent=2) if args.json else format_comparison(reports))
        return 0
    report = evaluate(args.path, args.prompts, draft_name=names[0], plot_path=args.plot, **common)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _prompt_bars(what: str, prompts: int):
    """eval's progress on stderr: one bar per phase (the target alone, then speculative decoding)."""
    from tqdm import tqdm

    return tqdm(total=prompts, desc=what, unit="prompt", dynamic_ncols=True, leave=False)


def _cmd_regenerate(args) -> int:
    from specdraft.regenerate.run import load_regenerate_config, regenerate

    thinking = None if args.thinking is None else args.thinking == "on"
    values = dict(
        target=args.target,
        data=args.data,
        out=args.out,
        backend=args.backend,
        temperature=args.temperature,
        top_p=args.top_p,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
        thinking=thinking,
        seed=args.seed,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        model=args.model,
        servers=args.servers.split(",") if args.servers else None,
        rows_per_shard=args.rows_per_shard,
        timeout=args.timeout,
    )
    summary = regenerate(load_regenerate_config(args.config, values))
    return EXIT_ROWS_FAILED if summary["failed"] or not summary["rows_written"] else 0  # `&& train` stops


class _Parser(argparse.ArgumentParser):
    """argparse's usage error, said once under torchrun / deepspeed (rank 0); every rank exits 2."""

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            sys.exit(EXIT_USER_ERROR)
        super().error(message)


def _packaged_demo_configs() -> List[str]:
    """The names `specdraft demo --config` takes (read from the package, without importing specdraft.config)."""
    return sorted(p.stem for p in (Path(__file__).parent / "configs").glob("demo*.yaml"))


def build_parser() -> argparse.ArgumentParser:
    # `deepspeed --num_gpus N --module specdraft ...` appends --local_rank=K; the rank comes from env.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser = _Parser(prog="specdraft", description=__doc__.splitlines()[0], parents=[common])
    subparsers = parser.add_subparsers(dest="command", required=True)

    class Commands:
        @staticmethod
        def add_parser(name, **kwargs):
            return subparsers.add_parser(name, parents=[common], **kwargs)

    commands = Commands()

    keys_help = (
        "Every key, its type, default and family: docs/config-reference.md. `specdraft config "
        "CONFIG [key=value ...]` prints the config resolved with every default, as a run records it "
        "in config.yaml."
    )
    p = commands.add_parser("train", help="train a draft: CONFIG.yaml [key=value ...]", epilog=keys_help)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. max_steps=10 draft.max_lag=3")
    p.set_defaults(run=_cmd_train)

    p = commands.add_parser(
        "data", help="tokenise the training data as train would and report what is trained: CONFIG.yaml [key=value ...]"
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument(
        "--show", type=int, default=0, metavar="N", help="print N conversations with the trained tokens highlighted"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row: source, tokens, trained, trained_text")
    p.set_defaults(run=_cmd_data)

    p = commands.add_parser(
        "capture",
        help="run the target once over the training rows and write its features to feature_cache: "
        "CONFIG.yaml [key=value ...]",
        epilog=keys_help,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for train (feature_cache=DIR)")
    p.add_argument(
        "--from",
        dest="source_format",
        choices=["speculators", "specforge"],
        default=None,
        help="import another trainer's feature cache instead of running the target",
    )
    p.add_argument("--source", default=None, help="with --from: the other trainer's cache directory")
    p.add_argument(
        "--layer-ids",
        default=None,
        help="with --from: the layer ids it captured, in its own numbering, comma-separated (2,16,29,32)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="with --from: refuse a row whose token ids are none of this config's conversations",
    )
    p.set_defaults(run=_cmd_capture)

    p = commands.add_parser(
        "config", help="print CONFIG.yaml [key=value ...] resolved with every default", epilog=keys_help
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    p.set_defaults(run=_cmd_config)

    p = commands.add_parser("demo", help="build the offline demo target + data, then train the demo config's draft")
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="the demo assets to build and train on; default: the preset whose target the config "
        "names (demo-mtp: mtp), else demo. Another preset, --data text or an --answer-temperature trains "
        "in a run of its own, the config's output_dir with -PRESET, -text, -T<t> added (runs/demo-smollm2), "
        "unless output_dir= is given",
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"a config file, or a packaged one by name ({', '.join(_packaged_demo_configs())}); default: demo",
    )
    p.add_argument(
        "--answer-temperature",
        type=float,
        default=0.0,
        help="train on the target's answers sampled at this temperature (a separate cached "
        "dataset); default 0: its greedy answers",
    )
    p.add_argument(
        "--data",
        default="answers",
        choices=["answers", "text"],
        help="answers: the target's own answers (regenerated once); text: stdlib functions as written "
        "(nothing generated), learnt through a distillation objective (draft.loss kl when the family's "
        "default is CE)",
    )
    p.add_argument("overrides", nargs="*")
    p.set_defaults(run=_cmd_demo)

    p = commands.add_parser("inspect", help="describe a target checkpoint without loading it")
    p.add_argument("target_dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_cmd_inspect)

    p = commands.add_parser("export", help="write a draft-only export from a run's checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed checkpoint")
    p.add_argument(
        "--format",
        default="native",
        help="native (pth + safetensors + config.json), pth, safetensors, or a serving format of "
        "the draft's family: speculators (vLLM), sglang (EAGLE-3), longspec (GLIDE), stitched (MTP: the "
        "target with the trained layer in place)",
    )
    p.add_argument("--out", default=None, help="default: RUN_DIR/export_step_<N>")
    p.add_argument(
        "--with-target-heads",
        action="store_true",
        help="also write the target's embed_tokens/lm_head (read without loading the target)",
    )
    p.add_argument("--draft", default=None, metavar="NAME", help="the draft of a run of several (drafts:)")
    p.set_defaults(run=_cmd_export)

    p = commands.add_parser("consolidate", help="fp32 draft weights from a ZeRO checkpoint slot")
    p.add_argument("run_dir")
    p.add_argument("--slot", default=None, help="default: the newest committed slot")
    p.add_argument("--draft", default=None, metavar="NAME", help="the draft of a run of several (drafts:)")
    p.set_defaults(run=_cmd_consolidate)

    p = commands.add_parser("eval", help="mean accepted length (tau) and speedup of a draft")
    p.add_argument("path", help="a run directory (its newest draft) or a draft export directory")
    p.add_argument("--prompts", required=True)
    p.add_argument(
        "--draft",
        default=None,
        metavar="NAME",
        help="the draft of a run of several (drafts:); default: every draft, side by side",
    )
    p.add_argument(
        "--target",
        default=None,
        metavar="DIR",
        help="the target model directory; default: the path the export recorded at training",
    )
    p.add_argument("--method", default="draft", choices=["draft", "prompt_lookup"])
    p.add_argument("--gamma", type=int, default=None, help="chain length; default: the depth the draft was trained for")
    p.add_argument("--tree", default=None, help="tree widths per depth, e.g. 4,16,16,16")
    p.add_argument("--device", default=None, help="e.g. cuda, cuda:1, cpu; default: cuda if available")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="target and draft dtype; auto: the target's own torch_dtype (config.json) on a GPU, fp32 on the CPU",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="bar charts of acceptance per draft position and tau (needs specdraft[plots])",
    )
    p.add_argument(
        "--tv", action="store_true", help="also report TV(target p, draft q) averaged over the checked chain positions"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="do not time the target alone: tau and acceptance only, no speedup and no lossless "
        "check (about half the time)",
    )
    p.add_argument("--thinking", default=None, choices=["on", "off"], help="enable_thinking, as the training data")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=None,
        metavar="C",
        help="drafts with a confidence head (DSpark): a block stops at the first slot whose "
        "confidence is below C, in [0, 1]; default: the draft's draft.confidence_threshold",
    )
    p.set_defaults(run=_cmd_eval)

    p = commands.add_parser("regenerate", help="the target writes the answers of a training set (resumable)")
    p.add_argument("--config", default=None, help="a YAML file with the same keys (flags override it)")
    p.add_argument("--target", default=None, help="the target's local directory (tokenizer; hf: weights)")
    p.add_argument("--data", action="append", default=None, help="jsonl / parquet path or glob (repeatable)")
    p.add_argument("--out", default=None, help="output directory (shards, manifest.json, errors.jsonl)")
    p.add_argument("--backend", default=None, choices=["hf", "openai"], help="default hf")
    p.add_argument("--temperature", type=float, default=None, help="default 0: greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--samples", type=int, default=None, help="answers per row (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 512")
    p.add_argument("--max-length", type=int, default=None, help="prompt + answer tokens (default 4096)")
    p.add_argument("--thinking", default=None, choices=["on", "off"], help="enable_thinking of the template")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="hf: rows per generate call (default 32)")
    p.add_argument("--servers", default=None, help="openai: base URLs, comma separated (round robin)")
    p.add_argument("--concurrency", type=int, default=None, help="openai: requests in flight (default 8)")
    p.add_argument("--model", default=None, help="openai: the served model's name")
    p.add_argument("--timeout", type=float, default=None, help="openai: seconds per request (default 600)")
    p.add_argument("--rows-per-shard", type=int, default=None, help="default 1000")
    p.set_defaults(run=_cmd_regenerate)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except SpecdraftError as err:
        return _error_line(str(err))
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a failed write (full disk, read-only, immutable): its path and the OS's reason
        if write_failure(err) is None:
            raise  # a bug: the traceback is what we need
        return _error_line(str(write_error(err)))


def _error_line(message: str) -> int:
    """Every rank hits the same mistake (under torchrun / deepspeed): rank 0 says it, all exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"specdraft: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
