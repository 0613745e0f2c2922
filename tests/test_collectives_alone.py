"""parallel/collectives.run_shared in one process with no process group (a script calling the data
pipeline before any training): fn runs and its own error surfaces, not torch's "Default process group
has not been initialized", which used to hide it."""

import pytest
import torch.distributed as dist

from specdraft.errors import SpecdraftError
from specdraft.parallel.collectives import run_shared


def fail():
    raise SpecdraftError("data.jsonl:3: no assistant turn")


@pytest.mark.parametrize("on_rank", [None, 0])
def test_run_shared_without_a_process_group_runs_and_raises_its_own_error(on_rank):
    assert not dist.is_initialized()
    assert run_shared(lambda: 7, on_rank=on_rank) == 7
    with pytest.raises(SpecdraftError, match="data.jsonl:3: no assistant turn"):
        run_shared(fail, on_rank=on_rank)
