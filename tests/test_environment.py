"""core/environment.py: where a process runs, read from its variables as SLURM, torchrun and the
container runtimes set them. (The same, read inside real multi-node SLURM jobs:
tests/test_scheduler_slurm.py.)"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from labrun.core import environment, scheduler
from labrun.core.environment import Environment
from labrun.core.errors import LabrunError
from labrun.core.scheduler import SchedulerJob, slurm

# What SLURM sets in one task of `srun -N 2 -n 8` (four tasks per node), task 5: on the second
# node, its second task; element 2 of array 4240, requeued twice.
SLURM_TASK_5 = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
                "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_JOB_NODELIST": "gpu-a[07-08]", "SLURMD_NODENAME": "gpu-a08",
                "SLURM_RESTART_COUNT": "2", "SLURM_CPUS_ON_NODE": "32"}
# What salloc's shell holds (`salloc -N 2 -n 4`) where SLURM leaves it on the login host
# (no LaunchParameters=use_interactive_step): the allocation, but no step, so no
# SLURMD_NODENAME, no SLURM_PROCID and no GPUs of a node.
SALLOC_SHELL = {"SLURM_JOB_ID": "14", "SLURM_JOBID": "14", "SLURM_JOB_NODELIST": "node[2-3]",
                "SLURM_NODELIST": "node[2-3]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
                "SLURM_NTASKS": "4", "SLURM_SUBMIT_HOST": "login1", "SLURM_GPUS_PER_NODE": "2"}
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "rdzv-1"}


@pytest.fixture
def bare(tmp_path) -> Path:
    """A root with no container marks (this test machine itself may be a container)."""
    return tmp_path / "root"


def test_a_plain_process_is_rank_0_of_1_in_no_job(bare):
    assert environment.read({}, root=bare) == Environment(
        rank=0, local_rank=0, world_size=1, node_rank=None, num_nodes=1, scheduler=None,
        job_id=None, queue_id="", restart_count=0, launch_id=None, master_addr="127.0.0.1",
        master_port="20000", container=None, scheduler_variables={})


def test_one_slurm_task_is_a_job_but_not_a_rank(bare):
    env = {"SLURM_JOB_ID": "88", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node3", "SLURMD_NODENAME": "node3"}
    here = environment.read(env, root=bare)
    assert (here.rank, here.world_size, here.node_rank, here.num_nodes) == (0, 1, 0, 1)
    assert (here.scheduler, here.job_id, here.queue_id) == ("slurm", "88", "88")
    assert here.launch_id == "slurm:88:0" and here.restart_count == 0
    # The port comes from the job id: two jobs on one node never share one.
    assert (here.master_addr, here.master_port) == ("node3", str(20000 + 88))
    assert here.scheduler_variables == {"SLURM_JOB_ID": "88", "SLURM_NTASKS": "1",
                                        "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node3"}


def test_a_task_of_a_multi_node_requeued_array_job(bare, tmp_path, monkeypatch):
    # No scontrol here (most container images have none): one that fails is first on PATH,
    # and the node list is still expanded.
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    (tools / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    here = environment.read(SLURM_TASK_5, root=bare)
    assert (here.rank, here.local_rank, here.world_size) == (5, 1, 8)
    assert (here.node_rank, here.num_nodes) == (1, 2)
    assert here.master_addr == "gpu-a07"  # the first host of gpu-a[07-08]
    assert here.master_port == str(20000 + 4242)
    assert (here.job_id, here.queue_id) == ("4242", "4240_2")  # as squeue lists an element
    assert here.restart_count == 2
    # A requeued attempt is another launch: its ranks do not follow the older attempt's.
    assert here.launch_id == "slurm:4242:2"
    # Provenance records the ids and the task, nothing else of SLURM's.
    assert set(here.scheduler_variables) == {"SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID",
                                             "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST",
                                             "SLURM_PROCID", "SLURM_NTASKS"}


@pytest.mark.parametrize("env, hostname, inside", [
    # A step or batch script: slurmd names its node, whatever the host calls itself.
    ({"SLURM_JOB_NODELIST": "node[1-3]", "SLURMD_NODENAME": "node2"}, "whatever", True),
    ({"SLURM_JOB_NODELIST": "gpu-a[07-08],gpu-b1", "SLURMD_NODENAME": "gpu-b1"}, "x", True),
    # salloc's shell: no SLURMD_NODENAME; the host's short name is the node's, or is none.
    ({"SLURM_JOB_NODELIST": "node[1-3]"}, "node3", True),
    ({"SLURM_JOB_NODELIST": "node[1-3]"}, "node3.cluster.lab", True),
    ({"SLURM_JOB_NODELIST": "node[1-3]"}, "login1", False),
    ({"SLURM_JOB_NODELIST": "node[1-3]"}, "node30", False),  # expanded, not a prefix
    ({"SLURM_NODELIST": "node[1-3]"}, "login1.cluster.lab", False),  # SLURM's older name
    # A SLURMD_NODENAME that names none of its nodes (salloc run from a step of another job):
    # judged by the host's name.
    ({"SLURM_JOB_NODELIST": "node[1-3]", "SLURMD_NODENAME": "node7"}, "login1", False),
    # No nodes named (a hand-made environment: SLURM names them in every allocation): as given.
    ({"SLURM_JOB_ID": "31"}, "login1", True),
])
def test_a_host_is_in_an_allocation_when_it_is_one_of_its_nodes(env, hostname, inside):
    assert slurm.host_in_allocation({"SLURM_JOB_ID": "14", **env}, hostname) is inside


def test_salloc_s_shell_on_a_login_host_is_in_no_job_but_holds_one_elsewhere(bare,
                                                                              monkeypatch):
    """Nothing of the allocation applies to this process (no rank, node, launch, GPUs: what
    trained here would train on the login host); the allocation is named for what goes into
    it (launch/cluster_run.py: srun)."""
    monkeypatch.setattr(socket, "gethostname", lambda: "login1")
    here = environment.read(SALLOC_SHELL, root=bare)
    assert (here.scheduler, here.job_id, here.launch_id) == (None, None, None)
    assert here.scheduler_variables == {} and here.master_addr == "127.0.0.1"
    held = here.allocation_elsewhere
    assert (held.scheduler, held.job_id, held.num_nodes, held.tasks, held.nodelist) == (
        "slurm", "14", 2, 4, "node[2-3]")
    # The same variables on one of its nodes (salloc's shell there, as use_interactive_step
    # leaves it, or a step): inside the allocation, which the process is a part of.
    monkeypatch.setattr(socket, "gethostname", lambda: "node2")
    here = environment.read(SALLOC_SHELL, root=bare)
    assert (here.scheduler, here.job_id, here.allocation_elsewhere) == ("slurm", "14", None)
    assert here.launch_id == "slurm:14:0" and here.master_addr == "node2"


def test_torchrun_ranks_node_and_rendezvous(bare):
    here = environment.read(TORCHRUN, root=bare)
    assert (here.rank, here.local_rank, here.world_size) == (3, 1, 4)
    assert (here.node_rank, here.num_nodes) == (1, 2)
    assert (here.master_addr, here.master_port) == ("10.0.0.5", "29500")
    assert here.scheduler is None and here.job_id is None
    assert here.launch_id == "torchrun:rdzv-1:10.0.0.5:29500"
    assert here.rendezvous() == {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}


def test_torchrun_inside_a_slurm_job_ranks_by_torchrun_launches_by_the_job(bare):
    here = environment.read({**SLURM_TASK_5, **TORCHRUN}, root=bare)
    assert (here.rank, here.local_rank, here.world_size, here.node_rank) == (3, 1, 4, 1)
    assert here.master_addr == "10.0.0.5"  # torchrun's rendezvous, not the job's first host
    assert here.launch_id == "slurm:4242:2"


def test_empty_variables_are_no_job(bare):
    """As a run outside SLURM may inherit them (tests/test_metrics_endpoint.py sets them so)."""
    here = environment.read({"SLURM_JOB_ID": "", "SLURM_ARRAY_JOB_ID": "",
                             "SLURM_ARRAY_TASK_ID": ""}, root=bare)
    assert here.scheduler is None and here.queue_id == "" and here.launch_id is None


@pytest.mark.parametrize("marks, expected", [
    ({"files": [".dockerenv"]}, "docker"),
    ({"files": ["run/.containerenv"]}, "podman"),
    ({"env": {"APPTAINER_CONTAINER": "/images/lab.sif"}}, "apptainer"),
    ({"env": {"SINGULARITY_CONTAINER": "/images/lab.sif"}}, "singularity"),
    ({"env": {"container": "lxc"}}, "lxc"),
    ({"env": {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}}, "kubernetes"),
    ({}, None),
])
def test_the_container_runtime_is_named_by_its_mark(bare, marks, expected):
    for name in marks.get("files", []):
        (bare / name).parent.mkdir(parents=True, exist_ok=True)
        (bare / name).touch()
    assert environment.read(marks.get("env", {}), root=bare).container == expected


def test_read_afresh_each_time(monkeypatch):
    """No cache: a test's monkeypatch and distributed.setup's MASTER_PORT are seen at once."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    first = environment.read()
    assert (first.job_id, first.restart_count, first.master_port) == ("31", 1, "20031")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    second = environment.read()
    assert (second.restart_count, second.master_port) == (2, "29999")
    assert second.launch_id == "slurm:31:2"


class PbsScheduler:
    """A cluster type of a lab's own, as far as the Environment asks: whose job this is."""

    name = "pbs"

    @staticmethod
    def read_job(env):
        if not env.get("PBS_JOBID"):
            return None
        return SchedulerJob("pbs", env["PBS_JOBID"], env["PBS_JOBID"],
                            restart_count=int(env.get("PBS_RUNCOUNT", "1")) - 1,
                            recorded={"PBS_JOBID": env["PBS_JOBID"]})


def test_a_registered_scheduler_says_whose_job_a_process_is(bare, monkeypatch):
    monkeypatch.setattr(scheduler, "SCHEDULERS", dict(scheduler.SCHEDULERS))
    scheduler.register(PbsScheduler)
    here = environment.read({"PBS_JOBID": "812.pbs-server", "PBS_RUNCOUNT": "2"}, root=bare)
    assert (here.scheduler, here.job_id, here.restart_count) == ("pbs", "812.pbs-server", 1)
    assert here.launch_id == "pbs:812.pbs-server:1"
    assert here.scheduler_variables == {"PBS_JOBID": "812.pbs-server"}
    # jobs.json names a scheduler by its name and its class, for a process that has not met it.
    assert scheduler.path_of(PbsScheduler) == "test_environment.PbsScheduler"


def test_labrun_status_finds_a_scheduler_by_the_class_jobs_json_names(monkeypatch):
    monkeypatch.setattr(scheduler, "SCHEDULERS", dict(scheduler.SCHEDULERS))
    assert isinstance(scheduler.named("pbs", "test_environment.PbsScheduler"), PbsScheduler)
    assert isinstance(scheduler.named("slurm"), scheduler.SlurmScheduler)
    with pytest.raises(LabrunError, match="no scheduler named 'lsf'"):
        scheduler.named("lsf")
    with pytest.raises(LabrunError, match="cannot import mylab.lsf.LsfScheduler"):
        scheduler.named("lsf", "mylab.lsf.LsfScheduler")
