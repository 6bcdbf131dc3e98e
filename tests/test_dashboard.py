"""Many runs, many parameters: `labrun compare --plot`'s figure read back from its matplotlib
objects, an Optuna sweep's importances, the HParams files `labrun dashboard` writes and
skips, its one-line refusals, and its benchmark on a few runs. The folders are the
benchmark's synthetic runs (labrun.bench.dashboard.make_runs), as finished sweeps leave them;
a real sweep in each viewer: tests/test_compare.py (TensorBoard), tests/test_optuna.py
(optuna-dashboard and a browser)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import socket
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

from conftest import run_labrun
from labrun.bench.dashboard import make_runs, make_study
from labrun.core.errors import LabrunError
from labrun.runs.sweepdir import SweepDir, open_storage
from labrun.views import compare, compare_output, dashboard

SPREAD_OVER_WORKERS = True  # no test here shares a fixture with another


def test_a_100_run_plot_names_the_top_10_and_draws_the_rest_thin_and_grey(tmp_path):
    make_runs(tmp_path / "sweep", 100)
    ranked = compare.rank([tmp_path / "sweep"])
    fig, drawn = compare_output.figure(ranked, None)
    curves, by_lr, by_decay = fig.axes[:3]

    named = [line for line in curves.get_lines() if not line.get_label().startswith("_")]
    grey = [line for line in curves.get_lines() if line.get_color() == "0.75"]
    assert (len(named), len(grey)) == (10, 90)
    labels = [text.get_text() for text in curves.get_legend().get_texts()]
    # The ten best runs, best first, each by the overrides that vary (never its number).
    assert labels == [compare_output.label(one, ranked.keys) for one in ranked.runs[:10]]
    assert all(re.fullmatch(r"lr=[\d.e-]+ weight_decay=[\d.]+ model=\w+", text)
               for text in labels), labels
    assert "top 10; 90 more in grey" in curves.get_title()

    # One panel per numeric parameter that varies (model is not a number): log for lr.
    assert ranked.parameters == ["optimizer.lr", "optimizer.weight_decay"]
    assert (by_lr.get_xscale(), by_decay.get_xscale()) == ("log", "linear")
    assert "best val/acc vs optimizer.weight_decay" in drawn
    # Pruned and failed runs marked apart, each with as many points as there are such runs.
    marks = {line.get_label(): (line.get_marker(), len(line.get_xdata()))
             for line in by_lr.get_lines()}
    statuses = [one.status for one in ranked.runs]
    assert marks == {"completed": ("o", statuses.count("completed")),
                     "pruned": ("v", statuses.count("pruned")),
                     "failed": ("x", statuses.count("failed"))}
    assert statuses.count("pruned") == statuses.count("failed") == 5


def test_an_optuna_sweeps_plot_shows_importances_and_no_trial_plumbing(tmp_path):
    folder = tmp_path / "study"
    make_study(folder, 12)
    ranked = compare.rank([folder])
    # The trial's callback overrides (its number, storage, study) are not parameters.
    assert ranked.keys == ["optimizer.lr", "optimizer.weight_decay", "model"]
    importances = compare.study_importances([folder], ranked)
    assert set(importances) == {"optimizer.lr", "optimizer.weight_decay"}
    assert sum(importances.values()) == pytest.approx(1.0)
    fig, drawn = compare_output.figure(ranked, importances)
    bars = next(ax for ax in fig.axes if ax.get_title() == "parameter importances")
    assert {tick.get_text() for tick in bars.get_yticklabels()} == set(importances)
    assert drawn.endswith("parameter importances")
    assert "trial=" not in " ".join(compare_output.label(one, ranked.keys)
                                    for one in ranked.runs)
    # A plain folder of runs has no study, hence no importances.
    make_runs(tmp_path / "grid", 3)
    assert compare.study_importances([tmp_path / "grid"], compare.rank([tmp_path / "grid"])) \
        is None


def sessions(folder: Path) -> dict[str, dict]:
    """Each run's HParams session as TensorBoard reads it back from the event files."""
    found = {}
    for session in sorted(p for p in (folder / ".dashboard" / "tensorboard").iterdir()
                          if p.is_dir()):
        events = EventAccumulator(str(session))
        events.Reload()
        start = metadata.parse_session_start_info_plugin_data(
            events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG])
        found[session.name] = {key: value.number_value if value.HasField("number_value")
                               else value.string_value for key, value in start.hparams.items()}
        found[session.name]["best"] = events.Scalars("best/val/acc")[-1].value
    return found


def test_hparams_are_written_once_and_again_when_a_run_changes(tmp_path):
    folder = tmp_path / "sweep"
    make_runs(folder, 10)
    assert "(10 written, 0 unchanged)" in dashboard.prepare(folder, port=0).what
    written = sessions(folder)
    run_9 = compare.load_run(folder / "9")
    assert written["9"]["status"] == "pruned"  # make_runs prunes every tenth run
    assert written["9"]["optimizer.lr"] == float(run_9.overrides["optimizer.lr"])
    assert written["9"]["model"] == run_9.overrides["model"]
    assert written["9"]["best"] == pytest.approx(run_9.summary["best/val/acc"])

    assert "(0 written, 10 unchanged)" in dashboard.prepare(folder, port=0).what
    with open(folder / "3" / "metrics.jsonl", "a") as f:  # run 3 went on
        f.write('{"step": 9999, "epoch": 11, "time": 1.8e9, "val/acc": 0.999}\n')
    assert "(1 written, 9 unchanged)" in dashboard.prepare(folder, port=0).what
    assert sessions(folder)["3"]["best"] == pytest.approx(0.999)

    # A run folder removed: its session goes too (TensorBoard would show it still).
    shutil.rmtree(folder / "8")
    assert "(0 written, 9 unchanged)" in dashboard.prepare(folder, port=0).what
    assert "8" not in sessions(folder)
    # A run that varies one more key: a new experiment, every run written again.
    make_runs(tmp_path / "more", 1)
    overrides = folder / "10" / ".hydra" / "overrides.yaml"
    (tmp_path / "more" / "0").rename(folder / "10")
    overrides.write_text(overrides.read_text() + "- trainer.batch_size=64\n")
    assert "(10 written, 0 unchanged)" in dashboard.prepare(folder, port=0).what
    assert "trainer.batch_size" in sessions(folder)["10"]
    # Never inside a run folder: only the dashboard's own folder is new.
    assert sorted(p.name for p in folder.iterdir() if not p.name.isdigit()) == [".dashboard"]


def test_dashboard_refusals_are_one_line(tmp_path, monkeypatch):
    make_runs(tmp_path / "sweep", 2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [([str(tmp_path / "sweep" / "0")], "is one run's folder"),
                 ([str(tmp_path / "missing")], "no such folder"),
                 ([str(tmp_path / "sweep"), "--port", str(port)], "cannot listen on"),
                 ([str(tmp_path / "sweep"), "--metric", "val/acc55"], "did you mean val/acc")]
        for args, expected in cases:
            result = run_labrun("dashboard", *args, check=False)
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2 and len(lines) == 1, result.stderr
            assert lines[0].startswith("error: ") and expected in lines[0]
    # No TensorBoard in this environment (stood in at the import boundary): the pip extra.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tensorboard" else real(name, *rest))
    with pytest.raises(LabrunError, match=r"needs tensorboard.*pip install -e '\.\[dashboard\]'"):
        dashboard.prepare(tmp_path / "sweep", port=0)


def test_the_dashboard_benchmark_measures_every_figure_on_a_few_runs(capsys):
    from labrun import cli

    # No --check: a test asserts no timing (the targets are make bench's).
    assert cli.main(["bench", "dashboard", "--runs", "20"]) == 0
    out = capsys.readouterr().out
    assert "20 runs: compare" in out and "(0 written, 20 unchanged)" in out
    for figure in ("compare_ratio", "first_write_ratio", "second_start_ratio"):
        assert f"dashboard {figure}" in out


def test_a_database_study_is_copied_once_for_the_dashboard(tmp_path):
    """A study kept in a database (sqlite:///, postgresql://) cannot be followed line by line:
    the dashboard gets one copy of it, taken at start, as a journal beside the runs."""
    import optuna

    folder = tmp_path / "sweep"
    make_runs(folder, 2)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="train", storage=url)
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=3)
    SweepDir(folder).write_jobs("local", [], study={"name": "train", "storage": url})
    plan = dashboard.prepare(folder, port=0)
    assert plan.tool == "optuna-dashboard" and "taken now" in plan.what
    copied = optuna.load_study(study_name="train", storage=open_storage(str(plan.copy.copy)))
    assert [t.params for t in copied.trials] == [t.params for t in study.trials]
    assert plan.argv[-1] == str(plan.copy.copy)  # the copy is what the tool opens
