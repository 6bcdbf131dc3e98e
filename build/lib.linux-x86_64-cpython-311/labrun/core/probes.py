"""What this machine offers, asked in one place each: how to ask SLURM (its slurm.conf, its
commands' rows), the GPU driver and the W&B login. The SLURM scheduler
(core/scheduler/slurm.py), `labrun doctor`, provenance and the W&B logger all ask through
here, so they agree on the answer and on how it is asked.

Nothing here contacts a server other than the SLURM controller, and that only where this
machine has a slurm.conf (see `slurm_conf`).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from labrun.core.errors import LabrunError, one_line

# ---------------------------------------------------------------------------------------------
# SLURM

# Where a SLURM client finds its config: $SLURM_CONF, the packaged default, or the cache slurmd
# keeps on a node of a configless cluster.
SLURM_CONF_PLACES = ("/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf")

# The clients wait out SLURM's own 10 s message timeout once or twice when the controller is
# slow; past 30 s it is down.
SLURM_TIMEOUT_S = 30


class SlurmError(LabrunError):
    """A SLURM command could not answer. `kind`: "missing" (not installed), "unconfigured" (no
    slurm.conf), "timeout" or "failed"; callers add their own fix to the message."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def slurm_conf_places() -> tuple[str, ...]:
    """Where the SLURM commands look for slurm.conf: $SLURM_CONF alone when it is set."""
    return (os.environ["SLURM_CONF"],) if os.environ.get("SLURM_CONF") else SLURM_CONF_PLACES


def slurm_conf() -> Path | None:
    """The slurm.conf the SLURM commands would read, or None. Without one they look the
    controller up in DNS (configless mode), which can hang for long on a machine that is no
    SLURM client at all: then labrun does not ask."""
    return next((Path(p) for p in slurm_conf_places() if Path(p).is_file()), None)


def is_slurm_client() -> bool:
    """Whether the SLURM commands may be asked here: a slurm.conf, or a configless cluster
    whose clients find the controller through DNS alone, which says so."""
    return slurm_conf() is not None or os.environ.get("LABRUN_SLURM_CONFIGLESS") == "1"


def require_slurm_client(command: str = "squeue") -> None:
    """SlurmError ("missing" or "unconfigured") where `command` cannot be asked here at all;
    asks the controller nothing."""
    if shutil.which(command) is None:
        raise SlurmError(f"{command} not found: this machine is not a SLURM submit host",
                         "missing")
    if not is_slurm_client():
        raise SlurmError(f"no slurm.conf ($SLURM_CONF or {SLURM_CONF_PLACES[0]}): this machine "
                         f"is not set up as a SLURM client (a configless cluster found through "
                         f"DNS: set LABRUN_SLURM_CONFIGLESS=1)", "unconfigured")


def slurm_rows(*args: str, timeout: float = SLURM_TIMEOUT_S) -> list[list[str]]:
    """The rows of a SLURM command's `|`-separated, header-less output."""
    command = args[0]
    require_slurm_client(command)
    try:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{command} timed out after {timeout:.0f} s", "timeout") from None
    if out.returncode != 0:
        why = (out.stderr or out.stdout).strip() or f"exit code {out.returncode}"
        raise SlurmError(f"{command} failed: {why}", "failed")
    return [[cell.strip() for cell in line.split("|")]
            for line in out.stdout.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# GPUs


@functools.cache
def gpu_driver_version() -> str | None:
    """The NVIDIA driver's version (e.g. 550.54.15), or None where there is none.

    torch knows the CUDA runtime but not the driver's version. NVML (the `pynvml` module of
    nvidia-ml-py) answers in-process where it is installed; labrun does not require it, so
    without it `nvidia-smi` is asked, once per process (it takes ~100 ms and the answer does
    not change while labrun runs)."""
    try:
        import pynvml
    except ImportError:
        return _nvidia_smi_driver()
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def cuda_driver_version() -> tuple[int, int] | None:
    """The newest CUDA the NVIDIA driver runs, as (major, minor): NVML's
    nvmlSystemGetCudaDriverVersion (12040 -> (12, 4)); None without NVML or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version // 1000, version % 1000 // 10


@dataclass(frozen=True)
class CudaFit:
    """Whether torch's CUDA build runs on this node's driver: "fits", "minor" (a newer minor
    version of the same major: it runs through CUDA's minor-version compatibility, but
    kernels built from PTX and features of the newer minor need a newer driver) or "too new"
    (the driver cannot run it: torch sees no GPU)."""

    verdict: str
    line: str
    fix: str = ""


def torch_cuda_fit(torch_version: str, torch_cuda: str | None) -> CudaFit | None:
    """torch's CUDA build (torch.version.cuda) against the driver's newest CUDA; None when
    there is nothing to compare (a CPU build of torch, or no driver here)."""
    driver = cuda_driver_version()
    if torch_cuda is None or driver is None:
        return None
    built = tuple(int(part) for part in torch_cuda.split(".")[:2])
    runs = f"{driver[0]}.{driver[1]}"
    line = (f"torch {torch_version} is built for CUDA {torch_cuda}; this node's NVIDIA driver "
            f"{gpu_driver_version() or '(version unknown)'} runs CUDA up to {runs}")
    fix = (f"install a torch built for CUDA {runs} or older (pip install torch --index-url "
           f"https://download.pytorch.org/whl/cuXY, XY <= {driver[0]}{driver[1]}), or run in "
           f"a container image whose CUDA is {runs} or older (cluster.container.image), or "
           f"update the node's driver")
    if built[0] > driver[0]:
        return CudaFit("too new", line, fix)
    if built[0] == driver[0] and built[1] > driver[1]:
        return CudaFit("minor", f"{line}: it runs through CUDA's minor-version "
                                f"compatibility, without the features of CUDA {torch_cuda}",
                       fix)
    return CudaFit("fits", line)


def gpu_count() -> int:
    """The NVIDIA GPUs this process may use, without torch: CUDA_VISIBLE_DEVICES's entries
    where it is set, else NVML's count (0 without NVML or a driver)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return len([d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver
        return 0


def _nvidia_smi_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


# ---------------------------------------------------------------------------------------------
# Weights & Biases


def wandb_host() -> str:
    """The W&B server's host name, as ~/.netrc names it."""
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return url.split("://")[-1].split("/")[0].split(":")[0]


@dataclass(frozen=True)
class WandbLogin:
    """Where a W&B API key would come from. Read from the environment and ~/.netrc (where
    `wandb login` puts it) only: the key is never verified, shown or kept here."""

    host: str
    source: str | None  # "WANDB_API_KEY" or the netrc file holding a key for host; None: no key
    netrc: Path  # the netrc file looked at
    error: str | None = None  # that file exists but cannot be read

    @property
    def logged_in(self) -> bool:
        return self.source is not None


def wandb_login() -> WandbLogin:
    import netrc

    host = wandb_host()
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if os.environ.get("WANDB_API_KEY"):
        return WandbLogin(host, "WANDB_API_KEY", path)
    if not path.is_file():
        return WandbLogin(host, None, path)
    try:
        found = netrc.netrc(path).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError) as error:
        return WandbLogin(host, None, path, one_line(error))
    return WandbLogin(host, str(path) if found else None, path)


# ---------------------------------------------------------------------------------------------
# Ports


def check_port(host: str, port: int, fix: str) -> None:
    """Fail in one line, before anything starts, when `host:port` is taken or invalid (`fix`:
    the command's own flags for another one)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            probe.bind((host, port))
    except OSError as error:
        raise LabrunError(f"cannot listen on {host}:{port} ({error.strerror or error}); "
                          f"{fix}") from None
