"""`labrun bench --check`: measured figures -> verdicts -> one table of every figure, its
baseline and its target -> exit status and one line per miss.

The figures are injected here (the real benchmarks take minutes and their numbers depend on the
machine); the smoke runs in test_data_bench.py measure for real.
"""

from __future__ import annotations

import math

import pytest

from labrun import cli
from labrun.bench import Target, judge, report
from labrun.bench import dashboard as bench_dashboard
from labrun.bench import data as bench_data
from labrun.bench import seg_data as bench_seg_data
from labrun.bench import serve as bench_serve
from labrun.bench import sweep as bench_sweep
from labrun.bench import trainer as bench_trainer
from labrun.bench.dashboard import DASHBOARD_TARGETS
from labrun.bench.data import DATA_TARGETS, FEEDS_TARGET
from labrun.bench.seg_data import SEG_DATA_TARGETS
from labrun.bench.serve import SERVE_TARGETS, serve_targets, serving_bound
from labrun.bench.sweep import SWEEP_TARGETS
from labrun.bench.trainer import STARTUP_TARGETS, TRAINER_TARGETS

REQUIRED_SPEEDUP = next(t for t in DATA_TARGETS if t.figure == "speedup").bound


def data_figures(speedup: float, of_ceiling: float) -> dict[str, float]:
    return {"baseline": 1000.0, "hdf5": 1000.0 * speedup, "speedup": speedup,
            "ceiling": 1000.0 * speedup / of_ceiling, "of_ceiling": of_ceiling}


def serve_figures(errors: int = 0, to_ceiling: float = 1.0, gain: float = 1.0,
                  p99_to_bound: float = 0.5, to_bound: float = 1.0) -> dict[str, float]:
    return {"errors": errors, "served": 40.0 * to_ceiling, "ceiling": 40.0,
            "ratio_to_ceiling": to_ceiling, "bound": 40.0 * to_ceiling / to_bound,
            "ratio_to_bound": to_bound, "unbatched": 40.0 * to_ceiling / gain,
            "ratio_batched_to_unbatched": gain, "p99_1_ms": 50.0 * p99_to_bound,
            "bound_1_ms": 50.0, "p99_1_to_bound": p99_to_bound}


def table_row(out: str, figure: str) -> str:
    """The table's row of `figure` ("bench name"), as one line."""
    (row,) = [line for line in out.splitlines() if f" {figure} " in line]
    return row


def test_a_missed_required_target_fails_the_check_and_is_named(capsys):
    verdicts = judge("data", data_figures(REQUIRED_SPEEDUP * 0.75, 0.9), DATA_TARGETS)
    assert report(verdicts, check=True) == 1
    out = capsys.readouterr().out
    missed = [line for line in out.splitlines() if line.startswith("target missed:")]
    assert missed == [f"target missed: data speedup: measured {REQUIRED_SPEEDUP * 0.75:.3g}, "
                      f"target >= {REQUIRED_SPEEDUP:g}"]


def test_every_target_met_passes_the_check(capsys):
    verdicts = judge("data", data_figures(REQUIRED_SPEEDUP * 1.1, 0.9), DATA_TARGETS)
    assert all(v.met for v in verdicts)
    assert report(verdicts, check=True) == 0
    assert "target missed" not in capsys.readouterr().out


def test_a_target_met_exactly_counts_as_met():
    assert judge("data", data_figures(REQUIRED_SPEEDUP, 0.9), DATA_TARGETS)[0].met


def test_a_missed_stretch_target_is_shown_but_does_not_fail_the_check(capsys):
    verdicts = judge("data", data_figures(REQUIRED_SPEEDUP * 1.1, 0.1), DATA_TARGETS)
    stretch = next(v for v in verdicts if v.target.figure == "of_ceiling")
    assert not stretch.met and not stretch.missed
    assert report(verdicts, check=True) == 0
    row = table_row(capsys.readouterr().out, "data of_ceiling")
    assert "stretch" in row and "NOT met (not checked)" in row and ">= 0.75" in row


def test_without_check_a_miss_is_reported_but_exits_0(capsys):
    verdicts = judge("data", data_figures(REQUIRED_SPEEDUP / 2, 0.1), DATA_TARGETS)
    assert report(verdicts, check=False) == 0
    out = capsys.readouterr().out
    row = table_row(out, "data speedup")
    assert "required" in row and "NOT met" in row and "not checked" not in row
    assert "target missed" not in out


def test_the_table_shows_each_figure_with_what_it_compares_and_its_target(capsys):
    """A target's `of` puts the measured and baseline figures beside the judged one."""
    figures = serve_figures(to_ceiling=0.9)
    report(judge("serve", figures, SERVE_TARGETS), check=False)
    row = table_row(capsys.readouterr().out, "serve ratio_to_ceiling")
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells == ["serve ratio_to_ceiling", "served 36.0", "ceiling 40.0", "0.9", ">= 0.95",
                     "required", "NOT met"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_batching_gain_is_required_on_cuda_only(device, capsys):
    verdicts = judge("serve", serve_figures(gain=1.1), serve_targets(device))
    assert report(verdicts, check=True) == (1 if device == "cuda" else 0)
    out = capsys.readouterr().out
    row = table_row(out, "serve ratio_batched_to_unbatched")
    assert "served 40.0" in row and "unbatched 36.4" in row and ">= 3" in row
    if device == "cuda":
        assert "target missed: serve ratio_batched_to_unbatched: measured 1.1, target >= 3" in out
    else:
        assert "on CUDA only; here: cpu" in row and "NOT met (not checked)" in row


def test_the_serving_bound_adds_both_costs_on_a_cpu_and_overlaps_them_on_a_gpu():
    # 1/60 + 1/300 s a request: the model's and the rest's work take turns on the same cores.
    assert serving_bound(60.0, 300.0, "cpu") == pytest.approx(50.0)
    # The model on the GPU, the rest on the CPU: the slower side sets the pace.
    assert serving_bound(60.0, 300.0, "cuda") == 60.0
    assert serving_bound(600.0, 300.0, "cuda") == 300.0


@pytest.mark.parametrize("target", [*DATA_TARGETS, FEEDS_TARGET, *TRAINER_TARGETS, *STARTUP_TARGETS,
                                    *serve_targets("cuda"), *SWEEP_TARGETS,
                                    *DASHBOARD_TARGETS],
                         ids=lambda t: t.figure)
def test_each_benchmark_fails_on_either_side_of_its_bound(target):
    worse, better = (target.bound * 0.9, target.bound * 1.1) if target.op == ">=" else \
        (target.bound, target.bound - 0.5)
    parts = dict.fromkeys(target.of or (), 1.0)  # the figures it compares, for the table
    assert [v.met for v in judge("b", {**parts, target.figure: worse}, [target])] == [False]
    assert [v.met for v in judge("b", {**parts, target.figure: better}, [target])] == [True]


def test_a_nan_figure_meets_no_target():
    for op in (">=", "<"):
        assert not judge("b", {"x": math.nan}, [Target("x", op, 1.0)])[0].met


def test_a_figure_the_benchmark_did_not_measure_is_an_error():
    with pytest.raises(KeyError):
        judge("data", {"speedup": 4.0}, DATA_TARGETS)


def test_every_timed_target_is_a_ratio_against_a_baseline_of_the_same_run():
    """No target judges seconds: each timed figure is compared with its baseline (`of`), and
    what is left are counts (errors, SLURM queries)."""
    counts = {"errors", "queries_per_pass"}
    for target in [*DATA_TARGETS, FEEDS_TARGET, *TRAINER_TARGETS, *STARTUP_TARGETS,
                   *serve_targets("cuda"), *SWEEP_TARGETS, *DASHBOARD_TARGETS,
                   *SEG_DATA_TARGETS]:
        assert target.of is not None or target.figure in counts, target
        assert not target.figure.endswith(("_s", "_ms")), target


def test_the_sweeps_memory_is_judged_per_1000_jobs_above_the_one_job_base():
    """Peak RSS as a base (one job's sweep) plus a figure per 1,000 jobs, as ms_per_job is
    taken; the 5,000-job sweep of issue 54 projected from them. Figures from this machine:
    now (43 MB, then 30 MB per 1,000 jobs) and before the fix (683 MB with torch, then 1.92 GB
    at 5,000 jobs)."""
    now = bench_sweep.memory_figures(43.0, 191.0, 5000)
    assert now["rss_mb_per_1000_jobs"] == pytest.approx(148 / 4.999)
    assert now["rss_mb_5000_jobs"] == pytest.approx(191.0)
    before = bench_sweep.memory_figures(683.0, 1918.0, 5000)
    verdicts = {v.target.figure: v for v in judge(
        "sweep", {"ms_per_job": 6.4, "hydra_ms_per_job": 100.0, "speedup": 15.6,
                  "queries_per_pass": 1, **before}, SWEEP_TARGETS)}
    assert verdicts["rss_mb_per_1000_jobs"].missed
    assert not verdicts["rss_mb_5000_jobs"].met and not verdicts["rss_mb_5000_jobs"].missed
    assert all(v.met for v in judge("sweep", {"ms_per_job": 6.4, "hydra_ms_per_job": 100.0,
                                              "speedup": 15.6, "queries_per_pass": 1, **now},
                                    SWEEP_TARGETS))
    # A sweep at the bench's default size: the base is not judged as jobs.
    small = bench_sweep.memory_figures(43.0, 87.0, 1500)
    assert small["rss_mb_per_1000_jobs"] < 30 and small["rss_mb_5000_jobs"] < 200


def test_a_benchmark_that_cannot_run_misses_its_required_targets_with_the_reason(
        monkeypatch, capsys):
    """No SLURM cluster answers: `labrun bench sweep --check` exits 1 saying why (its three
    required targets used to vanish and `bench all --check` said all were met)."""
    from labrun.core import probes
    from labrun.core.scheduler import SlurmScheduler

    def no_cluster(self):
        raise probes.SlurmError("missing", "squeue: not found")

    monkeypatch.setattr(SlurmScheduler, "partitions", no_cluster)
    assert cli.main(["bench", "sweep", "--check"]) == 1
    out = capsys.readouterr().out
    missed = [line for line in out.splitlines() if line.startswith("target missed:")]
    assert len(missed) == sum(t.required for t in SWEEP_TARGETS) == 3
    assert all("not measured (no SLURM cluster answers here" in line for line in missed)
    assert "labrun bench all --skip sweep" in missed[0]


def test_bench_all_skips_only_what_the_command_line_names(monkeypatch, capsys):
    fake_benchmarks(monkeypatch, speedup=REQUIRED_SPEEDUP * 2, ratio=1.0, startup_ratio=1.1,
                    errors=0)
    monkeypatch.setattr(bench_sweep, "run", lambda args: bench_sweep.unmeasured(
        "sweep", SWEEP_TARGETS, "no SLURM cluster answers here"))
    assert cli.main(["bench", "all", "--check"]) == 1
    assert "target missed: sweep speedup: not measured" in capsys.readouterr().out
    assert cli.main(["bench", "all", "--check", "--skip", "sweep"]) == 0
    out = capsys.readouterr().out
    assert "== labrun bench sweep: left out (--skip sweep)" in out
    assert "required targets met; left out on the command line: sweep" in out
    assert " sweep speedup " not in out


def fake_benchmarks(monkeypatch, speedup: float, ratio: float, startup_ratio: float,
                    errors: int, to_ceiling: float = 1.0) -> None:
    """Every benchmark's run function replaced by one that returns injected figures."""
    monkeypatch.setattr(bench_data, "run_data", lambda args: judge(
        "data", data_figures(speedup, 0.9), DATA_TARGETS))
    # The segmentation data benchmark's real run: tests/test_seg_data.py (shrunk); met here.
    monkeypatch.setattr(bench_seg_data, "run_seg_data", lambda args: judge(
        "seg-data", {"torchvision": 100.0, "segfolder": 200.0, "seg_hdf5": 200.0,
                     "speedup": 2.0, "hdf5_speedup": 2.0}, SEG_DATA_TARGETS))
    monkeypatch.setattr(bench_trainer, "run_trainer", lambda args: judge(
        "trainer", {"bare": 100.0, "session": 100.0 * ratio, "ratio": ratio,
                    "lm_bare": 9000.0, "lm_session": 9000.0 * ratio, "lm_ratio": ratio},
        TRAINER_TARGETS))
    monkeypatch.setattr(bench_trainer, "run_startup", lambda args: judge(
        "startup", {"baseline_s": 2.0, "first_step_s": 2.0 * startup_ratio,
                    "startup_ratio": startup_ratio}, STARTUP_TARGETS))
    monkeypatch.setattr(bench_serve, "run", lambda args: judge(
        "serve", serve_figures(errors, to_ceiling), serve_targets("cpu")))
    # The sweep benchmark submits to a SLURM cluster; its figures here meet every target.
    monkeypatch.setattr(bench_sweep, "run", lambda args: judge(
        "sweep", {"ms_per_job": 10.0, "hydra_ms_per_job": 200.0, "speedup": 20.0,
                  "queries_per_pass": 1, **bench_sweep.memory_figures(40.0, 85.0, 1500)},
        SWEEP_TARGETS))
    # The dashboard benchmark's real run: tests/test_dashboard.py (on fewer runs).
    monkeypatch.setattr(bench_dashboard, "run", lambda args: judge(
        "dashboard", {"compare_s": 1.0, "read_files_s": 0.5, "compare_ratio": 2.0,
                      "first_write_s": 2.0, "summary_writer_s": 4.0, "first_write_ratio": 0.5,
                      "second_start_s": 0.01, "stat_files_s": 0.002,
                      "second_start_ratio": 5.0}, DASHBOARD_TARGETS))


def test_bench_all_check_through_the_cli_names_every_miss_and_exits_1(monkeypatch, capsys):
    fake_benchmarks(monkeypatch, speedup=REQUIRED_SPEEDUP / 2, ratio=0.5, startup_ratio=9.0,
                    errors=3, to_ceiling=0.5)
    assert cli.main(["bench", "all", "--check"]) == 1
    out = capsys.readouterr().out
    missed = {line.split(":")[1].strip() for line in out.splitlines()
              if line.startswith("target missed:")}
    assert missed == {"data speedup", "trainer ratio", "trainer lm_ratio",
                      "startup startup_ratio", "serve errors", "serve ratio_to_ceiling"}
    assert "target missed: startup startup_ratio: measured 9, target < 1.5" in out


def test_bench_all_check_through_the_cli_exits_0_when_all_are_met(monkeypatch, capsys):
    fake_benchmarks(monkeypatch, speedup=REQUIRED_SPEEDUP * 2, ratio=1.0, startup_ratio=1.1,
                    errors=0)
    assert cli.main(["bench", "all", "--check"]) == 0
    out = capsys.readouterr().out
    assert "target missed" not in out
    # One table at the end, with every benchmark's every target.
    assert out.count("benchmark targets") == 1
    table = out[out.index("benchmark targets"):]
    for figure in ("data speedup", "data of_ceiling", "trainer ratio", "trainer lm_ratio",
                   "startup startup_ratio",
                   "serve errors", "serve ratio_to_ceiling", "serve ratio_to_bound",
                   "serve ratio_batched_to_unbatched", "serve p99_1_to_bound",
                   "sweep speedup", "sweep queries_per_pass", "dashboard compare_ratio",
                   "dashboard first_write_ratio", "dashboard second_start_ratio"):
        assert f" {figure} " in table, figure
    assert cli.main(["bench", "all"]) == 0


def test_one_benchmark_with_check_through_the_cli(monkeypatch, capsys):
    fake_benchmarks(monkeypatch, speedup=REQUIRED_SPEEDUP * 2, ratio=0.5, startup_ratio=1.1,
                    errors=0)
    assert cli.main(["bench", "trainer", "--check"]) == 1
    assert cli.main(["bench", "data", "--check"]) == 0
    assert cli.main(["bench", "trainer"]) == 0
    assert capsys.readouterr().out.count("target missed: trainer ratio: measured 0.5") == 1
