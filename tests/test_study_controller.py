"""A detached Optuna study's controller (`hparams_search=optuna cluster.detach=true`: one
SLURM job that runs the study) is checked before anything is made or submitted, as a sweep's
jobs are: the ranges of cluster.controller's keys, its partition, resources and QOS, and the
request of the trials it will submit. In this process against a cluster's limits given here;
then the real command on the test cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_cluster_slurm import cluster_is_up

from conftest import FAST, PROJECT, PYTHON
from labrun.core.errors import ConfigError
from labrun.core.scheduler import ClusterLimits, NodeLimits, QosLimits
from labrun.launch import SLURM_COMMENT_PREFIX, slurm, slurm_limits

# The test cluster's, as SlurmScheduler().limits() reads them (test_scheduler_slurm.py), with
# a submit limit on the urgent QOS.
LIMITS = ClusterLimits(partitions={"gpu": NodeLimits(32, 196608, 4),
                                   "dev": NodeLimits(32, 196608, 4)},
                       default_partition="gpu", max_array_size=1001,
                       qos={"normal": QosLimits(), "urgent": QosLimits(max_submit_per_user=3)})


@pytest.fixture
def queued(monkeypatch):
    """The jobs squeue would count towards a QOS's limit: 3, whoever asks."""
    monkeypatch.setattr(slurm_limits.SlurmScheduler, "queued", lambda self, **query: 3)


@pytest.mark.parametrize("override, message", [
    ("cluster.controller.partition=cpu",
     "cluster.controller.partition=cpu does not exist; partitions: dev, gpu"),
    ("cluster.controller.cpus_per_task=64",
     "cluster.controller.cpus_per_task=64 CPUs: partition dev offers at most 32 CPUs, 192 GB "
     "and 4 GPUs per node"),
    ("cluster.controller.mem_gb=500", "cluster.controller.mem_gb=500: partition dev offers"),
    ("cluster.controller.qos=urgnet",
     "cluster.controller.qos=urgnet does not exist; QOS: normal, urgent, or null for the "
     "default one"),
    ("cluster.controller.qos=urgent",
     "QOS urgent allows 3 queued jobs per user (MaxSubmitJobsPerUser); 3 are queued and this "
     "sweep would add 1"),
], ids=["partition", "cpus", "memory", "unknown qos", "qos submit limit"])
def test_a_controller_slurm_would_refuse_or_never_run_is_one_line(composed, queued, override,
                                                                   message):
    cluster = composed("cluster=slurm_dev", override).cluster
    with pytest.raises(ConfigError) as refused:
        slurm_limits.check_controller(cluster, LIMITS)
    assert str(refused.value).startswith(message), refused.value
    assert "\n" not in str(refused.value)


def test_a_controller_the_cluster_can_run_passes(composed, queued):
    cluster = composed("cluster=slurm_dev", "cluster.controller.partition=null",
                       "cluster.controller.cpus_per_task=32", "cluster.controller.mem_gb=192",
                       "cluster.controller.qos=normal").cluster
    slurm_limits.check_controller(cluster, LIMITS)  # the default partition, filled to its size


def launcher(config) -> slurm.SlurmLauncher:
    launcher = slurm.SlurmLauncher()
    launcher.config = config
    return launcher


@pytest.mark.parametrize("override, message", [
    ("cluster.controller.mem_gb=-4", "cluster.controller.mem_gb=-4 must be greater than 0"),
    ("cluster.controller.cpus_per_task=0", "cluster.controller.cpus_per_task=0 must be 1 or"),
    ("cluster.controller.timeout_min=0", "cluster.controller.timeout_min=0 must be 1 or more"),
])
def test_the_controllers_ranges_are_checked_before_slurm_is_asked(composed, monkeypatch,
                                                                  override, message):
    monkeypatch.setattr(slurm, "cluster_limits", lambda: pytest.fail("SLURM was asked"))
    with pytest.raises(ConfigError, match=message):
        launcher(composed("cluster=slurm_dev", override)).check_controller()


def test_the_launcher_checks_the_controller_and_the_trials_it_will_submit(composed, queued,
                                                                          monkeypatch):
    monkeypatch.setattr(slurm, "cluster_limits", lambda: LIMITS)
    launcher(composed("cluster=slurm_dev")).check_controller()
    with pytest.raises(ConfigError, match="cluster.controller.partition=cpu does not exist"):
        launcher(composed("cluster=slurm_dev", "cluster.controller.partition=cpu")
                 ).check_controller()
    # The trials: submitted later by the controller, far from any terminal.
    with pytest.raises(ConfigError, match=r"^cluster.cpus_per_task x tasks_per_node = 64 CPUs"):
        launcher(composed("cluster=slurm_dev", "cluster.cpus_per_task=64")).check_controller()


def jobs_of(sweep_dir: Path) -> list[str]:
    """The ids of the queued jobs whose comment names `sweep_dir` (launch/slurm.py marks every
    job of a sweep, its controller too, so)."""
    rows = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.splitlines()
    return [row.split()[0] for row in rows
            if row.partition(" ")[2] == f"{SLURM_COMMENT_PREFIX}{sweep_dir.resolve()}"]


@pytest.mark.slurm
@pytest.mark.parametrize("override, message", [
    ("cluster.controller.mem_gb=-4", "error: cluster.controller.mem_gb=-4 must be greater "
                                     "than 0, or null for the partition's default"),
    ("cluster.controller.cpus_per_task=64", "error: cluster.controller.cpus_per_task=64 CPUs: "
                                            "partition dev offers at most 32 CPUs"),
], ids=["range", "resources"])
def test_a_detached_study_with_a_bad_controller_submits_nothing(tmp_path, override, message):
    # Never a skip (test_cluster_slurm.slurm, which is autouse there, would fail this file's
    # other tests too): LABRUN_NO_SLURM=1 deselects it before it runs.
    assert cluster_is_up(), "no SLURM cluster: LABRUN_NO_SLURM=1 runs the suite without it"
    sweep_dir = tmp_path / "study"
    # Held: were the controller submitted after all, it would wait, not run, until cancelled.
    result = subprocess.run(
        [PYTHON, "train.py", "-m", "hparams_search=optuna", "cluster=slurm_dev",
         "cluster.detach=true", override, "+cluster.extra_sbatch.hold=true", *FAST,
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=PROJECT, capture_output=True, text=True, timeout=120)
    submitted = jobs_of(sweep_dir)
    if submitted:
        subprocess.run(["scancel", *submitted], timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(message), line
    assert submitted == []
    assert not sweep_dir.exists()  # no jobs.json, study journal nor code snapshot
