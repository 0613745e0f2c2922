"""What the measuring benches (versus.py, packing.py, curve.py) share on their command line: the
assets (preset, target, prompts, data), the judge's settings, --quick and --out, and the one-line
exit on a refused input."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdraft.demo.presets import PRESETS  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402


def assets_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the assets every such bench reads: the preset's, or the ones given."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2", choices=sorted(PRESETS), help="demo assets to use")
    parser.add_argument("--target", help="target model dir (default: the preset's demo target)")
    parser.add_argument("--prompts", help="jsonl prompts (default: the preset's held-out prompts)")
    parser.add_argument("--data", help="training data glob (default: the preset's demo data)")
    return parser


def parse_measuring(parser: argparse.ArgumentParser, argv, out: str, quick: dict) -> argparse.Namespace:
    """The judge's settings (greedy chain of --gamma on --max-prompts x --max-new-tokens), --quick
    (then `quick`'s values) and --out, parsed."""
    parser.add_argument("--gamma", type=int, default=5, help="chain length of every drafter")
    parser.add_argument("--max-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a few steps on the tiny preset (tests)")
    parser.add_argument("--out", default=out, help="runs, exports and finished parts")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    return args


def run_or_exit(script: str, run, args):
    """run(args); a refused input is one line naming the script, exit code 2."""
    try:
        return run(args)
    except SpecdraftError as err:
        print(f"{script}: {err}", file=sys.stderr)
        sys.exit(2)
