"""`labrun status` on a sweep folder or a run folder: per job images/s, data-wait fraction, GPU
utilisation when measured, and a verdict with its fix, from the run's own thresholds.

The real runs (one local sweep of two tiny jobs, shared by the module): synthetic data made in
the loader (healthy), and the same data behind a lab's dataset plug-in whose samples sleep
0.4 s each (data-bound). No GPU is here, so `perf/gpu_util` never appears in a real run's
metrics.jsonl: the GPU-idle verdict, the choice of points and the thresholds are checked
in-process on run folders written by hand, in the format RunDir writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import FAST, LABRUN, PROJECT, PYTHON, read_metrics, read_summary

# A lab's dataset format (docs/plugins.md): the synthetic set with every sample 0.4 s slow to
# load, as a slow disk or decoder would make it. The jobs load in the training process
# (dataset.num_workers=0, FAST's): a batch of 4 then adds 1.6 s of waiting to each step, and the
# job stays data-bound (over 30% waiting) until a step's compute takes 3.7 s. With a worker,
# loading overlaps the compute, and what is left of the wait depends on how slow the compute
# is: a training step of 4 images took 1.2 s with this 2-core machine loaded 11 deep by other
# test runs, and a job with one worker and the same 1.6 s per batch waited only 31%.
SLOW_DATA = textwrap.dedent('''
    import time

    from labrun.data.image import synthetic

    SLEEP_S = 0.4


    class SlowSource:
        def __init__(self, source):
            self.source, self.name = source, source.name
            self.labels, self.class_names = source.labels, source.class_names

        def __len__(self):
            return len(self.source)

        def load(self, index, min_size=None):
            time.sleep(SLEEP_S)
            return self.source.load(index, min_size)

        open = load

        def describe(self, index):
            return self.source.describe(index)


    def load(image_size, num_classes, num_train, num_val, num_test=0):
        splits = synthetic.load(image_size, num_classes, num_train, num_val, num_test)
        return {split: SlowSource(source) for split, source in splits.items()}
''')

# Two jobs: the synthetic set as shipped, and the slow one; the same keys otherwise. Five steps
# logged every two and at the epoch's end: points at steps 2, 4 and 5, the first (the loader
# starting up) left out of the figures.
# max_parallel is 1 without GPUs: the jobs run one after the other, not against each other.
JOBS = ["dataset=synthetic", "dataset._target_=labrun.data.image.synthetic.load,slowdata.load",
        "trainer.batch_size=4", "trainer.max_epochs=1",
        "trainer.limit_train_batches=5", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=2"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    lab = tmp_path_factory.mktemp("lab")
    (lab / "slowdata.py").write_text(SLOW_DATA)
    sweep = tmp_path_factory.mktemp("sweep")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lab), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    # Two tiny jobs, each well under a minute on a loaded 2-core machine; 600 s: a hang fails.
    result = subprocess.run([PYTHON, "train.py", "-m", *FAST, *JOBS,
                             f"hydra.sweep.dir={sweep}"], cwd=PROJECT, capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sweep


def labrun_status(capsys, *args: str) -> str:
    """`labrun status ...`'s output, through the CLI's code in this process (a new interpreter
    costs ~2 s of imports; the one-line error path runs the real command below)."""
    from labrun import cli

    assert cli.main(["status", *map(str, args)]) == 0
    return capsys.readouterr().out


def status_json(capsys, path: Path) -> dict:
    return json.loads(labrun_status(capsys, path, "--json"))


def test_a_sweep_shows_each_jobs_figures_and_verdict(sweep_dir, capsys):
    shown = labrun_status(capsys, sweep_dir)
    assert "img/s" in shown and "data wait" in shown
    assert "healthy" in shown and "data-bound" in shown
    # The fix names the run's own number of workers.
    fixes = [line for line in shown.splitlines() if line.startswith("job ")]
    assert len(fixes) == 1, shown
    assert fixes[0].startswith("job 1: data-bound: waits ")
    assert fixes[0].endswith("% of the time for data; raise dataset.num_workers (now 0: the "
                             "training process loads every batch itself)")
    assert shown.count("completed") == 2  # the states, as before
    assert "did not complete" not in shown

    view = status_json(capsys, sweep_dir)
    assert (view["kind"], view["backend"]) == ("sweep", "local")
    healthy, slow = view["jobs"]
    assert [job["state"] for job in view["jobs"]] == ["completed", "completed"]
    for job in view["jobs"]:
        summary = read_summary(Path(job["run_dir"]))
        assert job["metric"] == summary["best/val/acc"] and job["monitor"] == "val/acc"
        # No GPU here: not measured is null, not zero.
        assert job["gpu_util"] is None and job["rate"] > 0 and job["unit"] == "img/s"
        # Two of the three train points: the epoch's first window is left out.
        assert job["points"] == 2
        assert job["thresholds"] == {"data_bound_wait_frac": 0.3, "gpu_idle_util": 0.3,
                                     "gpu_good_util": 0.7}
    assert healthy["verdict"] == "healthy" and healthy["fix"] is None
    assert healthy["data_wait_frac"] < 0.3
    assert slow["verdict"] == "data-bound" and slow["data_wait_frac"] > 0.3
    assert slow["reason"] == f"waits {slow['data_wait_frac']:.0%} of the time for data"
    assert slow["fix"] == ("raise dataset.num_workers (now 0: the training process loads every "
                           "batch itself)")
    # The figures are the points' own: a duration-weighted mean lies between them.
    points = [row for row in read_metrics(Path(slow["run_dir"])) if "perf/data_wait_frac" in row]
    waits = [row["perf/data_wait_frac"] for row in points[1:]]
    assert min(waits) <= slow["data_wait_frac"] <= max(waits)


def test_a_run_folder_alone(sweep_dir, capsys):
    shown = labrun_status(capsys, sweep_dir / "1")
    assert f"run {(sweep_dir / '1').resolve()}" in shown
    assert "data-bound" in shown
    assert "\ndata-bound: waits " in shown  # its fix line; no job number for one run
    view = status_json(capsys, sweep_dir / "0")
    assert view["kind"] == "run" and view["backend"] is None
    [job] = view["jobs"]
    assert (job["state"], job["verdict"]) == ("completed", "healthy")
    assert job["run_dir"] == str((sweep_dir / "0").resolve())


def test_the_runs_own_threshold_decides(sweep_dir, tmp_path):
    from labrun.runs.rundir import RunDir
    from labrun.views.efficiency import measure

    # The same figures, with a run config whose threshold lies just above the run's wait.
    before = measure(RunDir(sweep_dir / "1"))
    allowed = before.data_wait_frac + 0.001
    run = tmp_path / "run"
    shutil.copytree(sweep_dir / "1", run)
    config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    config.setdefault("monitor", {})["data_bound_wait_frac"] = allowed
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    after = measure(RunDir(run))
    assert after.data_wait_frac == before.data_wait_frac
    assert (before.verdict, after.verdict) == ("data-bound", "healthy")
    assert after.thresholds["data_bound_wait_frac"] == allowed


# ---------------------------------------------------------------------------------------------
# Run folders written by hand: what a GPU run logs, which a run here cannot produce.


def write_run(path: Path, rows: list[dict], config: dict | None = None,
              status: str = "completed") -> Path:
    (path / ".hydra").mkdir(parents=True)
    base = {"dataset": {"_target_": "labrun.data.image.digits.load", "num_workers": 4},
            "trainer": {"batch_size": 64}}
    for section, values in (config or {}).items():
        base.setdefault(section, {}).update(values)
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(base))
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["optimizer.lr=0.1"]))
    (path / "summary.json").write_text(json.dumps({"status": status, "monitor": "val/acc",
                                                   "best/val/acc": 0.5}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train_point(step: int, epoch: int, rate: float, wait: float, gpu: float | None = None
                ) -> dict:
    row = {"step": step, "epoch": epoch, "time": 0.0, "train/loss": 1.0,
           "perf/images_per_s": rate, "perf/data_wait_frac": wait}
    if gpu is not None:
        row["perf/gpu_util"] = gpu
    return row


def test_the_latest_epoch_without_its_first_window_weighed_by_duration(tmp_path):
    from labrun.runs.rundir import RunDir
    from labrun.views.efficiency import measure

    rows = [train_point(10, 0, 100.0, 0.9), train_point(20, 0, 100.0, 0.9),
            {"step": 20, "epoch": 0, "val/acc": 0.5},  # a validation point: no perf/
            train_point(30, 1, 50.0, 0.8, gpu=0.1),  # epoch 1's first window: left out
            train_point(40, 1, 400.0, 0.0, gpu=0.9),  # 10 steps in 1/40 of a unit
            train_point(45, 1, 100.0, 0.5, gpu=0.5)]  # 5 steps in 1/20: twice as long
    figures = measure(RunDir(write_run(tmp_path / "run", rows)))
    assert figures.points == 2
    # 15 steps in 3/40 units of time: 200 steps' worth of images per unit.
    assert figures.rate == pytest.approx(200.0) and figures.unit == "img/s"
    assert figures.data_wait_frac == pytest.approx((0.0 * 1 + 0.5 * 2) / 3)
    assert figures.gpu_util == pytest.approx((0.9 * 1 + 0.5 * 2) / 3)
    assert figures.verdict == "data-bound"  # 33% > 30%


def test_gpu_idle_underused_and_healthy_from_gpu_utilisation(tmp_path):
    from labrun.runs.rundir import RunDir
    from labrun.views.efficiency import measure

    def verdict(name: str, wait: float, gpu: float, config: dict | None = None):
        rows = [train_point(10, 0, 500.0, wait, gpu), train_point(20, 0, 500.0, wait, gpu)]
        return measure(RunDir(write_run(tmp_path / name, rows, config)))

    idle = verdict("idle", 0.05, 0.12)
    assert (idle.verdict, idle.reason) == ("GPU idle",
                                           "GPUs busy 12% of the time, not waiting for data")
    assert idle.fix.startswith("raise trainer.batch_size (now 64) so each step gives the GPUs")
    assert verdict("busy", 0.05, 0.85).verdict == "healthy"
    # The lab guide's middle band: busy, but under 70%.
    under = verdict("under", 0.05, 0.55)
    assert (under.verdict, under.reason, under.fix) == (
        "underused", "GPUs busy 55% of the time, under 70%, not waiting for data",
        "raise trainer.batch_size (now 64)")
    settings = verdict("settings", 0.05, 0.55, {"precision": {"name": "fp32"},
                                                 "trainer": {"compile": False}})
    assert settings.fix == ("raise trainer.batch_size (now 64), train in precision=bf16 (now "
                            "fp32) or try trainer.compile=true (now false)")
    assert verdict("own band", 0.05, 0.55, {"monitor": {"gpu_good_util": 0.5}}).verdict == \
        "healthy"
    # Waiting for data explains idle GPUs: the data is what to fix.
    both = verdict("both", 0.6, 0.12)
    assert both.verdict == "data-bound" and both.fix == "raise dataset.num_workers (now 4)"
    # The run's own threshold: 12% is underused, not idle, where 10% is its idle line.
    assert verdict("own", 0.05, 0.12, {"monitor": {"gpu_idle_util": 0.1}}).verdict == \
        "underused"


def test_an_image_folder_run_is_told_to_convert_to_hdf5(tmp_path):
    from labrun.runs.rundir import RunDir
    from labrun.views.efficiency import measure

    rows = [train_point(10, 0, 90.0, 0.62), train_point(20, 0, 90.0, 0.62)]
    config = {"dataset": {"_target_": "labrun.data.image.imagefolder.load", "root": "/data/pets",
                          "num_workers": 0}}
    figures = measure(RunDir(write_run(tmp_path / "run", rows, config)))
    assert figures.reason == "waits 62% of the time for data"
    assert figures.fix == ("raise dataset.num_workers (now 0: the training process loads every "
                           "batch itself) or convert the folder to HDF5 (labrun convert "
                           "/data/pets OUT.h5, then train with dataset=hdf5 dataset.path=OUT.h5)")


def test_no_data_yet_and_a_failed_runs_figures(tmp_path, capsys):
    running = write_run(tmp_path / "running", [{"step": 0, "epoch": 0}], status="running")
    failed = write_run(tmp_path / "failed", [train_point(10, 0, 90.0, 0.5)], status="failed")
    [job] = status_json(capsys, running)["jobs"]
    assert (job["state"], job["verdict"], job["rate"]) == ("running", "no data yet", None)
    assert "no data yet" in labrun_status(capsys, running)
    [job] = status_json(capsys, failed)["jobs"]
    # A single point is all there is: it counts, warm-up or not.
    assert (job["state"], job["verdict"], job["points"]) == ("failed", "data-bound", 1)
    assert job["data_wait_frac"] == 0.5


def test_a_folder_that_is_neither_is_one_line(tmp_path):
    result = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"error: {tmp_path} is neither a sweep folder (no jobs.json) nor a "
                             f"run folder (no .hydra/ or summary.json); give "
                             f"multirun/DATE/TIME-XXXX, one of its job folders, or "
                             f"outputs/DATE/TIME-XXXX\n")


def test_more_jobs_than_a_screen_holds_are_summed_up_and_all_shows_every_row(
        tmp_path, capsys, monkeypatch):
    """A sweep larger than the screen: the counts by state, then the rows that need a look
    (failed, running, the best completed), and `--all` for every row."""
    from labrun.runs.sweepdir import Job, SweepDir

    jobs = []
    for num in range(30):
        run = write_run(tmp_path / str(num), [train_point(10, 0, 900.0, 0.01)],
                        status="failed" if num in (4, 17) else "completed")
        summary = json.loads((run / "summary.json").read_text())
        summary["best/val/acc"] = num / 100  # job 29 is the best
        (run / "summary.json").write_text(json.dumps({**summary, "mode": "max"}))
        jobs.append(Job(num=num, overrides=[f"optimizer.lr={num}"], dir=str(run),
                        job_id=str(1000 + num), state="completed", log=str(run / "log")))
    SweepDir(tmp_path).write_jobs("local", jobs)
    monkeypatch.setenv("LINES", "20")  # a screen of 10 rows
    shown = labrun_status(capsys, tmp_path)
    assert shown.splitlines()[0] == "30 jobs: 28 completed, 2 failed"
    rows = [int(line.split("│")[1]) for line in shown.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    # The failed jobs, and the ten best of the completed ones (by val/acc, max).
    assert rows == [4, 17, *range(20, 30)]
    assert f"12 of 30 jobs shown (failed, running, the best); every row: labrun status " \
           f"{tmp_path} --all" in shown
    every = labrun_status(capsys, tmp_path, "--all")
    assert "30 jobs:" not in every
    assert sum(1 for line in every.splitlines() if line.startswith("│")) == 30
