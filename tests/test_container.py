"""cluster.container (launch/container.py): the keys' facts and checks, and the command lines
labrun builds for each runtime.

Apptainer and Pyxis cannot be installed here (no package for Debian 12; Pyxis is a plug-in of
srun built against the cluster's SLURM with enroot). Their command lines are checked against
the options their documentation gives: Pyxis's as srun arguments, Apptainer's by running the
script labrun writes with an `apptainer` on PATH that prints what it was given (a stand-in for
the binary only: the script, its checks and its exec are real). Podman runs for real on the
test cluster (tests/test_cluster_lab.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from labrun.config import facts, validation
from labrun.core.environment import Environment
from labrun.core.errors import ConfigError
from labrun.launch import container

LAB = ["cluster=lab"]


def test_the_image_changes_results_though_its_section_does_not():
    assert facts.facts_of("cluster.container.image").affects_result
    assert facts.facts_of("cluster.container.mounts").path
    for dotted in ("cluster.container.runtime", "cluster.container.mounts", "cluster.partition"):
        assert not facts.facts_of(dotted).affects_result, dotted
    assert facts.facts_of("cluster.container.image").resume_safe  # the cluster section's


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.container.runtime=docker", "cluster.container.image=x"],
     "cluster.container.runtime=docker is not one of: apptainer, pyxis, podman"),
    (["cluster.container.runtime=podman"],
     "cluster.container.runtime=podman needs the image to run: set cluster.container.image"),
    (["cluster.container.runtime=podman", "cluster.container.image=lab:1",
      "cluster.container.gpu_device=/dev/nvidia0"],
     "cluster.container.gpu_device=/dev/nvidia0 names no GPU: it needs {index}"),
])
def test_container_mistakes_are_one_line(composed, overrides, message):
    with pytest.raises(ConfigError) as caught:
        validation.validate(composed(*LAB, *overrides))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_job_mounts_its_code_sweep_and_data_folders_once(composed, tmp_path):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    config = composed(*LAB, "dataset=imagefolder", "dataset.root=data/train",
                      "cluster.container.mounts=[/opt/lab,/opt/lab/cache]",
                      f"paths.scratch_dir={tmp_path}/no-scratch")  # not the machine's own
    binds = container.mounts(config.cluster, config, Path("/code/snap"), tmp_path / "sweep",
                             str(tmp_path))
    # The relative data folders from the submitting folder (paths.data_dir=data holds
    # dataset.root=data/train), /opt/lab/cache with /opt/lab; the run folders and the Optuna
    # journal are in the sweep folder; a scratch folder that does not exist is not mounted.
    assert sorted(binds) == ["/code/snap", "/opt/lab", str(data), str(tmp_path / "sweep")]


def container_config(runtime: str, image: str, gpus: bool = True):
    return OmegaConf.create({"runtime": runtime, "image": image, "mounts": [], "gpus": gpus,
                             "python": "python3", "gpu_device": "nvidia.com/gpu={index}"})


def test_pyxis_gets_its_image_mounts_and_workdir_as_srun_options():
    args = container.srun_args(container_config("pyxis", "nvcr.io#nvidia/pytorch:24.05-py3"),
                               ["/code", "/data"], "/code")
    assert args == ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
                    "--container-mounts=/code:/code,/data:/data", "--container-workdir=/code"]
    off = container_config("pyxis", "lab.sqsh", gpus=False)
    assert container.srun_args(off, ["/code"], "/code")[-1] == "--container-env=NVIDIA_VISIBLE_DEVICES"
    relay = Path("/sweep/.submitit/1/container-bin")
    assert container.setup_lines(off, relay) == [f"export LABRUN_CONTAINER_BIN={relay}",
                                                 "export LABRUN_CONTAINER_IMAGE=lab.sqsh",
                                                 "export NVIDIA_VISIBLE_DEVICES=void"]
    assert container.python_command(off, [], Path("/unused")) == "python3"


def run_script(command: str, path_dirs: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    """submitit's srun line after `srun ...`: PYTHON -u -m submitit.core._submit FOLDER."""
    env = {**os.environ, "PATH": ":".join([*map(str, path_dirs), "/usr/bin", "/bin"])}
    return subprocess.run([*shlex.split(command), "-u", "-m", "submitit.core._submit", "/f"],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def sif_header(image_id: uuid.UUID) -> bytes:
    """The start of a SIF file as Apptainer builds it (sylabs/sif pkg/sif/sif.go: the launch
    line, magic, version, architecture, then the image's ID), without the image behind it."""
    launch = b"#!/usr/bin/env run-singularity\n".ljust(32, b"\0")
    return launch + b"SIF_MAGIC\0" + b"01\0" + b"02\0" + image_id.bytes + bytes(64)


def test_apptainer_execs_the_image_with_nv_binds_and_the_task_arguments(tmp_path):
    image = tmp_path / "torch.sif"
    image_id = uuid.uuid4()
    image.write_bytes(sif_header(image_id))
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "apptainer").write_text('#!/bin/sh\necho "$LABRUN_CONTAINER_IMAGE"\n'
                                        'echo "$LABRUN_CONTAINER_DIGEST"\n'
                                        'for a in "$@"; do echo "$a"; done\n')
    (stand_in / "apptainer").chmod(0o755)
    command = container.python_command(container_config("apptainer", str(image)),
                                       ["/code", "/data"], tmp_path / "submitit")
    result = run_script(command, [stand_in], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # apptainer exec [--nv] --bind SRC[,SRC] --pwd DIR IMAGE COMMAND ARGS (apptainer exec --help)
    # The image and its ID for provenance, then apptainer's arguments.
    assert result.stdout.split("\n")[:-1] == [
        str(image), f"sif-id:{image_id}", "exec", "--nv", "--bind", "/code,/data", "--pwd",
        str(tmp_path), str(image), "python3", "-u", "-m", "submitit.core._submit", "/f"]
    # A sandbox folder has no header: the image alone, and no noise on stderr.
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    result = run_script(container.python_command(container_config("apptainer", str(sandbox)),
                                                 ["/code"], tmp_path / "submitit"),
                        [stand_in], tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.split("\n")[:2] == [str(sandbox), ""]
    # The same config writes the same script once.
    assert container.python_command(container_config("apptainer", str(image)),
                                    ["/code", "/data"], tmp_path / "submitit") == command


@pytest.mark.parametrize("missing", ["runtime", "image"])
def test_a_missing_runtime_or_image_fails_the_task_in_one_line(tmp_path, missing):
    image = tmp_path / "torch.sif"
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    if missing == "image":
        (stand_in / "apptainer").write_text("#!/bin/sh\nexit 0\n")
        (stand_in / "apptainer").chmod(0o755)
    else:
        image.write_bytes(b"SIF")
    command = container.python_command(container_config("apptainer", str(image)), ["/code"],
                                       tmp_path / "submitit")
    result = run_script(command, [stand_in], tmp_path)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    if missing == "image":
        assert result.returncode == 125 and f"cluster.container.image={image}: no such" in lines[0]
    else:
        assert result.returncode == 127
        assert "cluster.container.runtime=apptainer: apptainer is not installed" in lines[0]


def test_podman_gets_one_device_per_gres_gpu_of_the_task(tmp_path):
    # The script's device list, from SLURM's GRES indexes of this task; podman itself runs for
    # real on the test cluster. Here only the lines the script builds are checked.
    script = container.task_script(container_config("podman", "lab:1"), ["/code"])
    devices = script[script.index("devices=()"):script.index("exec podman")]
    result = subprocess.run(["bash", "-c", devices + 'printf "%s\\n" "${devices[@]}" "$visible"'],
                            capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "SLURM_STEP_GPUS": "2,3"})
    assert result.stdout.split("\n")[:-1] == ["--device", "nvidia.com/gpu=2", "--device",
                                             "nvidia.com/gpu=3", "0,1"], result.stderr
    assert "--pid=host" in script and "--pull=never" in script and "-v /code:/code" in script


def test_inside_the_image_scontrol_relays_a_requeue_to_the_host_and_refuses_the_rest(
        tmp_path, monkeypatch):
    # The relay as a task in the image runs it (the batch script's side, the real scontrol
    # requeue after srun, runs on the test cluster: tests/test_cluster_lab.py).
    relay = container.relay_folder(tmp_path / "submitit")
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "41"}
    asked = subprocess.run([str(relay / "scontrol"), "requeue", "40_3"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert asked.returncode == 0, asked.stderr
    assert (relay / "requeue-41").read_text() == "40_3\n"  # the job submitit asked for
    other = subprocess.run([str(relay / "scontrol"), "show", "job", "41"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert other.returncode == 1
    assert other.stderr.startswith("error: scontrol show job 41: SLURM's commands do not run "
                                   "inside cluster.container's image")
    assert other.stderr.count("\n") == 1
    # The job's Python, which the batch script told where the relay is, finds it first.
    monkeypatch.setenv(container.RELAY_ENV, str(relay))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    container.relay_requeues()
    assert shutil.which("scontrol") == str(relay / "scontrol")
    # After srun, the batch script requeues the job asked for, once.
    assert "\n".join(container.teardown_lines()).count("scontrol requeue") == 1


def test_a_run_without_m_goes_into_the_image_and_refuses_only_an_allocation_outside_it(
        composed):
    """Without -m a cluster run is submitted into cluster.container's image (test_cluster_lab's
    container scenario trains one): check_single_run lets it through in labrun's own job and
    where no allocation is, and refuses it only inside a person's allocation, outside any
    image, where it would train here."""
    config = composed(*LAB, "cluster.container.runtime=podman", "cluster.container.image=lab:1")
    validation.validate(config)
    assert validation.check_single_run(config, Environment()) is None  # it is submitted
    in_its_job = Environment(scheduler="slurm", job_id="7", submitted_by_labrun=True)
    assert validation.check_single_run(config, in_its_job) is None
    salloc = Environment(scheduler="slurm", job_id="7", job_tasks=1, job_gpus_on_node=1)
    with pytest.raises(ConfigError) as caught:
        validation.check_single_run(config, salloc)
    assert str(caught.value) == (
        "cluster.container.runtime=podman: inside slurm job 7 this run would train here, "
        "outside lab:1; run it outside the allocation (it is submitted into the image), or "
        "cluster.container.runtime=null to train here")
    in_the_image = Environment(scheduler="slurm", job_id="7", job_tasks=1, job_gpus_on_node=1,
                               container="podman")
    assert "training in this allocation" in validation.check_single_run(config, in_the_image)
