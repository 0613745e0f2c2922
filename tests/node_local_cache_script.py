"""Run on 2 ranks by tests/test_multinode.py: rank 1 names another packed-data cache than rank 0
(as a node whose cache directory is on its own disk would), and the run must stop on both ranks
with one line instead of leaving rank 0 waiting at its next collective."""

import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)

import torch.distributed as dist  # noqa: E402

from helpers import run_overrides  # noqa: E402
from specdraft.cli import main  # noqa: E402
from specdraft.rundir import shared_fs  # noqa: E402
from specdraft.train import data  # noqa: E402

target, data_dir, work = sys.argv[1:4]
shared_fs.VISIBLE_WAIT_S = 1.0  # how long a rank looks for a file another rank wrote
real = data.packed_cache_dir


def node_local(files, *args):
    path = real(files, *args)
    return path if dist.get_rank() == 0 else path.with_name(path.name + "-node1")  # rank 1's own disk


data.packed_cache_dir = node_local
overrides = run_overrides(
    target,
    data_dir,
    f"{work}/run",
    f"{work}/cache",
    per_device_batch_size=2,
    max_steps=1,
    learning_rate=None,  # train.yaml's
    warmup_steps=None,  # these three: the config's own
    logging_steps=None,
    seed=None,
)
sys.exit(main(["train", f"{work}/train.yaml", *overrides]))
