"""`labrun eval`: a run's checkpoint on a split of its own dataset or of another, written to
RUN/eval/ and ranked by `labrun compare --metric eval/...`; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import built_once, read_summary, run_labrun, run_train
from labrun import cli

SPREAD_OVER_WORKERS = True  # the run is built once per session (built_once)


@pytest.fixture(scope="session")
def tested_run(tmp_path_factory) -> Path:
    """A synthetic run with a test split, which training evaluated on best.pt at its end."""
    folder = built_once(tmp_path_factory, "eval_run", lambda folder: run_train(
        "dataset=synthetic", "dataset.num_train=256", "dataset.num_val=64",
        "dataset.num_test=96", "trainer.max_epochs=2", run_dir=folder / "run"))
    return folder / "run"


def test_eval_of_best_on_test_equals_the_runs_own_test_figures(tested_run, capsys):
    summary_before = (tested_run / "summary.json").read_text()
    metrics_before = (tested_run / "metrics.jsonl").read_text()
    assert cli.main(["eval", str(tested_run), "--split", "test"]) == 0
    written = tested_run / "eval" / "synthetic-test-best.json"
    record = json.loads(written.read_text())
    assert record["checkpoint"] == str((tested_run / "checkpoints" / "best.pt").resolve())
    assert (record["dataset"], record["split"]) == ("synthetic", "test")
    assert record["world_size"] == 1  # no trainer.devices: this process alone
    summary = read_summary(tested_run)
    for name in ("test/loss", "test/acc", "test/acc5"):  # the same checkpoint, the same data
        assert record["metrics"][name] == pytest.approx(summary[name], rel=1e-6, abs=1e-9)
    assert json.loads(capsys.readouterr().out.rsplit("wrote", 1)[0]) == record
    # The training's own records are untouched.
    assert (tested_run / "summary.json").read_text() == summary_before
    assert (tested_run / "metrics.jsonl").read_text() == metrics_before


def test_eval_on_a_second_dataset_writes_its_own_file_and_compare_ranks_by_it(tested_run,
                                                                              capsys):
    # scikit-learn's digits: ten classes named 0-9, as synthetic's are; its val split.
    assert cli.main(["eval", str(tested_run / "checkpoints" / "last.pt"), "--split", "val",
                     "dataset=digits", "dataset.image_size=32"]) == 0
    record = json.loads((tested_run / "eval" / "digits-val-last.json").read_text())
    assert record["dataset"] == "digits" and set(record["metrics"]) == {
        "val/loss", "val/acc", "val/acc5"}
    capsys.readouterr()
    assert cli.main(["compare", str(tested_run), "--metric", "eval/digits-val-last/val/acc"]) == 0
    table = capsys.readouterr().out
    assert "best eval/digits-val-last/val/acc" in table
    assert f"{record['metrics']['val/acc']:.4f}" in table


def test_eval_in_two_processes_adds_up_to_one(tested_run):
    """trainer.devices=2: each process evaluates its shard; the sums are all-reduced."""
    run_labrun("eval", str(tested_run), "--split", "val", "trainer.devices=2")
    two = json.loads((tested_run / "eval" / "synthetic-val-best.json").read_text())
    # Two processes' sums were added up (counted by an all-reduce): one process alone, with
    # trainer.devices=2 ignored, gives the same figures below.
    assert two["world_size"] == 2, two
    summary_best = read_summary(tested_run)["best/val/acc"]  # best.pt's val/acc in training
    assert two["metrics"]["val/acc"] == pytest.approx(summary_best, abs=1e-9)


REFUSALS = {
    "other classes": (["dataset.num_classes=5"], "was trained on 10 classes (0, 1, 2, 3, ...), "
                                                 "dataset synthetic has 5 (0, 1, 2, 3, ...)"),
    "no such split": (["--split", "test2"], "dataset synthetic has no test2 split; its splits: "
                                            "train, val, test"),
}


@pytest.mark.parametrize("refusal", REFUSALS, ids=list(REFUSALS))
def test_eval_refusals_are_one_line(refusal, tested_run, capsys):
    args, expected = REFUSALS[refusal]
    assert cli.main(["eval", str(tested_run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err, err


def test_eval_is_refused_while_a_live_run_holds_the_folder(tested_run, tmp_path, capsys):
    import shutil

    from labrun.runs import lock

    copy = tmp_path / "run"
    shutil.copytree(tested_run, copy, ignore=shutil.ignore_patterns("eval"))
    held = lock.acquire(copy / ".lock")  # this test's process is the live holder
    try:
        assert cli.main(["eval", str(copy)]) == 2
    finally:
        held.release()
    assert "is being trained by" in capsys.readouterr().err
    assert not (copy / "eval").exists()
