"""The fault table reaches `make test`'s output: with two xdist workers the tests run in the
workers, and the table is printed by the controlling process from the rows that come back in
the test reports (tests/conftest.py). Before, the table lived in the workers and never showed."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PROJECT, PYTHON

SAMPLE = "tests/faults/fault_table_sample.py"
HEADER = "fault injection: fault | trials | survived | data lost | cannot tell"


def fault_table(output: str) -> list[str]:
    lines = output.splitlines()
    assert HEADER in lines, output[-3000:]
    rows = lines[lines.index(HEADER) + 1:]
    return [row.strip() for row in rows[:next((i for i, r in enumerate(rows)
                                               if not r.startswith("  ")), len(rows))]]


# What each of the sample's two tests records: (fault, survived, data lost: True, False or
# None for cannot tell). "sample: both" gets a trial from each worker.
TRIALS = {"test_first": [("sample: first", True, False), ("sample: both", True, False)],
          "test_second": [("sample: second", False, True), ("sample: second", True, None),
                          ("sample: both", False, None)]}


def expected_table() -> list[str]:
    """trials | survived | data lost | cannot tell of each fault, added up from TRIALS."""
    rows: dict[str, list[int]] = {}
    for name, survived, lost in (t for trials in TRIALS.values() for t in trials):
        row = rows.setdefault(name, [0, 0, 0, 0])
        row[0] += 1
        row[1] += survived
        row[2] += lost is True
        row[3] += lost is None
    return [" | ".join([name, *map(str, row)]) for name, row in sorted(rows.items())]


def test_the_fault_table_adds_up_the_rows_of_both_xdist_workers():
    result = subprocess.run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadgroup", "-v", SAMPLE],
                            cwd=PROJECT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LABRUN_FAULT_SAMPLE": json.dumps(TRIALS)})
    assert result.returncode == 0, result.stdout[-3000:]
    # Each test ran on its own worker: the rows had to come from both.
    passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert {line.split("]")[0] for line in passed} == {"[gw0", "[gw1"}, passed
    assert fault_table(result.stdout) == expected_table()
