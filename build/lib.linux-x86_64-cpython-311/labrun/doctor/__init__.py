"""`labrun doctor [--json] [--partition P]`: is this machine ready to train?

Every check does the real thing where it can (a matmul on each GPU, a host<->device round trip,
an all_reduce, a JPEG decode, an HDF5 write) rather than only importing a module, and reports
ok / warning / failed with a one-line fix. Exit code 1 when any check failed.

On a machine without a GPU the GPU checks are warnings: the CPU is a legitimate place to
develop and to run the tests.

The checks live by subject: gpu.py, libraries.py, machine.py (W&B, SLURM, disks, the project's
config); report.py holds the result type and the table. The command is labrun.cli.doctor.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from labrun.core.errors import one_line
from labrun.doctor.gpu import (
    check_bf16,
    check_cuda,
    check_gpus,
    check_nccl,
    two_process_all_reduce,
)
from labrun.doctor.libraries import (
    check_h5py,
    check_jpeg_regions,
    check_mask_rows,
    check_python,
    check_requirements,
    check_torch,
    check_torchvision,
    check_turbojpeg,
)
from labrun.doctor.machine import check_disk, check_slurm, check_wandb, load_project_context
from labrun.doctor.report import FAILED, OK, WARNING, Check, print_table

__all__ = ["FAILED", "OK", "WARNING", "Check", "print_table", "run_checks",
           "two_process_all_reduce"]


def run_checks(partition: str | None = None) -> list[Check]:
    context = load_project_context(partition)
    steps: list[tuple[str, Callable[[], Check | list[Check]] | None]] = [
        ("python", check_python),
        ("torch", check_torch),
        ("torchvision", check_torchvision),
        ("cuda", check_cuda),
        ("gpu", check_gpus),
        ("bf16", check_bf16),
        ("nccl", check_nccl),
        ("turbojpeg", check_turbojpeg),
        ("jpeg regions", check_jpeg_regions),
        ("mask rows", check_mask_rows),
        ("h5py", check_h5py),
        ("wandb", check_wandb),
        ("slurm", None),  # started first, in the background: see below
        ("disk", lambda: check_disk(context["folders"])),
        ("requirements", check_requirements),
    ]
    with ThreadPoolExecutor(max_workers=1) as pool:
        # sinfo waits out SLURM's 10 s message timeout when the controller is down; it runs
        # beside the other checks rather than after them.
        slurm = pool.submit(guarded, "slurm", lambda: check_slurm(context["partition"],
                                                                  context["partition_from"]))
        results = [guarded(name, step) if step else slurm.result() for name, step in steps]
    return [c for result in results for c in (result if isinstance(result, list) else [result])]


def guarded(name: str, step: Callable[[], Check | list[Check]]) -> Check | list[Check]:
    try:
        return step()
    except Exception as error:  # noqa: BLE001 - a crashing check is a failed check
        return Check(name, FAILED, f"the check itself crashed: {type(error).__name__}: "
                                   f"{one_line(error)}", "run with a debugger; report it")
