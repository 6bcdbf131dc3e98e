"""Stop signals: SIGTERM, SIGINT and SIGUSR2 ask the trainer for a checkpoint at the next step
boundary; a second SIGINT aborts at once.

Only a second SIGINT aborts, whatever came between: a Ctrl-C in a terminal reaches a local DDP
run's launcher and its workers at once, and the launcher passes it on as SIGTERM, which a busy
machine may deliver to a worker before the Ctrl-C itself. That is still one Ctrl-C.

SIGUSR2 is SLURM's warning before a time limit or a preemption. A USR2 handler that was
already installed (submitit's: it requeues the job) is kept, and the trainer calls it after
that checkpoint, so the requeued job resumes from it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.interrupts = 0  # SIGINTs received
        self.requeue_handler = None  # the USR2 handler found when catching started
        self.announced = False  # the stop was logged (at a step boundary, never in a handler)

    def catch(self) -> Callable[[], None]:
        """Install the handlers; returns what puts the previous ones back."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in CAUGHT}
        self.requeue_handler = previous[signal.SIGUSR2]

        def handler(signum, frame):
            if signum == signal.SIGINT:
                self.interrupts += 1
                if self.interrupts > 1:
                    raise KeyboardInterrupt
            if signum != signal.SIGINT:
                # SLURM sends SIGTERM (scancel) and USR2 (a preemption's notice) to every
                # process of the job step, the DataLoader workers too, which they kill; torch's
                # SIGCHLD handler would then raise "DataLoader worker ... is killed by signal"
                # here, failing the run before its checkpoint. The step's batch is in hand and
                # the run stops at a step boundary: the workers' deaths no longer matter.
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # No logging here: a handler that logs can interrupt the logging module's own
            # flush of the same stream, which raises "reentrant call" (agreed() logs instead).
            self.signum = signum

        for s in previous:
            signal.signal(s, handler)
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def agreed(self, distributed: bool, device: torch.device) -> bool:
        """Whether any rank got a stop signal: every rank stops at the same step boundary."""
        signum = self.signum or 0
        if distributed:
            flag = torch.tensor(float(signum), device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        if signum:
            self.signum = signum
            if not self.announced:
                self.announced = True
                log.info(f"{self.name}: stopping at this step with a checkpoint")
        return bool(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def requeues(self) -> bool:
        """A USR2 with submitit's handler behind it: the job is requeued, not just stopped."""
        return self.signum == signal.SIGUSR2 and callable(self.requeue_handler)

    def requeue(self) -> None:
        """Hand over to submitit's USR2 handler, which requeues the job and exits.

        Requeueing makes SLURM end the job step at once: its SIGTERM reaches the DataLoader
        workers too, and torch's SIGCHLD handler would then raise "DataLoader worker ... is
        killed by signal" in this process while it exits, so the job would end as a failure
        (the result submitit reports to the sweep) instead of as requeued. Past the checkpoint
        the workers' deaths no longer matter: the default SIGCHLD handling ignores them."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.requeue_handler(self.signum, None)
