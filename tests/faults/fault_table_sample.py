"""Two tests that record fault trials, for tests/faults/test_fault_table.py, which runs this
file in a child pytest on two xdist workers. Not collected by the suite: its name does not
start with test_. Each test is a group of its own (SPREAD_OVER_WORKERS), so the two run on
different workers and the table must add up rows from both. What each test records comes from
test_fault_table.py ($LABRUN_FAULT_SAMPLE: per test, its trials as [fault, survived, lost]),
which computes the table it expects from the same trials."""

import json
import os

SPREAD_OVER_WORKERS = True


def record_trials(fault, test: str) -> None:
    for name, survived, lost in json.loads(os.environ["LABRUN_FAULT_SAMPLE"])[test]:
        fault(name).trial(survived, lost=lost, note=f"survived={survived}, lost={lost}")


def test_first(fault):
    record_trials(fault, "test_first")


def test_second(fault):
    record_trials(fault, "test_second")
