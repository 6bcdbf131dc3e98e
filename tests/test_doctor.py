"""`labrun doctor`: every check runs and reports ok / warning / failed with a fix."""

from __future__ import annotations

import json
import os
import subprocess

import torch

from conftest import LABRUN, PROJECT
from labrun import doctor

EXPECTED = {"python", "torch", "torchvision", "cuda", "bf16", "nccl", "turbojpeg", "jpeg regions",
            "h5py", "wandb", "slurm", "slurm partition", "disk outputs", "disk data", "requirements"}
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

    for name in ("python", "torch", "torchvision", "jpeg regions", "h5py", "requirements"):
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
