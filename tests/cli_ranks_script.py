"""Run on 2 ranks by tests/test_user_files.py: the CLI's refusals under torchrun. Each case runs
`specdraft.cli.main` on every rank; each rank writes its exit codes to OUT/rank<N>.json."""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)

from specdraft.cli import main  # noqa: E402

out, cases = sys.argv[1], json.loads(sys.argv[2])


def run(argv):
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's usage errors
        return exit.code


codes = [run(argv) for argv in cases]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(codes, f)
sys.exit(codes[-1])
