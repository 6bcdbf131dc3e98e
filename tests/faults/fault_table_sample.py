"""Two tests that record fault trials, for tests/faults/test_fault_table.py, which runs this
file in a child pytest on two xdist workers. Not collected by the suite: its name does not
start with test_. Each test is a group of its own (SPREAD_OVER_WORKERS), so the two run on
different workers and the table must add up rows from both. The trials' outcomes are this
sample's input, chosen so that every column of the table gets a different sum; what is
checked is the table test_fault_table.py reads back from the child pytest."""

SPREAD_OVER_WORKERS = True


def test_one_trial_that_survives(fault):
    # Input to the table, not checks: test_fault_table.py asserts the sums it prints.
    fault("sample: first").trial(True, lost=False, note="survived, nothing lost")
    fault("sample: both tests").trial(True, lost=False, note="survived, nothing lost")


def test_trials_that_lose_data_or_cannot_tell(fault):
    record = fault("sample: second")
    record.trial(False, lost=True, note="failed, lost data")
    record.trial(True, lost=None, note="survived, cannot tell")
    fault("sample: both tests").trial(False, lost=None, note="failed, cannot tell")
