"""parallel/collectives.run_shared in one process with no process group (a script calling the data
pipeline before any training): fn runs and its own error surfaces, not torch's "Default process group
has not been initialized", which used to hide it. A fresh interpreter: another test in this pytest
worker may have left a process group initialized."""

import subprocess
import sys
import textwrap
from pathlib import Path

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


def test_the_data_pipeline_runs_in_a_process_without_a_process_group(tiny_assets, tmp_path):
    """prepare_data from a plain script (a bench driver): its collectives are a world of one."""
    target, tiny = tiny_assets
    script = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from specdraft.config import load_config
        from specdraft.target.model import load_target_tokenizer
        from specdraft.train.data import prepare_data

        cfg = load_config(None, ["target={target}", "data_files={Path(tiny.train_files[0]).parent}/*.jsonl",
                                 "data_cache_dir={tmp_path}", "max_seq_length=64", "packing=whole"])
        data = prepare_data(cfg, load_target_tokenizer(cfg.target), 0, lambda *a: None)
        assert not dist.is_initialized()
        print("windows", len(data) > 0)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("windows True")
