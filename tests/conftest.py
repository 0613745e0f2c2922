"""Session fixtures: the tiny demo target and its regenerated chat dataset, built once."""

import os

import pytest

from specdraft.demo import ensure_demo_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    # SPECDRAFT_TEST_CACHE keeps the tiny build between local runs (its stamp still decides
    # whether it is current); by default each session builds a fresh one.
    home = os.environ.get("SPECDRAFT_TEST_CACHE") or tmp_path_factory.mktemp("specdraft_home")
    return ensure_demo_assets(home, preset="tiny")


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_assets):
    return tiny_assets[0]


@pytest.fixture(scope="session")
def tiny_data(tiny_assets):
    return tiny_assets[1]
