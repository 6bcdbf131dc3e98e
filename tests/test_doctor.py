"""`labrun doctor`: every check runs and reports ok / warning / failed with a fix; the driver
check (torch's CUDA build against the node's driver), in doctor and at a GPU job's start."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import LABRUN, PROJECT, PYTHON, nvml_stand_in
from labrun import doctor
from labrun.core import probes
from labrun.core.errors import ConfigError
from labrun.doctor import gpu
from labrun.train import distributed

EXPECTED = {"python", "torch", "torchvision", "cuda", "bf16", "nccl", "turbojpeg", "jpeg regions",
            "mask rows", "h5py", "wandb", "slurm", "slurm partition", "disk outputs", "disk data", "requirements"}
SECRET = "wandb-key-that-must-never-be-printed-0123456789"


def test_doctor_json_has_every_check_and_never_prints_the_key():
    env = {**os.environ, "WANDB_API_KEY": SECRET}
    env.pop("WANDB_MODE", None)
    # doctor imports torch and asks git, SLURM and the disks: seconds; 120 s: a hung check.
    result = subprocess.run([LABRUN, "doctor", "--json", "--partition", "no-such-partition"],
                            capture_output=True, text=True, timeout=120, cwd=PROJECT, env=env)
    checks = json.loads(result.stdout)
    by_name = {c["check"]: c for c in checks}
    assert EXPECTED <= set(by_name), sorted(by_name)
    assert any(name == "gpu" or name.startswith("gpu ") for name in by_name)
    for c in checks:
        assert c["status"] in ("ok", "warning", "failed") and c["detail"], c
        assert c["status"] == "ok" or c["fix"], f"{c['check']} has no fix line"
    assert SECRET not in result.stdout + result.stderr
    # A key in the environment was never checked against the server: doctor must not call it
    # "logged in" (it did before).
    assert by_name["wandb"]["detail"] == "key set (WANDB_API_KEY), not verified"
    assert "logged in" not in by_name["wandb"]["detail"]

    # The partition asked for does not exist (or SLURM cannot be asked): a failure, exit 1.
    assert by_name["slurm partition"]["status"] == "failed"
    assert result.returncode == 1

    for name in ("python", "torch", "torchvision", "jpeg regions", "mask rows", "h5py",
                 "requirements"):
        assert by_name[name]["status"] == "ok", by_name[name]
    if not torch.cuda.is_available():  # this CPU machine: warnings, never failures
        for name in ("cuda", "gpu", "bf16", "nccl"):
            assert by_name[name]["status"] == "warning" and "no GPU" in by_name[name]["detail"]
    else:  # a GPU machine (benchmarks/gpu_check.sh): the GPU checks pass
        for name in ("cuda", "gpu", "bf16"):
            assert by_name[name]["status"] == "ok", by_name[name]


def test_table_lists_checks_with_their_fixes(capsys):
    doctor.print_table([doctor.Check("torch", "ok", "2.x"),
                        doctor.Check("gpu", "warning", "no GPU", "check nvidia-smi")])
    out = capsys.readouterr().out
    assert "torch" in out and "no GPU" in out and "check nvidia-smi" in out
    assert "1 ok, 1 warnings, 0 failed" in out


def test_two_process_all_reduce_runs_on_the_cpu_with_gloo():
    """The orchestration behind the NCCL check (spawn, rendezvous, exit codes), on gloo."""
    # Two spawned processes import torch and meet: seconds, several times that on a loaded
    # machine; 60 s bounds a rendezvous that never happens.
    assert doctor.two_process_all_reduce(backend="gloo", timeout_s=60) is None


# -- the driver check: NVML's answers stood in at the library boundary (no GPU here) -----------


class FakeNVML:
    """pynvml as a node with a driver answers it: `cuda` is nvmlSystemGetCudaDriverVersion's
    number (12040: CUDA 12.4), None for a node without a driver (nvmlInit fails)."""

    def __init__(self, monkeypatch, cuda: int | None, driver: str = "550.54.15", gpus: int = 4):
        import pynvml

        def init():
            if cuda is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

        monkeypatch.setattr(pynvml, "nvmlInit", init)
        monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: cuda)
        monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: driver)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: gpus)
        probes.gpu_driver_version.cache_clear()  # asked once a process; this "node" is new


@pytest.fixture(autouse=True)
def forget_the_fake_driver():
    yield
    probes.gpu_driver_version.cache_clear()  # the next test asks the real machine again


@pytest.mark.parametrize("cuda, torch_cuda, verdict", [
    (12040, "12.1", "fits"),  # an older minor: fits
    (13000, "12.8", "fits"),  # an older major: the driver runs it
    (12020, "12.8", "minor"),  # a newer minor: minor-version compatibility
    (12020, "13.0", "too new"),  # a newer major: torch sees no GPU
])
def test_torch_cuda_fit_compares_the_build_with_the_drivers_newest_cuda(
        monkeypatch, cuda, torch_cuda, verdict):
    FakeNVML(monkeypatch, cuda)
    fit = probes.torch_cuda_fit("2.14.1", torch_cuda)
    assert fit.verdict == verdict
    assert f"CUDA {torch_cuda}" in fit.line and "driver 550.54.15" in fit.line
    assert f"runs CUDA up to {cuda // 1000}.{cuda % 1000 // 10}" in fit.line
    assert (fit.fix == "") == (verdict == "fits")


def test_nothing_to_fit_without_a_driver_or_with_a_cpu_build(monkeypatch):
    FakeNVML(monkeypatch, None)
    assert probes.torch_cuda_fit("2.14.1", "12.8") is None
    FakeNVML(monkeypatch, 12040)
    assert probes.torch_cuda_fit("2.14.1+cpu", None) is None


def test_doctor_fails_a_torch_the_driver_cannot_run_naming_both_and_the_fix(monkeypatch):
    FakeNVML(monkeypatch, 12020, driver="535.104.05")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    check = gpu.check_cuda()
    assert check.status == "failed"
    assert check.detail.startswith(f"torch {torch.__version__} is built for CUDA 13.0; this "
                                   f"node's NVIDIA driver 535.104.05 runs CUDA up to 12.2")
    assert "torch built for CUDA 12.2 or older" in check.fix and "container image" in check.fix
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert gpu.check_cuda().status == "warning"


@pytest.mark.parametrize("accelerator", ["auto", "cuda"])
def test_a_gpu_job_refuses_a_torch_the_driver_cannot_run_before_loading_data(
        monkeypatch, accelerator):
    FakeNVML(monkeypatch, 12020)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    # distributed.setup picks the device first thing, before job.py builds the dataset.
    with pytest.raises(ConfigError, match=r"built for CUDA 13\.0; .* runs CUDA up to 12\.2: "
                                          r"torch cannot use this node's GPUs; install"):
        distributed.pick_device(accelerator, 0)
    # A run asked onto the CPU is not the driver's business.
    assert distributed.pick_device("cpu", 0).type == "cpu"


def test_a_run_on_a_node_whose_driver_is_too_old_refuses_before_its_data_loads(tmp_path):
    """The whole of `python train.py` on such a node: one line naming both versions and the
    fix, exit 2. The dataset is a file that is not HDF5, so a run that loaded its data first
    would fail on that instead, naming the file. NVML answers as such a node's would (no GPU
    here): its driver runs CUDA up to 12.2; torch's build here is CUDA 13.0."""
    assert torch.version.cuda is not None and int(torch.version.cuda.split(".")[0]) > 12
    env = nvml_stand_in(tmp_path, gpus=1, cuda_driver=12020, driver="535.104.05")
    not_hdf5 = tmp_path / "data.h5"
    not_hdf5.write_bytes(b"not an HDF5 file")
    result = subprocess.run(
        [PYTHON, "train.py", "logger=csv",
         "dataset=hdf5", f"dataset.path={not_hdf5}", "trainer.accelerator=auto",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=PROJECT, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}; this node's "
            "NVIDIA driver 535.104.05 runs CUDA up to 12.2: torch cannot use this node's "
            "GPUs; install a torch built for CUDA 12.2 or older") in lines[0], lines
    assert str(not_hdf5) not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
