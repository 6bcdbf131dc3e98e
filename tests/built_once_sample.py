"""Two tests that ask for one session fixture made with conftest.built_once, for
tests/test_suite_limits.py, which runs this file in a child pytest on two xdist workers. Not
collected by the suite: its name does not start with test_. Each test is a group of its own
(SPREAD_OVER_WORKERS), so each worker asks for the fixture."""

import os
from pathlib import Path

import pytest

from conftest import built_once

SPREAD_OVER_WORKERS = True


def build(folder: Path) -> None:
    # Each build says which worker made it, in the log the parent test reads.
    with open(os.environ["BUILT_ONCE_LOG"], "a") as log:
        log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'no xdist')} built {folder}\n")
    (folder / "made").write_text("by the one build")


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "shared", build)


def test_one_reader(shared):
    assert (shared / "made").read_text() == "by the one build"


def test_another_reader(shared):
    assert (shared / "made").read_text() == "by the one build"
