"""The requeue path of a preempted SLURM job (train/stop_signals.py), in-process: the requeue
makes SLURM SIGTERM every process of the job step at once, DataLoader workers included."""

from __future__ import annotations

import os
import signal
import time

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
