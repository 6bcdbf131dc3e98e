"""cluster.container.runtime=podman on the test cluster, for real: Debian 12's podman 4.3.1 with
runc (scripts/podman/containers.conf), in the image scripts/container_image.sh builds with
debootstrap (`make test` builds it before the cluster comes up), the project's Python mounted
(conftest.in_podman). What is tested is labrun's wrapping, not a CUDA stack: the GPUs are the
cluster's placeholder GRES devices. Requeueing inside the container (USR2), its liveness in the
run-folder lock and two-node DDP in containers are tests/test_cluster_lab.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import (
    FAST,
    LABRUN,
    PODMAN_CONF,
    PODMAN_IMAGE,
    PROJECT,
    PYTHON,
    SLURM_STATE,
    in_podman,
    manifest,
    read_summary,
    slurm_configured,
)

pytestmark = pytest.mark.slurm

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]


@pytest.fixture(autouse=True, scope="module")
def podman_image():
    # Never a skip: `make test` as root builds the image and starts the cluster.
    if not slurm_configured():
        pytest.fail("no SLURM cluster: `make test` as root starts one (scripts/slurm_up.sh)")
    found = subprocess.run(["podman", "image", "exists", PODMAN_IMAGE], capture_output=True,
                           env={**os.environ, "CONTAINERS_CONF": str(PODMAN_CONF)},
                           timeout=60)
    if found.returncode != 0:
        pytest.fail(f"no podman image {PODMAN_IMAGE}: scripts/container_image.sh builds it "
                    f"(`make test` runs it)")


def container_sweep(sweep_dir: Path, *overrides: str, python: str = PYTHON,
                    mounts: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """A cluster=lab sweep whose jobs run in the test image, the project's Python mounted."""
    args = [PYTHON, "train.py", "-m", "cluster=lab", "+cluster.env.OMP_NUM_THREADS=1", *FAST,
            *TINY, *in_podman(python, mounts), *overrides, f"hydra.sweep.dir={sweep_dir}"]
    # Two tiny jobs' start-up and a few steps: a minute loaded; 600 s only stops a hang.
    return subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=600)


def test_a_two_task_job_trains_in_podman_each_task_seeing_only_the_jobs_gres_gpus(tmp_path):
    # The container's python is a script that writes down what the task sees, inside, then
    # runs the project's Python: run outside the container, it would see all four devices.
    probe = tmp_path / "probe" / "python.sh"
    probe.parent.mkdir()
    seen = probe.parent / "seen.txt"
    probe.write_text("#!/bin/sh\n"
                     f"echo \"$SLURM_PROCID ${{SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}} "
                     f"$CUDA_VISIBLE_DEVICES $(ls {SLURM_STATE}/dev | tr '\\n' ' ')\" >> {seen}\n"
                     f"echo \"$LABRUN_LAB_SETTING\" >> {probe.parent / 'env.txt'}\n"
                     f"exec {PYTHON} \"$@\"\n")
    probe.chmod(0o755)
    result = container_sweep(tmp_path / "sweep", "trainer.devices=2",
                             "+cluster.env.LABRUN_LAB_SETTING=seen-inside", python=str(probe),
                             mounts=(str(probe.parent),))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = manifest(tmp_path / "sweep")["jobs"]
    assert row["state"] == "completed"
    assert read_summary(tmp_path / "sweep" / "0")["status"] == "completed"
    # Provenance names the runtime (its own mark, /run/.containerenv), the image and its digest.
    recorded = json.loads((tmp_path / "sweep" / "0" / "provenance" / "environment.json"
                           ).read_text())
    digest = subprocess.run(["podman", "image", "inspect", "--format", "{{.Digest}}",
                             PODMAN_IMAGE], capture_output=True, text=True, timeout=60,
                            check=True, env={**os.environ, "CONTAINERS_CONF": str(PODMAN_CONF)})
    assert (recorded["container"], recorded["container_image"], recorded["container_digest"]
            ) == ("podman", PODMAN_IMAGE, digest.stdout.strip())
    assert recorded["container_digest"].startswith("sha256:")
    # cluster.env, exported by the batch script on the host, is what each task sees inside.
    assert (probe.parent / "env.txt").read_text().split() == ["seen-inside"] * 2
    tasks = sorted(line.split(" ", 3) for line in seen.read_text().splitlines())
    assert [rank for rank, *_ in tasks] == ["0", "1"]
    for _, gres, visible, devices in tasks:
        indexes = gres.split(",")
        assert len(indexes) == 2  # two of the node's four GPUs: the job's GRES
        assert devices.split() == [f"nvidia{i}" for i in indexes]
        assert visible == "0,1"  # CUDA numbers the devices it sees from 0


def test_a_missing_image_fails_the_job_in_one_line_the_table_shows(tmp_path):
    result = container_sweep(tmp_path, "cluster.container.image=localhost/no-such:image")
    assert result.returncode != 0
    line = "error: cluster.container.image=localhost/no-such:image: podman on node"
    [row] = manifest(tmp_path)["jobs"]
    assert row["state"] == "failed" and line in row["error"], json.dumps(row)
    assert "has no such image; build or pull it there" in row["error"]
    # The sweep's last line (the table shows the same error, folded into its column).
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job 0 failed: SLURM state FAILED: " + line), last


def test_a_job_that_fails_before_python_shows_the_runtimes_error_in_status(tmp_path):
    """The runtime's own words (podman cannot resolve the GPU device name, so no Python ever
    starts), in `labrun status` of a detached sweep, not only "SLURM state FAILED"."""
    result = container_sweep(tmp_path, "cluster.detach=true",
                             'cluster.container.gpu_device="nvidia.com/gpu={index}"')
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    waited = subprocess.run([LABRUN, "status", "--wait", str(tmp_path)], capture_output=True,
                            text=True, timeout=300, cwd=PROJECT)
    assert waited.returncode == 1, waited.stdout + waited.stderr
    status = subprocess.run([LABRUN, "status", "--json", str(tmp_path)], capture_output=True,
                            text=True, timeout=120, cwd=PROJECT)
    [job] = json.loads(status.stdout)["jobs"]
    assert job["state"] == "failed", job
    assert job["error"] == ("SLURM state FAILED: Error: setting up CDI devices: unresolvable "
                            "CDI devices nvidia.com/gpu=0"), job


def test_an_image_with_another_labrun_version_is_refused_in_one_line(tmp_path):
    """The image's labrun must be the submitter's: here its Python finds a labrun 0.0.1
    installed ahead of the mounted one (a dist-info first on its path, as an image built with
    another wheel has), and the task stops before it reads the submission, in one line."""
    other = tmp_path / "other-labrun"
    (other / "labrun-0.0.1.dist-info").mkdir(parents=True)
    (other / "labrun-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: labrun\nVersion: 0.0.1\n")
    probe = tmp_path / "python.sh"
    probe.write_text(f"#!/bin/sh\nexport PYTHONPATH={other}:$PYTHONPATH\nexec {PYTHON} \"$@\"\n")
    probe.chmod(0o755)
    result = container_sweep(tmp_path / "sweep", python=str(probe), mounts=(str(tmp_path),))
    assert result.returncode != 0
    [row] = manifest(tmp_path / "sweep")["jobs"]
    assert row["state"] == "failed", json.dumps(row)
    assert (f"cluster.container.image={PODMAN_IMAGE} runs labrun 0.0.1, but the job was "
            f"submitted with labrun ") in row["error"], json.dumps(row)
    assert not (tmp_path / "sweep" / "0" / "summary.json").exists()  # nothing trained
