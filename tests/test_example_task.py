"""A task from outside labrun (examples/regression: scikit-learn's diabetes data, an MLP, a
mean-squared-error task) trains through PYTHONPATH and Hydra's search path, with checkpoints,
an exact resume and a sweep, as docs/plugins.md says. Nothing of it is in labrun."""

from __future__ import annotations

import os
import subprocess

from conftest import (
    FAST,
    PROJECT,
    PYTHON,
    assert_identical,
    final_weights,
    manifest,
    read_metrics,
    read_summary,
    run_train,
)

EXAMPLE = PROJECT / "examples" / "regression"
OUTSIDE = [f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "experiment=diabetes",
           "trainer.max_epochs=4", "checkpoint.every_n_steps=10", "checkpoint.keep_last=10"]
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}


def test_a_task_from_outside_trains_resumes_exactly_and_sweeps(tmp_path):
    whole = tmp_path / "whole"
    run_train(*OUTSIDE, run_dir=whole, env=ENV)
    summary = read_summary(whole)
    assert summary["status"] == "completed" and summary["step"] == 36  # 4 epochs of 9 steps
    assert (summary["monitor"], summary["mode"]) == ("val/loss", "min")
    # The target is standardised: predicting its mean scores about 1; the model learnt more.
    assert summary["val/loss"] < 0.7 and {"test/loss", "test/mae"} <= set(summary)
    assert [row["epoch"] for row in read_metrics(whole) if "val/mae" in row] == [1, 2, 3, 4]

    # From the step-20 checkpoint, mid-epoch, in a folder of its own: the same weights.
    resumed = tmp_path / "resumed"
    result = run_train(*OUTSIDE, f"checkpoint.resume={whole / 'checkpoints' / 'step-00000020.pt'}",
                       run_dir=resumed, env=ENV)
    assert "resuming from" in result.stdout
    assert_identical(final_weights(resumed), final_weights(whole))

    sweep = tmp_path / "sweep"
    result = subprocess.run([PYTHON, "train.py", "-m", *FAST, *OUTSIDE, "cluster=local",
                             "optimizer.lr=0.01,0.003", f"hydra.sweep.dir={sweep}"],
                            cwd=PROJECT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **ENV})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert [(job["num"], job["state"]) for job in manifest(sweep)["jobs"]] == [
        (0, "completed"), (1, "completed")]
    assert [read_summary(sweep / str(n))["monitor"] for n in (0, 1)] == ["val/loss"] * 2
