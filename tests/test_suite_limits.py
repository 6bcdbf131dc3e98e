"""The suite cannot hang and stays fast: every test has a time limit, and the session fixtures
that train or export are built once for both of `make test`'s xdist workers."""

from __future__ import annotations

import os
import subprocess

from conftest import PROJECT, PYTHON


def test_every_test_has_a_time_limit(request):
    # pyproject.toml's [tool.pytest.ini_options] timeout (pytest-timeout), whose comment gives
    # the reason for its value; without one a hung subprocess or wait blocks `make test`.
    assert float(request.config.getini("timeout") or 0) > 0


def test_a_session_fixture_is_built_once_for_both_xdist_workers(tmp_path):
    log = tmp_path / "builds.log"
    result = subprocess.run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadgroup", "-v", "tests/built_once_sample.py"],
                            cwd=PROJECT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "BUILT_ONCE_LOG": str(log)})
    assert result.returncode == 0, result.stdout[-3000:]
    # Each test ran on its own worker, so each worker asked for the fixture...
    passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert {line.split("]")[0] for line in passed} == {"[gw0", "[gw1"}, passed
    # ...and one of them built it.
    assert len(log.read_text().splitlines()) == 1, log.read_text()
