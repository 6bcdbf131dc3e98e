"""How a sweep on SLURM waits for its jobs (launch/sweep.py: wait_any naps between two questions
to the scheduler, POLL_S growing to POLL_MAX_S). During a nap it looks for each job's own sign
that it has ended, the result file submitit writes when the job's call returns, and wakes to
ask SLURM at once instead of up to POLL_MAX_S later.

A fake clock stands in for time.sleep and time.monotonic (the naps would otherwise be real
seconds, and no test asserts on a clock); the result files are real files, written where
submitit writes them for the job, when the fake clock reaches their time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from submitit.core.utils import cloudpickle_dump

from labrun.launch.slurm import SlurmLauncher
from labrun.runs.sweepdir import Job, submitit_result_path


class FakeClock:
    """time.monotonic and time.sleep of this test: a sleep moves the clock and does, at their
    time, what is due (a job's result written)."""

    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        self.due: list[tuple[float, Path]] = []
        monkeypatch.setattr(time, "monotonic", lambda: self.now)
        monkeypatch.setattr(time, "sleep", self.sleep)

    def result_at(self, at: float, job: Job) -> None:
        self.due.append((at, submitit_result_path(job)))

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for at, path in [item for item in self.due if item[0] <= self.now]:
            path.parent.mkdir(parents=True, exist_ok=True)
            cloudpickle_dump(("success", 0.5), path)  # what submitit writes when a call returns
            self.due.remove((at, path))


def jobs(tmp_path: Path, count: int) -> list[Job]:
    return [Job(num=num, overrides=[], dir=str(tmp_path / str(num)), state="running",
                job_id=f"100_{num}", submitit_dir=str(tmp_path / ".submitit" / f"100_{num}"))
            for num in range(count)]


def test_a_nap_ends_when_a_jobs_result_is_written_and_not_again_for_it(tmp_path, monkeypatch):
    clock, launcher, [job] = FakeClock(monkeypatch), SlurmLauncher(), jobs(tmp_path, 1)
    clock.result_at(3.2, job)
    assert launcher.nap([job], SlurmLauncher.POLL_MAX_S) is True
    # Woken at the first look after the write, not at the nap's end.
    assert clock.now == pytest.approx(3.5)
    # The same sign does not wake the next nap (SLURM is then asked every POLL_S, not every
    # look, until it too says the job has ended).
    assert launcher.nap([job], SlurmLauncher.POLL_S) is False
    assert clock.now == pytest.approx(3.5 + SlurmLauncher.POLL_S)


def test_a_nap_without_a_result_sleeps_its_whole_time(tmp_path, monkeypatch):
    clock, launcher = FakeClock(monkeypatch), SlurmLauncher()
    assert launcher.nap(jobs(tmp_path, 3), SlurmLauncher.POLL_MAX_S) is False
    assert clock.now == pytest.approx(SlurmLauncher.POLL_MAX_S)


def test_a_large_sweep_is_looked_at_a_few_jobs_at_a_time_and_each_in_turn(tmp_path,
                                                                           monkeypatch):
    """80 jobs: GLANCE_JOBS (32) a look, so the last job's sign is seen at the third look."""
    clock, launcher, many = FakeClock(monkeypatch), SlurmLauncher(), jobs(tmp_path, 80)
    looked: list[int] = []
    ended_soon = launcher.ended_soon
    monkeypatch.setattr(launcher, "ended_soon",
                        lambda job: looked.append(job.num) or ended_soon(job))
    clock.result_at(0.1, many[-1])
    assert launcher.nap(many, SlurmLauncher.POLL_MAX_S) is True
    assert clock.now == pytest.approx(3 * SlurmLauncher.GLANCE_S)
    assert looked == list(range(80))  # 0-31, 32-63, 64-79: each job once
