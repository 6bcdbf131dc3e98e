"""`labrun compare` on a real 3-run sweep, plus planted failed and running runs: the table's
order (via --csv), --markdown, and a PNG with both panels; `labrun dashboard` on the same
sweep (TensorBoard's HParams). Many runs and many parameters: tests/test_dashboard.py."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from conftest import FAST, PROJECT, PYTHON, run_labrun, start_dashboard, stop_dashboard
from labrun.views import compare, compare_output

LRS = ("0.0003", "0.003", "0.03")  # spans 100x: the metric-vs-lr panel has a log x-axis


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A real sweep over optimizer.lr, three tiny jobs."""
    sweep_dir = tmp_path_factory.mktemp("compare") / "sweep"
    args = [PYTHON, str(PROJECT / "train.py"), "-m", *FAST, "trainer.max_epochs=1",
            "trainer.limit_train_batches=3", f"optimizer.lr={','.join(LRS)}",
            f"hydra.sweep.dir={sweep_dir}"]
    # Three tiny jobs one after another (no GPU here), under a minute each on a loaded 2-core
    # machine; 300 s only keeps a hung sweep from blocking the suite.
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return sweep_dir


@pytest.fixture(scope="module")
def planted(sweep, tmp_path_factory) -> Path:
    """Two more jobs of the same sweep that did not complete: one failed before any metric,
    one still running with a better val/acc than any completed run (it must still sort last)."""
    folder = tmp_path_factory.mktemp("planted")
    for name, lr, status, rows in [
        ("failed", "0.3", "failed", []),
        ("running", "0.1", "running",
         [{"step": 3, "epoch": 1, "time": 1.0e9, "val/acc": 0.99, "val/loss": 0.01}]),
    ]:
        run_dir = folder / name
        shutil.copytree(sweep / "0" / ".hydra", run_dir / ".hydra")
        overrides = [o if not o.startswith("optimizer.lr=") else f"optimizer.lr={lr}"
                     for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())]
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        error = "RuntimeError: CUDA error: out of memory" if status == "failed" else None
        (run_dir / "summary.json").write_text(json.dumps(
            {"status": status, "error": error, "epoch": len(rows), "monitor": "val/acc"}))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_default_metric_sorts_best_first_and_unfinished_last(sweep, planted, tmp_path):
    out = tmp_path / "table.csv"
    result = run_labrun("compare", str(sweep), str(planted), "--csv", str(out))
    rows = read_csv(out)
    assert list(rows[0]) == ["run", "optimizer.lr", "status", "best val/acc", "final val/acc",
                             "epochs", "time_s"]
    assert [r["status"] for r in rows][:3] == ["completed"] * 3
    assert sorted(r["status"] for r in rows[3:]) == ["failed", "running"]
    best = [float(r["best val/acc"]) for r in rows[:3]]
    assert best == sorted(best, reverse=True)  # checkpoint.mode=max from the runs' config
    assert sorted(r["optimizer.lr"] for r in rows[:3]) == sorted(LRS)
    assert all(int(r["epochs"]) == 1 and float(r["time_s"]) > 0 for r in rows[:3])
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["best val/acc"] == "" and failed["optimizer.lr"] == "0.3"
    assert "sorted by best val/acc (max)" in result.stdout
    assert "failed: RuntimeError: CUDA error: out of memory" in result.stdout


@pytest.mark.parametrize("mode_args, descending", [(["--mode", "min"], False), ([], False),
                                                    (["--mode", "max"], True)])
def test_metric_and_mode_choose_the_order(sweep, tmp_path, mode_args, descending):
    out = tmp_path / "table.csv"
    run_labrun("compare", str(sweep), "--metric", "val/loss", *mode_args, "--csv", str(out))
    losses = [float(r["best val/loss"]) for r in read_csv(out)]
    assert len(losses) == 3 and losses == sorted(losses, reverse=descending)  # loss: min


def test_markdown_holds_the_same_table(sweep, planted, tmp_path):
    out, table = tmp_path / "table.md", tmp_path / "table.csv"
    run_labrun("compare", str(sweep), str(planted), "--markdown", str(out), "--csv", str(table))
    lines = [line for line in out.read_text().splitlines() if line.startswith("|")]
    assert lines[0] == ("| run | optimizer.lr | status | best val/acc | final val/acc | epochs "
                        "| time |")
    assert set(lines[1].replace("|", "").split()) <= {"---", "---:"}
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    rows = read_csv(table)
    assert [(c[0], c[2]) for c in cells] == [(r["run"], r["status"]) for r in rows]  # same order
    assert {c[2] for c in cells[-2:]} == {"failed", "running"}


def test_plot_has_curves_and_metric_vs_the_swept_parameter(sweep, tmp_path):
    out = tmp_path / "sweep.png"
    result = run_labrun("compare", str(sweep), "--plot", str(out))
    assert "best val/acc vs optimizer.lr" in result.stderr  # the "wrote FILE (...)" report
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1200, 450)  # two 6x4.5-inch panels


def test_plot_of_one_run_has_only_its_curves(sweep, tmp_path):
    out = tmp_path / "run.png"
    result = run_labrun("compare", str(sweep / "1"), "--plot", str(out), "--metric", "train/loss")
    assert "wrote" in result.stderr and "vs" not in result.stderr.split("wrote")[-1]
    with Image.open(out) as image:
        assert image.size == (600, 450)


@pytest.mark.parametrize("args, expected", [
    (["{empty}"], "no run folders"),
    (["{sweep}", "--metric", "val/acc55"], "val/acc5"),
    (["{missing}"], "no such folder"),
])
def test_bad_input_is_one_line(sweep, tmp_path, args, expected):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    paths = {"empty": tmp_path / "empty", "sweep": sweep, "missing": tmp_path / "missing"}
    result = run_labrun("compare", *[a.format(**paths) for a in args], check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_the_plot_names_each_run_by_the_swept_value_in_its_order(sweep):
    ranked = compare.rank([sweep])
    fig, _ = compare_output.figure(ranked, None)
    curves, by_lr = fig.axes[:2]
    labels = [text.get_text() for text in curves.get_legend().get_texts()]
    assert labels == [f"lr={lr}" for lr in LRS]  # the swept values, not the folders' numbers
    assert by_lr.get_xscale() == "log"  # 0.0003 to 0.03: two decades


def test_dashboard_serves_the_sweep_in_tensorboards_hparams(sweep):
    runs = {path: sorted(p.relative_to(path) for p in path.rglob("*"))
            for path in sweep.iterdir() if path.is_dir() and not path.name.startswith(".")}
    proc, url, lines = start_dashboard(sweep)
    try:
        assert "(3 written, 0 unchanged)" in lines[0]
        experiment = httpx.post(f"{url}/data/plugin/hparams/experiment",
                                json={"experimentName": ""}, timeout=30).json()
        assert [h["name"] for h in experiment["hparamInfos"]] == ["optimizer.lr", "status"]
        assert [m["name"]["tag"] for m in experiment["metricInfos"]] == ["best/val/acc",
                                                                        "final/val/acc"]
        groups = httpx.post(f"{url}/data/plugin/hparams/session_groups", timeout=30, json={
            "experimentName": "", "startIndex": 0, "sliceSize": 10, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN"]}).json()["sessionGroups"]
        best = {float(row["optimizer.lr"]): float(row["best val/acc"]) for row in csv_rows(sweep)}
        shown = {group["hparams"]["optimizer.lr"]: next(
            m["value"] for m in group["metricValues"] if m["name"]["tag"] == "best/val/acc")
            for group in groups}
        assert shown == pytest.approx(best)  # TensorBoard's float32 scalars
    finally:
        stop_dashboard(proc, url)
    # Nothing was written into a run folder; a second start writes nothing again.
    assert runs == {path: sorted(p.relative_to(path) for p in path.rglob("*")) for path in runs}
    again = run_labrun("dashboard", str(sweep), "--prepare-only")
    assert "(0 written, 3 unchanged)" in again.stdout


def csv_rows(sweep: Path) -> list[dict[str, str]]:
    out = sweep.parent / "for_dashboard.csv"
    run_labrun("compare", str(sweep), "--csv", str(out))
    return read_csv(out)


def relabelled(source: Path, target: Path, overrides: list[str]) -> None:
    """A copy of a real run folder whose command line said `overrides`: the runs of a grid."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints"))
    (target / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))


def test_over_seed_folds_the_seeds_into_mean_std_min_max_and_n(sweep, planted, digits_run,
                                                               tmp_path, capsys):
    """Two configurations of three seeds: lr=0.1 from the three real sweep runs, lr=0.2 from
    the real digits run, a failed run and a running one (1 of 3 completed)."""
    import statistics

    from labrun import cli

    grid = tmp_path / "grid"
    for seed, job in enumerate(("0", "1", "2")):
        relabelled(sweep / job, grid / f"a{seed}", ["optimizer.lr=0.1", f"seed={seed}"])
    for seed, source in enumerate((digits_run, planted / "failed", planted / "running")):
        relabelled(source, grid / f"b{seed}", ["optimizer.lr=0.2", f"seed={seed}"])
    out, markdown = tmp_path / "table.csv", tmp_path / "table.md"
    assert cli.main(["compare", str(grid), "--over", "seed", "--csv", str(out),
                     "--markdown", str(markdown), "--plot", str(tmp_path / "p.png")]) == 0

    def best_and_final(run_dir: Path) -> tuple[float, float]:
        values = [row["val/acc"] for row in read_metrics_rows(run_dir) if "val/acc" in row]
        return max(values), values[-1]

    rows = {row["optimizer.lr"]: row for row in read_csv(out)}
    assert sorted(rows) == ["0.1", "0.2"]  # one row per learning rate, the seeds folded away
    for lr, runs, count in (("0.1", [sweep / j for j in "012"], "3"),
                            ("0.2", [digits_run], "1 of 3")):
        row = rows[lr]
        assert row["n"] == count
        best = [best_and_final(r)[0] for r in runs]
        final = [best_and_final(r)[1] for r in runs]
        assert float(row["best val/acc mean"]) == pytest.approx(statistics.fmean(best))
        assert float(row["final val/acc mean"]) == pytest.approx(statistics.fmean(final))
        assert float(row["best val/acc min"]) == min(best)
        assert float(row["best val/acc max"]) == max(best)
        assert int(row["best val/acc n"]) == len(runs)
        if len(runs) > 1:  # the sample standard deviation (n-1)
            assert float(row["best val/acc std"]) == pytest.approx(statistics.stdev(best))
        else:
            assert row["best val/acc std"] == ""  # none for one run
    means = [float(row["best val/acc mean"]) for row in read_csv(out)]
    assert means == sorted(means, reverse=True)  # best mean first (val/acc: max)
    # Every validation metric, best and final, beside the ranked one.
    assert {"best val/loss mean", "final val/acc5 mean"} <= set(rows["0.1"])
    table = markdown.read_text()
    assert "| optimizer.lr | n | best val/acc |" in table
    spread = statistics.stdev([best_and_final(sweep / j)[0] for j in "012"])
    digits = max(0, 1 - math.floor(math.log10(spread)))
    mean = statistics.fmean([best_and_final(sweep / j)[0] for j in "012"])
    assert f"| {mean:.{digits}f} ± {spread:.{digits}f} |" in table
    assert Image.open(tmp_path / "p.png").size[0] > 0


def test_over_a_key_no_run_sets_is_one_line(sweep, capsys):
    from labrun import cli

    assert cli.main(["compare", str(sweep), "--over", "seed"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --over seed: no run sets it; the keys that vary between these runs: "
        "optimizer.lr")


def read_metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
