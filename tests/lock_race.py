"""The claimants of tests/test_run_lock.py's race over a stale lock, in a module of their own:
the claimant processes import it, and it imports only the lock (the test module would bring
pytest and the rest, a second of start-up for each)."""

from __future__ import annotations

import os
import random
import time

from labrun.runs import lock


def claim_rounds(paths: list[str], barrier, done, results) -> None:
    """One claimant: in each round, race the others for a stale lock with lock.acquire; a
    winner then checks that it still holds the lock, as a writer does before each write,
    until all three have made their move (and three times at least). Puts (rounds won,
    problems) on `results`."""
    won, problems = [], []
    for round_, path in enumerate(paths):
        barrier.wait()
        # Start within a few ms of each other, not in step: a claimant's take-over must also
        # land in the middle of another's (its judgement made before the other won).
        time.sleep(random.uniform(0, 0.005))
        try:
            held = lock.acquire(path)
        except lock.RunLocked:
            held = None
        except Exception as error:  # counted, so that a broken claimant fails the round
            problems.append(f"round {round_}: {error!r}")
            held = None
        with done.get_lock():
            done[round_] += 1
        if held is None:
            continue
        won.append(round_)
        checks = 0
        while done[round_] < 3 or checks < 3:
            try:
                lock.ensure_owner(path)  # what each write runs first
            except lock.LockLost as lost:
                problems.append(f"round {round_}: the winner lost its lock: {lost}")
                break
            checks += 1
            time.sleep(0)  # let the others run: on two cores a spinning winner starves them
        held.release()
    results.put((won, problems))


def claim_in_process(paths, barrier, done, results) -> None:
    os.environ.pop(lock.TOKEN_ENV, None)
    claim_rounds(paths, barrier, done, results)
