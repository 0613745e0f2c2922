"""Run on 2 ranks by tests/test_resume.py: the runs listed in a JSON file, in order, each
{"name", "overrides", optional "signal": {"rank", "forward"}}: that rank sends itself SIGTERM in
its forward-th forward step (the other rank gets no signal).

Writes results_rank<r>.json: per run its losses, or how it was interrupted and which slots were
committed then.
"""

import json
import os
import signal
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames, every step

from specdraft.config import load_config  # noqa: E402
from specdraft.train import loop  # noqa: E402
from specdraft.train.interrupt import TrainingInterrupted  # noqa: E402
from specdraft.checkpoint.slots import committed_slots  # noqa: E402

runs_file, out_dir = sys.argv[1:3]
rank = int(os.environ["RANK"])
real_forward = loop.forward_step


def signalling_forward(at: int):
    calls = []

    def forward_step(*args):
        calls.append(None)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_forward(*args)

    return forward_step


results = {}
for run in json.load(open(runs_file)):
    cfg = load_config(None, run["overrides"])
    wanted = run.get("signal")
    loop.forward_step = signalling_forward(wanted["forward"]) if wanted and wanted["rank"] == rank else real_forward
    try:
        results[run["name"]] = {"losses": loop.train(cfg, log=lambda *a: None).losses}
    except TrainingInterrupted as stop:
        results[run["name"]] = {
            "exit": stop.code,
            "step": stop.step,
            "signal": stop.signum,
            "committed": [p.name for p in committed_slots(Path(cfg.output_dir) / "ckpt")],
        }
loop.forward_step = real_forward

with open(os.path.join(out_dir, f"results_rank{rank}.json"), "w") as f:
    json.dump(results, f)
