"""A single cluster run from a shell that holds an allocation on other hosts (salloc's shell on a
login host): launch/cluster_run.allocation_command checks what the allocation's variables tell
and makes the srun command that puts the same run on its nodes. In process, without a cluster;
the same on the test cluster, salloc and all: tests/test_cluster_run.py."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from labrun.core.errors import ConfigError
from labrun.core.scheduler import SchedulerJob
from labrun.launch import cluster_run

ARGV = ["python", "train.py", "cluster=lab", "trainer.devices=2"]


def config(run_dir, devices=2, num_nodes=1, detach=False, hydra_overrides=()):
    """The keys allocation_command reads of a composed single run's config."""
    return OmegaConf.create({
        "trainer": {"devices": devices, "num_nodes": num_nodes},
        "cluster": {"detach": detach},
        "hydra": {"run": {"dir": str(run_dir)}, "overrides": {"hydra": list(hydra_overrides)}}})


def held(num_nodes=1, tasks=2):
    """salloc's allocation, seen from its shell on the login host."""
    return SchedulerJob("slurm", "14", "14", num_nodes=num_nodes, tasks=tasks,
                        on_job_node=False, nodelist="node[2-3]" if num_nodes > 1 else "node2")


@pytest.fixture(autouse=True)
def no_cpus_per_task(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)


def test_the_run_goes_into_the_allocation_in_its_own_shape_and_folder(tmp_path, monkeypatch):
    """One task per GPU of trainer.devices on each node, the allocation's CPUs per task, this
    interpreter, and the folder this command named (the step's clock would name another)."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    command = cluster_run.allocation_command(config(tmp_path / "run", devices=2, num_nodes=2),
                                             held(num_nodes=2, tasks=4), ARGV)
    assert command == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                       "--cpus-per-task=8", sys.executable, "train.py", "cluster=lab",
                       "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"]
    # A folder the person named is theirs, as they wrote it; salloc without -n tells no tasks.
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    named = cluster_run.allocation_command(
        config("runs/a b", devices=1, hydra_overrides=["hydra.run.dir=runs/a b"]),
        held(tasks=None), [*ARGV[:3], "hydra.run.dir='runs/a b'"])
    assert named == ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                     sys.executable, "train.py", "cluster=lab", "hydra.run.dir='runs/a b'"]


@pytest.mark.parametrize("asked, allocation, line", [
    ({"num_nodes": 2, "devices": 1}, {"num_nodes": 1, "tasks": 2},
     "slurm job 14, the allocation this shell holds on node2, has 1 node(s): "
     "trainer.num_nodes=2; ask salloc for --nodes=2, or leave the allocation to submit a job"),
    ({"devices": 4}, {"tasks": 2},
     "slurm job 14, the allocation this shell holds on node2, has 2 task(s): trainer.devices=4 "
     "x trainer.num_nodes=1 needs 4; ask salloc for --ntasks=4, or lower trainer.devices"),
    ({"detach": True}, {},
     "cluster.detach=true: slurm job 14, the allocation this shell holds on node2, takes the "
     "run with srun, which does not detach; leave the allocation to submit a detached job, or "
     "drop cluster.detach"),
])
def test_what_the_allocation_cannot_run_is_one_line_before_srun(tmp_path, asked, allocation,
                                                                 line):
    with pytest.raises(ConfigError) as refused:
        cluster_run.allocation_command(config(tmp_path, **asked), held(**allocation), ARGV)
    assert str(refused.value) == line


def test_an_allocation_with_fewer_gpus_a_node_than_trainer_devices_is_refused(tmp_path):
    """The GPUs the scheduler says the allocation holds (all nodes together) are counted a node
    before srun: 2 GPUs on 2 nodes are 1 a node, too few for trainer.devices=2; 4 are enough.
    None (a run that asks no GPUs) is not counted."""
    two_nodes = config(tmp_path, devices=2, num_nodes=2)
    with pytest.raises(ConfigError) as refused:
        cluster_run.allocation_command(two_nodes, held(num_nodes=2, tasks=4), ARGV, gpus=2)
    assert str(refused.value) == (
        "slurm job 14, the allocation this shell holds on node[2-3], has 1 GPU(s) a node: "
        "trainer.devices=2 needs 2; ask salloc for --gpus-per-node=2, or lower "
        "trainer.devices")
    for gpus in (4, None):
        assert cluster_run.allocation_command(two_nodes, held(num_nodes=2, tasks=4), ARGV,
                                              gpus=gpus)[0] == "srun"
