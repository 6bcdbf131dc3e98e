"""Stop signals (train/stop_signals.py), in-process: the order they may arrive in, and the requeue
path of a preempted SLURM job, which makes SLURM SIGTERM every process of the job step at once,
DataLoader workers included."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
from torch.utils.data import DataLoader

from labrun.train.stop_signals import StopSignals


def test_workers_killed_by_the_requeue_do_not_turn_it_into_a_failure():
    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2)
    batches = iter(loader)  # starts the workers and torch's SIGCHLD handler
    next(batches)
    workers = list(batches._workers)
    requeued = []

    def submitit_handler(signum, frame):
        # What SLURM does once submitit has requeued the job: it ends the whole step. The
        # exit that follows takes a moment, in which torch's SIGCHLD handler ran and raised
        # "DataLoader worker (pid N) is killed by signal" before the fix.
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)  # (SIGTERM lets a torch worker exit with 0)
        deadline = time.time() + 5
        while any(w.is_alive() for w in workers) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # signal handlers run between bytecodes: give SIGCHLD its turn
        requeued.append(signum)

    signals = StopSignals()
    signals.signum, signals.requeue_handler = signal.SIGUSR2, submitit_handler
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        signals.requeue()
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert requeued == [signal.SIGUSR2]
    assert torch.utils.data.get_worker_info() is None  # still the main process


def test_one_ctrl_c_stops_whatever_order_it_arrives_in_and_a_second_aborts():
    """A Ctrl-C reaches a local DDP run's launcher and its workers at once, and the launcher
    passes it on as SIGTERM: on a busy machine a worker may get that SIGTERM first."""
    signals = StopSignals()
    restore = signals.catch()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, ahead of ...
        os.kill(os.getpid(), signal.SIGINT)  # ... the Ctrl-C itself: still a stop, no abort
        assert signals.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: abort at once
    finally:
        restore()


def test_a_signal_logs_nothing_in_its_handler_only_at_the_step_boundary(caplog):
    """A handler that logs can land inside the logging module's own flush of the same file
    (CPython runs handlers when a write is interrupted), which raises "reentrant call inside
    BufferedWriter": the stop is logged by agreed(), at the step boundary, once."""
    signals = StopSignals()
    restore = signals.catch()
    try:
        with caplog.at_level(logging.INFO, logger="labrun.train.stop_signals"):
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.signum == signal.SIGTERM
            assert caplog.messages == []  # nothing from inside the handler
            assert signals.agreed(False, torch.device("cpu"))
            assert signals.agreed(False, torch.device("cpu"))
        assert caplog.messages == ["SIGTERM: stopping at this step with a checkpoint"]
    finally:
        restore()
