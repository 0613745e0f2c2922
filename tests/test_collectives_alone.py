"""parallel/collectives.run_shared in one process with no process group (a script calling the data
pipeline before any training): fn runs and its own error surfaces, not torch's "Default process group
has not been initialized", which used to hide it. A fresh interpreter: another test in this pytest
worker may have left a process group initialized."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from specdraft.errors import SpecdraftError
    from specdraft.parallel.collectives import run_shared

    on_rank = None if sys.argv[1] == "None" else int(sys.argv[1])
    assert not dist.is_initialized()
    assert run_shared(lambda: 7, on_rank=on_rank) == 7

    def fail():
        raise SpecdraftError("data.jsonl:3: no assistant turn")

    try:
        run_shared(fail, on_rank=on_rank)
    except SpecdraftError as error:
        print("raised:", error)
    """
)


@pytest.mark.parametrize("on_rank", [None, 0])
def test_run_shared_without_a_process_group_runs_and_raises_its_own_error(on_rank):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(on_rank)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "raised: data.jsonl:3: no assistant turn"
