"""Process-group set-up and rank helpers.

One process per GPU. The rank, world size and rendezvous come from core.environment, which
reads torchrun's variables and those of the scheduler that started the job (srun's tasks on
SLURM; the first host of the job as the rendezvous where nobody set MASTER_ADDR). A single
process needs no process group.

Not submitit's TorchDistributedEnvironment: it works only inside a submitit job (it reads
SUBMITIT_FOLDER), while labrun's ranks also start under torchrun, plain `srun python train.py`
and `trainer.devices=N` on one machine.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from labrun.core import environment, probes
from labrun.core.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Distributed:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    if accelerator in ("auto", "cuda"):
        check_driver_fit()
    if accelerator == "auto":
        if torch.cuda.is_available():
            accelerator = "cuda"
        elif torch.backends.mps.is_available():
            accelerator = "mps"
        else:
            accelerator = "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=cuda but no CUDA GPU is visible; "
                              "use trainer.accelerator=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator=mps but MPS is not available; use auto or cpu")
    return torch.device(accelerator)


def check_driver_fit() -> None:
    """Refuse, before any data is loaded, a torch whose CUDA build this node's driver cannot
    run: torch would see no GPU, and trainer.accelerator=auto would train on the CPU for hours
    (or fail later with "libcudart.so: cannot open shared object file")."""
    fit = probes.torch_cuda_fit(torch.__version__, torch.version.cuda)
    if fit is not None and fit.verdict == "too new":
        raise ConfigError(f"{fit.line}: torch cannot use this node's GPUs; {fit.fix}")
    if fit is not None and fit.verdict == "minor":
        log.warning(fit.line)


def setup(trainer: DictConfig, settings: DictConfig) -> Distributed:
    """This process's rank and device; the process group when there are several ranks.
    `settings` is the `distributed` config (backend, timeout_s)."""
    backend, timeout_s = settings.backend, settings.timeout_s
    here = environment.read()
    rank, local_rank, world_size = here.rank, here.local_rank, here.world_size
    device = pick_device(trainer.accelerator, local_rank)
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: the processes of one node share its cores instead of each
        # starting a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, trainer.devices)))
    if world_size > 1 and not dist.is_initialized():
        for name, value in here.rendezvous().items():  # for init_process_group's env://
            os.environ.setdefault(name, value)
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return Distributed(rank, local_rank, world_size, device)


def launched_as_one_process(trainer: DictConfig) -> bool:
    """True when `python train.py trainer.devices=N` must start its N processes itself
    (no torchrun, SLURM or submitit set up the ranks)."""
    return trainer.devices > 1 and environment.read().world_size == 1


def run_processes(nprocs: int, function, *args):
    """Run `function(*args)` in `nprocs` local processes with torchrun's machinery
    (torch.distributed.launcher: the same agent as the torchrun command); return rank 0's
    result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # SIGINT and SIGTERM are left to _passing_stop_signals_on (the agent's own handler would
    # stop the workers mid-step and wait 30 s to kill them, and rank 0's result would be lost).
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.5, start_method="spawn",
                          signals_to_handle="SIGHUP,SIGQUIT")
    with _passing_stop_signals_on():
        return elastic_launch(config, function)(*args)[0]


@contextlib.contextmanager
def _passing_stop_signals_on():
    """Ctrl-C or SIGTERM to the launcher: its workers stop as one process would, with a
    checkpoint at the next step boundary, and return "interrupted" as their result.

    The first signal goes on as SIGTERM, a stop request even for a worker that got the same
    Ctrl-C itself (a terminal sends it to the whole process group), where a second SIGINT would
    mean "abort at once". Later signals go on as SIGINT: a worker aborts at its second SIGINT
    (stop_signals.py), so a second Ctrl-C in a terminal aborts, and a launcher signalled alone
    aborts its workers at its third signal.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def pass_on(signum, frame):
        received.append(signum)
        workers = multiprocessing.active_children()  # the launcher's spawned ranks
        if not workers:  # none started yet: nothing to checkpoint, stop the launcher itself
            raise KeyboardInterrupt
        sent = signal.SIGTERM if len(received) == 1 else signal.SIGINT
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, sent)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, pass_on)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
