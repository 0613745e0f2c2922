"""Run on 2 ranks by tests/test_distributed.py: failures on rank 0 alone (commit, prune, export
writer, metrics) and a checkpoint directory rank 1 does not share. Each case must end with the
same error on both ranks, and no hang; writes {case: {rank: [error type, message]}}."""

import errno
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)

from helpers import run_overrides  # noqa: E402
from specdraft.config import load_config  # noqa: E402
from specdraft.rundir.layout import COMMITTED  # noqa: E402
from specdraft.checkpoint import slots  # noqa: E402
from specdraft.rundir import shared_fs  # noqa: E402
from specdraft.export import files as export  # noqa: E402
from specdraft.train import loop, metrics  # noqa: E402

target, data_dir, work, out_json = sys.argv[1:5]
rank = int(os.environ["RANK"])
shared_fs.VISIBLE_WAIT_S = 1.0


def config(name, *extra):
    overrides = run_overrides(
        target,
        data_dir,
        f"{work}/{name}",
        f"{work}/cache",
        per_device_batch_size=2,
        learning_rate=None,  # these three: the config's own
        warmup_steps=None,
        seed=None,
        max_steps=4,
        save_steps=2,
    )
    return load_config(None, [*overrides, *extra])


def failing(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


def failing_commit(original):
    def write(path, content):
        if os.path.basename(path) == COMMITTED:
            raise OSError(errno.EIO, "Input/output error")
        return original(path, content)

    return write


cases = {
    "commit": (slots, "write_atomic", failing_commit(slots.write_atomic), []),
    "prune": (slots, "remove_slot", failing(PermissionError(errno.EACCES, "Permission denied")), ["keep_last=1"]),
    "export": (export, "publish_dir", failing(OSError(errno.ENOSPC, "No space left on device")), []),
    "metrics": (metrics.MetricsLogger, "log", failing(OSError(errno.EIO, "metrics disk gone")), []),
    "not_shared": (None, None, None, []),
}
report = {}
for case, (owner, attr, replacement, extra) in cases.items():
    original = getattr(owner, attr) if owner is not None else None
    if owner is not None and rank == 0:
        setattr(owner, attr, replacement)
    name = f"fail_{case}" if case != "not_shared" or rank == 0 else "fail_not_shared_rank1_disk"
    try:
        loop.train(config(name, *extra), log=lambda *a: None)
        report[case] = [None, "no error"]
    except Exception as err:
        report[case] = [type(err).__name__, str(err)]
    finally:
        if owner is not None:
            setattr(owner, attr, original)

gathered = [None, None]
import torch.distributed as dist  # noqa: E402

dist.all_gather_object(gathered, report)
if rank == 0:
    with open(out_json, "w") as f:
        json.dump({case: {str(r): gathered[r][case] for r in (0, 1)} for case in cases}, f)
