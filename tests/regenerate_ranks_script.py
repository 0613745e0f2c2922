"""Run on 2 ranks by tests/test_regenerate_ranks.py: `specdraft regenerate` (the CLI) on every rank,
as two nodes of one process each run it: LOCAL_RANK 0 on both. Rank 1 is slowed (the test hook
SPECDRAFT_REGENERATE_PAUSE_S), so it is still writing rows when rank 0 has finished its own. Each
rank records the names of the files regenerate wrote in WORK/writes-r<rank>.json.

    regenerate_ranks_script.py WORK regenerate --target ... --out ...
"""

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ["LOCAL_RANK"] = "0"
if os.environ["RANK"] == "1":
    os.environ["SPECDRAFT_REGENERATE_PAUSE_S"] = "1.0"

from specdraft.regenerate import run as module  # noqa: E402
from specdraft.cli import main  # noqa: E402

work, argv = Path(sys.argv[1]), sys.argv[2:]
written, real = [], module.write_atomic


def recording(path, content):
    written.append(Path(path).name)
    return real(path, content)


module.write_atomic = recording
code = main(argv)
(work / f"writes-r{os.environ['RANK']}.json").write_text(json.dumps(written))
sys.exit(code)
