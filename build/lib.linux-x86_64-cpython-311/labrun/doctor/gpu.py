"""The GPU checks: CUDA (and whether torch's CUDA build runs on the node's driver), a real
matmul and round trip on each GPU, bf16, NCCL."""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from datetime import timedelta

from labrun.core.errors import one_line
from labrun.core.probes import gpu_driver_version, torch_cuda_fit
from labrun.doctor.report import FAILED, NO_GPU_FIX, OK, WARNING, Check


def gpu_count() -> int:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_cuda() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check("cuda", WARNING, f"torch {torch.__version__} is a CPU-only build",
                     "install the CUDA build of torch on GPU machines")
    fit = torch_cuda_fit(torch.__version__, torch.version.cuda)
    if fit is not None and fit.verdict == "too new":  # why torch would see no GPU
        return Check("cuda", FAILED, f"{fit.line}: torch cannot use the GPUs", fit.fix)
    if fit is not None and fit.verdict == "minor":
        return Check("cuda", WARNING, fit.line, fit.fix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    driver = gpu_driver_version()
    if not available:
        why = f": {one_line(caught[0].message)}" if caught else ""
        return Check("cuda", WARNING, f"no GPU (torch built for CUDA {torch.version.cuda}, "
                                      f"driver {driver or 'not found'}){why}", NO_GPU_FIX)
    return Check("cuda", OK, f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown'}, "
                             f"cuDNN {torch.backends.cudnn.version()}, "
                             f"{torch.cuda.device_count()} GPU(s)")


def check_gpus() -> list[Check]:
    count = gpu_count()
    if count == 0:
        return [Check("gpu", WARNING, "no GPU: matmul and round-trip checks skipped", NO_GPU_FIX)]
    return [check_one_gpu(i) for i in range(count)]


def check_one_gpu(index: int) -> Check:
    """The lab guide's test: a real matmul checked against the CPU, and a host<->device round
    trip that must come back bit-identical."""
    import torch

    name = f"gpu {index}"
    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    about = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
             f"sm_{props.major}{props.minor}")
    try:
        generator = torch.Generator().manual_seed(index)
        a = torch.randn(2048, 2048, generator=generator)
        b = torch.randn(2048, 2048, generator=generator)
        expected = (a.double() @ b.double()).float()
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # compare full fp32, not TF32
        try:
            got = (a.to(device) @ b.to(device)).cpu()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
        host = torch.randint(-2**31, 2**31 - 1, (64 * 2**20,), dtype=torch.int32)  # 256 MB
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        back = host.to(device).cpu()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        torch.testing.assert_close(back, host, rtol=0, atol=0)
    except Exception as error:  # noqa: BLE001 - any failure here means a broken GPU
        return Check(name, FAILED, f"{about}: {one_line(error)}",
                     "this GPU computes wrongly or is unreachable: drain it, check nvidia-smi -q "
                     "and dmesg, tell the admins")
    bandwidth = 2 * host.numel() * 4 / seconds / 1e9
    return Check(name, OK, f"{about}: matmul ok, 256 MB round trip ok ({bandwidth:.1f} GB/s)")


def check_bf16() -> Check:
    import torch

    if gpu_count() == 0:
        return Check("bf16", WARNING, "no GPU: bf16 autocast only on the CPU (slow)", NO_GPU_FIX)
    if not torch.cuda.is_bf16_supported():
        return Check("bf16", WARNING, f"{torch.cuda.get_device_name(0)} has no native bf16",
                     "use precision=fp16 on this GPU")
    x = torch.randn(512, 512, device="cuda")
    torch.testing.assert_close((x.bfloat16() @ x.bfloat16()).float(), x @ x, rtol=5e-2, atol=1.0)
    return Check("bf16", OK, "supported, bf16 matmul ok")


def check_nccl() -> Check:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        status = FAILED if gpu_count() else WARNING
        return Check("nccl", status, "this torch build has no NCCL",
                     "install the CUDA build of torch (pip install -e .)")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    count = gpu_count()
    if count == 0:
        return Check("nccl", WARNING, f"NCCL {version} present; no GPU to use it", NO_GPU_FIX)
    if count == 1:
        return Check("nccl", OK, f"NCCL {version}; all_reduce needs 2+ GPUs, skipped")
    error = two_process_all_reduce()
    if error:
        return Check("nccl", FAILED, f"NCCL {version}: 2-process all_reduce: {error}",
                     "check NCCL_DEBUG=INFO output, NCCL_P2P_DISABLE=1, the GPUs' topology")
    return Check("nccl", OK, f"NCCL {version}; 2-process all_reduce on GPUs 0 and 1 ok")


def two_process_all_reduce(backend: str = "nccl", timeout_s: float = 120) -> str | None:
    """None when two processes (on GPUs 0 and 1 with nccl) all_reduce correctly, else what
    went wrong. The tests run it with gloo on the CPU."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        init = f"file://{folder}/init"
        workers = [context.Process(target=_all_reduce_worker, args=(rank, 2, init, backend))
                   for rank in range(2)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if any(worker.is_alive() for worker in workers):
            for worker in workers:
                worker.kill()
            return f"timed out after {timeout_s:.0f} s"
        codes = [worker.exitcode for worker in workers]
    return None if codes == [0, 0] else f"worker exit codes {codes} (3: wrong sum)"


def _all_reduce_worker(rank: int, world_size: int, init_method: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        tensor = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(tensor)
        expected = world_size * (world_size + 1) / 2
        if not torch.all(tensor == expected):
            sys.exit(3)
    finally:
        dist.destroy_process_group()
