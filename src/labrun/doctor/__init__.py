"""`labrun doctor [--json] [--partition P]`: is this machine ready to train?

Every check does the real thing where it can (a matmul on each GPU, a host<->device round trip,
an all_reduce, a JPEG decode, an HDF5 write) rather than only importing a module, and reports
ok / warning / failed with a one-line fix. Exit code 1 when any check failed.

On a machine without a GPU the GPU checks are warnings: the CPU is a legitimate place to
develop and to run the tests.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from labrun.core.errors import one_line
from labrun.core.project import PROJECT_DIR

OK, WARNING, FAILED = "ok", "warning", "failed"
LOW_DISK_GIB, MIN_DISK_GIB = 10, 1


@dataclass
class Check:
    check: str
    status: str
    detail: str
    fix: str = ""


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--partition", default=None,
                        help="SLURM partition to look for (default: from conf/cluster/lab.yaml)")


def run(args) -> int:
    checks = run_checks(args.partition)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print_table(checks)
    return 1 if any(c.status == FAILED for c in checks) else 0


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


def print_table(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {OK: "green", WARNING: "yellow", FAILED: "red"}
    table = Table(title="labrun doctor", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.check, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console = Console()
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARNING, FAILED)}
    console.print(f"{counts[OK]} ok, {counts[WARNING]} warnings, {counts[FAILED]} failed")


# ---------------------------------------------------------------------------------------------
# Python and the frameworks


def check_python() -> Check:
    from packaging.specifiers import SpecifierSet

    try:
        needed = importlib.metadata.metadata("labrun")["Requires-Python"] or ">=3.10"
    except importlib.metadata.PackageNotFoundError:
        needed = ">=3.10"
    version = platform.python_version()
    detail = f"{version} ({sys.executable})"
    if version in SpecifierSet(needed):
        return Check("python", OK, detail)
    return Check("python", FAILED, f"{detail}; labrun needs {needed}",
                 f"create the .venv with a Python {needed}")


def check_torch() -> Check:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    a, b = torch.randn(256, 256, dtype=torch.float64), torch.randn(256, 256, dtype=torch.float64)
    torch.testing.assert_close((a.float() @ b.float()).double(), a @ b, rtol=1e-4, atol=1e-4)
    return Check("torch", OK, f"{torch.__version__} ({build}), CPU matmul ok, "
                              f"{torch.get_num_threads()} threads")


def check_torchvision() -> Check:
    import torch
    import torchvision

    # The compiled operators fail here when torchvision was built for another torch.
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0]])
    kept = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5)
    if kept.tolist() != [0]:
        return Check("torchvision", FAILED, f"{torchvision.__version__}: nms gave {kept}",
                     "reinstall the pinned torch/torchvision pair: pip install -e .")
    return Check("torchvision", OK, f"{torchvision.__version__}, compiled ops ok")


# ---------------------------------------------------------------------------------------------
# GPUs


NO_GPU_FIX = "on a GPU node: check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES"


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    driver = driver_version()
    if not available:
        why = f": {one_line(caught[0].message)}" if caught else ""
        return Check("cuda", WARNING, f"no GPU (torch built for CUDA {torch.version.cuda}, "
                                      f"driver {driver or 'not found'}){why}", NO_GPU_FIX)
    return Check("cuda", OK, f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown'}, "
                             f"cuDNN {torch.backends.cudnn.version()}, "
                             f"{torch.cuda.device_count()} GPU(s)")


def driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


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


# ---------------------------------------------------------------------------------------------
# Libraries the data pipeline and tracking need


def check_turbojpeg() -> Check:
    import numpy as np

    fix = "apt install libturbojpeg0 (Debian/Ubuntu); until then the data pipeline uses Pillow"
    try:
        from turbojpeg import TurboJPEG
        jpeg = TurboJPEG()
    except Exception as error:  # noqa: BLE001 - import or library load, both mean "missing"
        return Check("turbojpeg", WARNING, f"libturbojpeg does not load: {one_line(error)}",
                     fix)
    image = np.tile(np.arange(64, dtype=np.uint8)[:, None, None] * 4, (1, 64, 3))
    decoded = jpeg.decode(jpeg.encode(image, quality=95))
    if decoded.shape != image.shape or np.abs(decoded.astype(int) - image).max() > 16:
        return Check("turbojpeg", FAILED, "encode/decode round trip is wrong", fix)
    return Check("turbojpeg", OK, "libturbojpeg loads, JPEG round trip ok")


def check_jpeg_regions() -> Check:
    """The compiled decoder that decodes only a training crop (labrun/data/_jpeg_region.c)."""
    import numpy as np

    from labrun.data import decode

    if decode._decode_region is None:
        return Check("jpeg regions", WARNING, "labrun's JPEG region decoder is not compiled: "
                     "training decodes whole images (slower)",
                     "apt install libjpeg62-turbo-dev gcc, then pip install -e . again")
    if decode.turbojpeg_error() is not None:
        return Check("jpeg regions", WARNING, "compiled, unused without libturbojpeg",
                     "apt install libturbojpeg0")
    image = np.tile(np.arange(96, dtype=np.uint8)[:, None, None] * 2, (1, 80, 3))
    data = decode.encode_jpeg(image, quality=95)
    full = decode.decode(data, "turbojpeg")
    if not np.array_equal(decode.decode_region(data, 30, 20, 40, 50), full[30:70, 20:70]):
        return Check("jpeg regions", FAILED, "a decoded region differs from the full decode",
                     "pip install -e . again, against this machine's libjpeg-turbo")
    return Check("jpeg regions", OK, "compiled; a decoded region equals the full decode")


def check_h5py() -> Check:
    try:
        import h5py
        import numpy as np
    except ImportError as error:
        return Check("h5py", FAILED, f"{error}", "pip install -e .")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "check.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.arange(100, dtype=np.uint8))
        with h5py.File(path, "r") as f:
            ok = f["x"][10:20].tolist() == list(range(10, 20))
    if not ok:
        return Check("h5py", FAILED, "HDF5 write/read round trip is wrong", "pip install -e .")
    return Check("h5py", OK, f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
                             f"write/read ok")


def check_wandb() -> Check:
    """Logged in or offline, read from the environment and ~/.netrc; the key is never shown."""
    if importlib.util.find_spec("wandb") is None:
        return Check("wandb", WARNING, "wandb not installed", "pip install -e .")
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled"):
        return Check("wandb", OK, f"WANDB_MODE={mode}: runs stay local (wandb sync later)")
    if os.environ.get("WANDB_API_KEY"):
        # Only the server can tell whether the key is valid, and doctor contacts no server:
        # a set key is reported as exactly that, never as "logged in".
        return Check("wandb", WARNING, "key set (WANDB_API_KEY), not verified",
                     "wandb login --verify checks the key against the server")
    from labrun.track.loggers import wandb_host

    host = wandb_host()
    netrc_path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc_path.is_file():
        import netrc
        try:
            if netrc.netrc(netrc_path).authenticators(host):
                return Check("wandb", OK, f"logged in to {host} ({netrc_path})")
        except (netrc.NetrcParseError, OSError) as error:
            return Check("wandb", WARNING, f"{netrc_path} unreadable: {one_line(error)}",
                         "fix the file's syntax/permissions, or run: wandb login")
    return Check("wandb", WARNING, f"not logged in to {host}: logger=wandb runs offline",
                 "wandb login (or export WANDB_MODE=offline to make offline explicit)")


# ---------------------------------------------------------------------------------------------
# SLURM, disks, requirements


def check_slurm(partition: str | None, partition_from: str) -> list[Check]:
    # With a configured partition the user means to submit: problems are failures then.
    severity = FAILED if partition else WARNING
    skipped = Check("slurm partition", WARNING, f"no partition to check ({partition_from})",
                    "pass --partition NAME, or set it in conf/cluster/lab.yaml")
    if shutil.which("sinfo") is None:
        result = [Check("slurm", severity, "sinfo not found: SLURM client not installed",
                        "install slurm-client, or use cluster=local")]
        return result + [skipped if partition is None else
                         Check("slurm partition", FAILED, f"{partition}: cannot ask SLURM",
                               "install slurm-client")]
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %a %D %T"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        out = None
    if out is None or out.returncode != 0:
        why = "timed out" if out is None else one_line(out.stderr or out.stdout or "error")
        result = [Check("slurm", severity, f"sinfo failed: {why}",
                        "is slurmctld up? (scripts/slurm_up.sh for the dev cluster); "
                        "check /etc/slurm/slurm.conf and munge")]
        return result + [skipped if partition is None else
                         Check("slurm partition", FAILED, f"{partition}: cannot ask SLURM",
                               "bring the SLURM controller up first")]
    partitions: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        fields = line.split()
        if len(fields) == 4:
            partitions.setdefault(fields[0].rstrip("*"), []).append(
                f"{fields[2]} node(s) {fields[3]}, {fields[1]}")
    result = [Check("slurm", OK, f"sinfo ok; partitions: {', '.join(sorted(partitions)) or 'none'}")]
    if partition is None:
        return result + [skipped]
    if partition not in partitions:
        return result + [Check("slurm partition", FAILED,
                               f"{partition} ({partition_from}) does not exist",
                               f"use one of: {', '.join(sorted(partitions))}")]
    return result + [Check("slurm partition", OK,
                           f"{partition} ({partition_from}): {'; '.join(partitions[partition])}")]


def check_disk(folders: dict[str, Path]) -> list[Check]:
    checks = []
    for label, folder in folders.items():
        existing = folder.resolve()
        while not existing.exists():  # a folder made on first use: measure its parent's disk
            existing = existing.parent
        free = shutil.disk_usage(existing).free / 2**30
        detail = f"{folder}: {free:.1f} GiB free"
        if free < MIN_DISK_GIB:
            checks.append(Check(f"disk {label}", FAILED, detail,
                                "free space, or point paths at a bigger disk (LABRUN_*_DIR)"))
        elif free < LOW_DISK_GIB:
            checks.append(Check(f"disk {label}", WARNING, f"{detail} (under {LOW_DISK_GIB} GiB)",
                                "free space before long runs: checkpoints add up"))
        else:
            checks.append(Check(f"disk {label}", OK, detail))
    return checks


def check_requirements() -> Check:
    """labrun's declared dependencies against what is installed, without running pip."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    try:
        declared = importlib.metadata.requires("labrun") or []
    except importlib.metadata.PackageNotFoundError:
        return Check("requirements", FAILED, "labrun is not installed in this environment",
                     "pip install -e . (in the project's .venv)")
    problems, count = [], 0
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        count += 1
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} missing")
            continue
        if not requirement.specifier.contains(Version(installed), prereleases=True):
            problems.append(f"{requirement.name} {installed} (needs {requirement.specifier})")
    if problems:
        return Check("requirements", FAILED, "; ".join(problems),
                     "pip install -e . (in the project's .venv)")
    return Check("requirements", OK, f"all {count} requirements of labrun satisfied")


# ---------------------------------------------------------------------------------------------
# What the project's config says (paths, partition)


def load_project_context(partition: str | None) -> dict:
    """Output and data folders and the SLURM partition, from conf/ when it can be composed."""
    conf = next((d for d in (Path.cwd() / "conf", PROJECT_DIR / "conf") if d.is_dir()), None)
    folders = {"outputs": Path(os.environ.get("LABRUN_OUTPUT_ROOT", "outputs")),
               "data": Path(os.environ.get("LABRUN_DATA_DIR", "data"))}
    context = {"folders": folders, "partition": partition,
               "partition_from": "--partition" if partition else "no lab cluster config"}
    if conf is None:
        return context
    try:
        cfg = compose_config(conf, lab=(conf / "cluster" / "lab.yaml").is_file())
    except Exception as error:  # noqa: BLE001 - a broken config must not stop the doctor
        context["partition_from"] = f"conf/ does not compose: {one_line(error)}"
        return context
    from omegaconf import OmegaConf

    folders["outputs"] = Path(cfg.paths.output_root)
    folders["data"] = Path(cfg.paths.data_dir)
    if partition is None:
        for key in ("cluster.partition", "hydra.launcher.partition"):
            value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
            if value:
                context["partition"], context["partition_from"] = str(value), f"lab config {key}"
                break
    return context


def compose_config(conf: Path, lab: bool):
    from hydra import compose, initialize_config_dir

    from labrun.config import schema as config

    config.register()
    with initialize_config_dir(str(conf.resolve()), version_base="1.3"):
        return compose("train", overrides=["cluster=lab"] if lab else [],
                       return_hydra_config=True)
