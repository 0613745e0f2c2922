"""Under torchrun (2 CPU ranks): `capture` or `train` with the overrides in a JSON file; rank 0
prints a JSON line (train: its losses) for tests/test_feature_cache.py."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from specdraft.config import load_config  # noqa: E402

command, overrides = sys.argv[1], json.loads(open(sys.argv[2]).read())
cfg = load_config(None, overrides)
if command == "capture":
    from specdraft.commands.capture import capture

    result = capture(cfg, log=lambda *a: None)
else:
    from specdraft.train.loop import train

    result = {"losses": train(cfg, log=lambda *a: None).losses}
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(result))
