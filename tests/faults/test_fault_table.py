"""The fault table reaches `make test`'s output: with two xdist workers the tests run in the
workers, and the table is printed by the controlling process from the rows that come back in
the test reports (tests/conftest.py). Before, the table lived in the workers and never showed."""

from __future__ import annotations

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


def test_the_fault_table_adds_up_the_rows_of_both_xdist_workers():
    result = subprocess.run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadgroup", "-v", SAMPLE],
                            cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    # Each test ran on its own worker: the rows had to come from both.
    passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert {line.split("]")[0] for line in passed} == {"[gw0", "[gw1"}, passed
    # trials | survived | data lost | cannot tell, as the sample's trial() calls give them.
    assert fault_table(result.stdout) == ["sample: both tests | 2 | 1 | 0 | 1",
                                          "sample: first | 1 | 1 | 0 | 0",
                                          "sample: second | 2 | 1 | 1 | 1"]
