"""Process-group set-up and rank helpers.

One process per GPU. The rank and world size come from torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) or from SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the
first host of SLURM_JOB_NODELIST as master). A single process needs no process group.

Not submitit's TorchDistributedEnvironment: it works only inside a submitit job (it reads
SUBMITIT_FOLDER), while labrun's ranks also start under torchrun, plain `srun python train.py`
and `trainer.devices=N` on one machine.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import subprocess
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from labrun.core.errors import ConfigError


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


def _from_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) of this process, set by torchrun or SLURM."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"])
    return 0, 0, 1


def _master_address() -> str:
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                             capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    return "127.0.0.1"


def _master_port() -> str:
    """Derived from the job id, so two jobs on one node never pick the same port."""
    if "MASTER_PORT" in os.environ:
        return os.environ["MASTER_PORT"]
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    return str(20000 + int(job_id) % 20000)


def setup(trainer: DictConfig, settings: DictConfig) -> Distributed:
    """This process's rank and device; the process group when there are several ranks.
    `settings` is the `distributed` config (backend, timeout_s)."""
    backend, timeout_s = settings.backend, settings.timeout_s
    rank, local_rank, world_size = _from_environment()
    device = pick_device(trainer.accelerator, local_rank)
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: the processes of one node share its cores instead of each
        # starting a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, trainer.devices)))
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", _master_address())
        os.environ.setdefault("MASTER_PORT", _master_port())
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return Distributed(rank, local_rank, world_size, device)


def launched_as_one_process(trainer: DictConfig) -> bool:
    """True when `python train.py trainer.devices=N` must start its N processes itself
    (no torchrun, SLURM or submitit set up the ranks)."""
    return trainer.devices > 1 and _from_environment()[2] == 1


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
    mean "abort at once". A second signal to the launcher goes on as SIGINT: abort at once.
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
