"""Session fixtures: the tiny demo target and its regenerated chat dataset, built once, and the small
chat dataset the training tests share."""

import os
from pathlib import Path

import pytest

from specdraft.demo import ensure_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    # SPECDRAFT_TEST_CACHE keeps the tiny build between local runs (its stamp still decides
    # whether it is current); by default each session builds a fresh one.
    home = os.environ.get("SPECDRAFT_TEST_CACHE") or tmp_path_factory.mktemp("specdraft_home")
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
    import shutil

    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny4")
    tiny = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    config = tiny.config
    config.num_hidden_layers = 4
    deeper = LlamaForCausalLM(config)
    state = {k.replace("layers.0.", "layers.2.").replace("layers.1.", "layers.3."): v
             for k, v in tiny.state_dict().items() if ".layers." in k}
    deeper.load_state_dict({**tiny.state_dict(), **state})
    deeper.save_pretrained(directory)
    for path in Path(tiny_target_dir).iterdir():
        if "token" in path.name or path.name.endswith(".jinja"):
            shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="session")
def mtp_target_dir(tiny_target_dir, tmp_path_factory):
    """A tiny qwen3_next target with a native MTP layer, every layer full attention
    (helpers.qwen3_next_mtp_target)."""
    from helpers import qwen3_next_mtp_target

    return qwen3_next_mtp_target(tmp_path_factory.mktemp("mtp_target") / "target", tiny_target_dir)
