"""core/scheduler/local.py: this machine as cluster=local's scheduler. A job is a submitit
LocalExecutor job, known by its controller's pid; a pid that another process holds is no job."""

from __future__ import annotations

import os
import subprocess
import time

from labrun.core import scheduler
from labrun.core.scheduler import LocalScheduler


def test_a_local_job_runs_until_its_controller_ends(tmp_path):
    import submitit

    executor = submitit.LocalExecutor(folder=tmp_path)
    executor.update_parameters(timeout_min=1)
    # The job runs until the test lets it end (a file appears): RUNNING is seen however slow
    # the machine, not in a window of a second.
    release = tmp_path / "release"
    job = executor.submit(subprocess.run, ["sh", "-c", f"until [ -e {release} ]; do sleep 0.05; "
                                                       f"done"], check=True)
    local = LocalScheduler()
    # The controller's command line reads as its own once its exec is done, some milliseconds
    # after submit() returns; 10 s: a loaded machine.
    deadline = time.monotonic() + 10
    while not local.job_states([job.job_id]):
        assert time.monotonic() < deadline, "the job's controller never showed"
        time.sleep(0.01)
    assert local.job_states([job.job_id, str(os.getpid())]) == {job.job_id: "RUNNING"}
    assert local.job_alive(job.job_id) is True
    assert local.job_alive(str(os.getpid())) is False  # alive, but no job's controller
    release.touch()
    job.result()  # 60 s at most (timeout_min); a moment here
    # 10 s: the controller exits right after writing the result.
    deadline = time.monotonic() + 10
    while local.job_alive(job.job_id):
        assert time.monotonic() < deadline, "the job's controller did not end"
        time.sleep(0.1)
    assert local.job_states([job.job_id]) == {}


def test_this_machine_is_one_node_with_no_queue_and_no_controller():
    local = scheduler.named("local")
    limits = local.limits()
    assert set(limits.partitions) == {"local"} and limits.default_partition == "local"
    node = limits.partitions["local"]
    assert node.cpus == len(os.sched_getaffinity(0)) and node.mem_mb > 0
    assert limits.max_array_size is None and limits.qos == {}
    assert local.pending() == [] and local.fair_share() == []
    assert local.node_address()[0] is None
    assert LocalScheduler.read_job(os.environ) is None
