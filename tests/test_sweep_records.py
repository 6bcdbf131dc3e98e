"""What a sweep folder remembers between launches, tested in this process: which completed
jobs count as done (only keys that affect the result), each job's earlier attempts, and a job
that a live process still trains, which `labrun status` shows as running whatever jobs.json
says. (The launches themselves, SIGHUP'd and attached to: tests/test_sweep_terminal.py and
tests/test_cluster_slurm.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from labrun.core.scheduler import LocalScheduler
from labrun.launch.sweep import attach, completed_with_same_config
from labrun.runs.lock_holder import live_holder
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job, SweepDir
from labrun.views import status


def completed_run(run_dir: Path, cfg) -> None:
    """A run folder as a completed job leaves it: its saved config and its summary."""
    (run_dir / ".hydra").mkdir(parents=True)
    saved = OmegaConf.to_container(cfg, resolve=False)
    saved.pop("hydra", None)
    OmegaConf.save(OmegaConf.create(saved), run_dir / ".hydra" / "config.yaml")
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))


def test_only_keys_that_affect_the_result_make_a_completed_job_run_again(composed, tmp_path):
    run_dir = tmp_path / "0"
    completed_run(run_dir, composed("optimizer.lr=0.1"))
    assert completed_with_same_config(run_dir, composed("optimizer.lr=0.1"))
    # Keys whose facts say they change nothing computed: the job stays done.
    assert completed_with_same_config(run_dir, composed("optimizer.lr=0.1", "trainer.progress=bar",
                                                        "checkpoint.keep_last=1"))
    assert completed_with_same_config(run_dir, composed("optimizer.lr=0.1", "cluster=lab"))
    # A key the saved config lacks (labrun gained it since) is no difference.
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    del saved.trainer["stop_check_every_n_steps"]
    OmegaConf.save(saved, run_dir / ".hydra" / "config.yaml")
    assert completed_with_same_config(run_dir, composed("optimizer.lr=0.1"))
    # What a run computes: it runs again.
    assert not completed_with_same_config(run_dir, composed("optimizer.lr=0.2"))
    assert not completed_with_same_config(run_dir, composed("optimizer.lr=0.1", "seed=7"))


def test_a_job_submitted_again_keeps_its_earlier_attempt_and_a_completed_one_its_id(tmp_path):
    earlier = [Job(num=0, overrides=[], dir=str(tmp_path / "0"), state="failed", job_id="101",
                   log="log0", submitted_at=1.0, ended_at=2.0,
                   attempts=[{"job_id": "100", "state": "cancelled"}]),
               Job(num=1, overrides=[], dir=str(tmp_path / "1"), state="completed",
                   job_id="102", log="log1")]
    SweepDir(tmp_path).write_jobs("local", earlier)
    jobs = [Job(num=0, overrides=[], dir=str(tmp_path / "0")),
            Job(num=1, overrides=[], dir=str(tmp_path / "1"), state="skipped")]
    # 101 and 102 are no controllers' pids here (LocalScheduler asks /proc): none still runs.
    assert attach(LocalScheduler(), jobs, tmp_path) == []
    assert jobs[0].state == "pending" and jobs[0].job_id is None  # to be started again
    assert [a["job_id"] for a in jobs[0].attempts] == ["100", "101"]
    assert jobs[0].attempts[1] == {"job_id": "101", "state": "failed", "log": "log0",
                                   "submitted_at": 1.0, "ended_at": 2.0, "cancelled_at": None}
    assert (jobs[1].state, jobs[1].job_id) == ("skipped", "102")
    SweepDir(tmp_path).write_jobs("local", jobs)
    rows = json.loads((tmp_path / "jobs.json").read_text())["jobs"]
    assert [a["job_id"] for a in rows[0]["attempts"]] == ["100", "101"]


def test_a_job_whose_folder_a_live_process_holds_is_attached_and_shown_running(tmp_path):
    # The job's process outlived its launcher and its controller: jobs.json says it failed
    # (a duplicate's record, say), its controller's pid is gone, but a live process holds the
    # run folder's lock.
    run_dir = RunDir(tmp_path / "0")
    run_dir.path.mkdir()
    (run_dir.path / "summary.json").write_text(json.dumps({"status": "running"}))
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from labrun.runs import lock
held = lock.acquire({str(run_dir.lock_path)!r})
print("held", flush=True)
sys.stdin.read()
held.release()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert live_holder(run_dir.lock_path).pid == holder.pid
        SweepDir(tmp_path).write_jobs("local", [Job(num=0, overrides=[], dir=str(run_dir.path),
                                                    state="failed", job_id="999999999")])
        jobs, _ = status.sweep_jobs(tmp_path)
        assert jobs[0].state == "running"
        again = [Job(num=0, overrides=[], dir=str(run_dir.path))]
        assert attach(LocalScheduler(), again, tmp_path) == again
        assert (again[0].state, again[0].job_id, again[0].attempts) == ("running", "999999999",
                                                                        [])
    finally:
        holder.communicate("", timeout=30)
    # Released: the job has ended, its state is its record's (no summary written: failed).
    assert live_holder(run_dir.lock_path) is None
    jobs, _ = status.sweep_jobs(tmp_path)
    assert jobs[0].state == "failed"


def test_the_table_prints_overrides_and_paths_as_written_not_as_markup(tmp_path):
    from rich.console import Console

    from labrun.runs.sweepdir import print_table

    # A list override reads to rich as a closing tag: [/opt/lab] raised MarkupError after the
    # sweep had run.
    jobs = [Job(num, [f"cluster.container.mounts=[/opt/lab{num}]"], str(tmp_path / str(num)),
                state="failed", error="error: [/x] is not [bold]here", log=f"/logs/[{num}]")
            for num in range(2)]
    console = Console(width=300, record=True)
    print_table(jobs, "sweep", console=console)
    text = console.export_text()
    assert "mounts=[/opt/lab0]" in text and "mounts=[/opt/lab1]" in text
    assert "/logs/[0]" in text and "error: [/x] is not [bold]here" in text
