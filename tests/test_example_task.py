"""A task from outside labrun (examples/regression: scikit-learn's diabetes data, an MLP, a
mean-squared-error task) trains through PYTHONPATH and Hydra's search path, with checkpoints,
an exact resume and a sweep, as docs/plugins.md says, and exports, serves and predicts through
its own deploy module, with the real commands. Nothing of it is in labrun."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sklearn.datasets import load_diabetes

from conftest import (
    FAST,
    PROJECT,
    PYTHON,
    assert_identical,
    final_weights,
    manifest,
    read_metrics,
    read_summary,
    run_labrun,
    run_train,
)
from labrun.deploy.served import serving

EXAMPLE = PROJECT / "examples" / "regression"
OUTSIDE = [f"hydra.searchpath=[file://{EXAMPLE / 'conf'}]", "experiment=diabetes",
           "trainer.max_epochs=4", "checkpoint.every_n_steps=10", "checkpoint.keep_last=10"]
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
# The lab's modules, which export and serving import from the checkpoint: trusted by name.
TRUSTED = {**ENV, "LABRUN_TRUSTED_MODULES": "regression,regression_deploy"}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The example's run: 4 epochs, a checkpoint every 10 steps."""
    run_dir = tmp_path_factory.mktemp("regression") / "whole"
    run_train(*OUTSIDE, run_dir=run_dir, env=ENV)
    return run_dir


def test_a_task_from_outside_trains_resumes_exactly_and_sweeps(whole, tmp_path):
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


def expected_values(run_dir: Path, rows: np.ndarray) -> np.ndarray:
    """The checkpoint's MLP in eager PyTorch, built here, on the rows: disease progression."""
    state = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    layers = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    layers.load_state_dict(state["model"])
    with torch.no_grad():
        standardised = layers(torch.as_tensor(rows, dtype=torch.float32))[:, 0].numpy()
    return standardised * state["target_std"] + state["target_mean"]


def test_a_task_from_outside_exports_serves_and_predicts_through_its_own_hooks(whole, tmp_path):
    # A lab's modules are not imported unless trusted: one line naming the variable.
    refused = run_labrun("export", str(whole), check=False, env=ENV)
    assert refused.returncode == 2 and "LABRUN_TRUSTED_MODULES=regression" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (whole / "export").exists()

    run_labrun("export", str(whole), env=TRUSTED)
    model = whole / "export" / "best.onnx"
    meta = json.loads(Path(f"{model}.json").read_text())
    assert (meta["task"], meta["deploy"], meta["input"]["shape"]) == (
        "regression", "regression_deploy", ["batch", 10])
    assert meta["parity"]["passed"] and meta["parity"]["rows_from"] == "the val rows"

    features, _ = load_diabetes(return_X_y=True)
    rows = features[[3, 100, 200]]
    expected = expected_values(whole, rows)
    assert np.ptp(expected) > 1  # different patients, different answers: a real comparison
    names = meta["feature_names"]
    with serving(model, tmp_path / "server.log", cwd=PROJECT, env={**os.environ, **TRUSTED}
                 ) as served:
        answers = [httpx.post(f"{served.url}/predict", json=dict(zip(names, row.tolist(), strict=True)),
                              timeout=10) for row in rows]
        bad = httpx.post(f"{served.url}/predict", json={"age": 0.1}, timeout=10)
        wrong_route = httpx.post(f"{served.url}/generate", json={}, timeout=10)
    assert [a.status_code for a in answers] == [200] * 3
    np.testing.assert_allclose([a.json()["value"] for a in answers], expected, rtol=1e-5)
    assert bad.status_code == 422 and "missing sex" in bad.json()["error"]
    assert wrong_route.status_code == 404 and "POST /predict" in wrong_route.json()["error"]

    table = tmp_path / "rows.csv"
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        writer.writerows(rows.tolist())
    out = tmp_path / "predictions.csv"
    run_labrun("predict", str(whole), str(table), "--out", str(out), env=TRUSTED)  # a run
    predicted = [float(row["prediction"]) for row in csv.DictReader(out.open())]
    np.testing.assert_allclose(predicted, expected, rtol=1e-5)
    # Its options are the task's own: an image classifier's are refused in one line.
    wrong = run_labrun("predict", str(model), str(table), "--k", "3", check=False, env=TRUSTED)
    assert wrong.returncode == 2 and "unrecognized arguments: --k 3" in wrong.stderr
