"""A task from outside labrun (examples/regression: scikit-learn's diabetes data, an MLP, a
mean-squared-error task) is a labrun project: from its own folder, `labrun train` picks its
conf/ and its defaults, with checkpoints, an exact resume and a sweep, as docs/plugins.md says,
and it exports, serves and predicts through its own deploy module, trusted there as the
project's own code, with the real commands. Nothing of it is in labrun."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sklearn.datasets import load_diabetes

from conftest import (
    FAST,
    PROJECT,
    assert_identical,
    final_weights,
    manifest,
    read_metrics,
    read_summary,
    run_labrun,
)
from labrun.deploy.served import serving

EXAMPLE = PROJECT / "examples" / "regression"
SHORT = ["trainer.max_epochs=4", "checkpoint.every_n_steps=10", "checkpoint.keep_last=10"]
# The example's package on PYTHONPATH stands in for the `pip install -e .` a lab member runs
# in its folder: the tests install nothing into the environment they run in. No module is
# trusted by name, whatever the shell running the suite sets: what trusts the example's code
# is the folder a command runs in.
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE / "src"), os.environ.get("PYTHONPATH", "")]),
       "LABRUN_TRUSTED_MODULES": ""}


def train_in_example(*overrides: str, sweep: bool = False, timeout: int = 300):
    """`labrun train [-m] FAST SHORT overrides` from the example's folder, as a lab member runs
    it (-m first: Hydra's command line takes no option after the overrides)."""
    return run_labrun("train", *(["-m"] if sweep else []), *FAST, *SHORT, *overrides,
                      cwd=EXAMPLE, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The example's run: 4 epochs, a checkpoint every 10 steps."""
    run_dir = tmp_path_factory.mktemp("regression") / "whole"
    train_in_example(f"hydra.run.dir={run_dir}")
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
    result = train_in_example(f"checkpoint.resume={whole / 'checkpoints' / 'step-00000020.pt'}",
                              f"hydra.run.dir={resumed}")
    assert "resuming from" in result.stdout
    assert_identical(final_weights(resumed), final_weights(whole))

    # timeout: two runs one after the other, each allowed a whole run's 300 s.
    sweep = tmp_path / "sweep"
    train_in_example("cluster=local", "optimizer.lr=0.01,0.003", f"hydra.sweep.dir={sweep}",
                     sweep=True, timeout=600)
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
    # Outside the project (labrun's own checkout) its modules are a lab's, not imported unless
    # trusted: one line naming the variable.
    refused = run_labrun("export", str(whole), check=False, cwd=PROJECT, env=ENV)
    assert refused.returncode == 2 and "LABRUN_TRUSTED_MODULES=regression" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (whole / "export").exists()

    # In the project's folder they are its own code, trusted without the variable.
    run_labrun("export", str(whole), cwd=EXAMPLE, env=ENV)
    model = whole / "export" / "best.onnx"
    meta = json.loads(Path(f"{model}.json").read_text())
    assert (meta["task"], meta["deploy"], meta["input"]["shape"]) == (
        "regression", "regression.deploy", ["batch", 10])
    assert meta["parity"]["passed"] and meta["parity"]["rows_from"] == "the val rows"

    features, _ = load_diabetes(return_X_y=True)
    rows = features[[3, 100, 200]]
    expected = expected_values(whole, rows)
    assert np.ptp(expected) > 1  # different patients, different answers: a real comparison
    names = meta["feature_names"]
    with serving(model, tmp_path / "server.log", cwd=EXAMPLE, env={**os.environ, **ENV}
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
    run_labrun("predict", str(whole), str(table), "--out", str(out), cwd=EXAMPLE, env=ENV)  # a run
    predicted = [float(row["prediction"]) for row in csv.DictReader(out.open())]
    np.testing.assert_allclose(predicted, expected, rtol=1e-5)
    # Its options are the task's own: an image classifier's are refused in one line.
    wrong = run_labrun("predict", str(model), str(table), "--k", "3", check=False, cwd=EXAMPLE,
                       env=ENV)
    assert wrong.returncode == 2 and "unrecognized arguments: --k 3" in wrong.stderr
