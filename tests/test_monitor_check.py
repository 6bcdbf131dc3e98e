"""checkpoint.monitor is checked at start-up against what the run reports while training: the
task's declared `metric_names` (as val/NAME) and the trainer's own train/ and perf/ metrics.
A mistake is one line naming the metrics and the closest, before any data loads or any sweep
job is submitted; a plug-in task that declares no names gets a warning instead."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from conftest import FAST, PROJECT, PYTHON, read_metrics, read_summary, run_train
from labrun.config import validation
from labrun.config.messages import user_error_message
from labrun.core.errors import ConfigError

# Two optimizer steps and a few validation batches: enough for every metric to be logged.
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=2"]

# A lab's own code: a task that declares no metric_names, and a dataset loader that must not run.
LAB_MODULE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F

    from labrun.train.task import Classification

    class Undeclared(Classification):
        """A plug-in task that reports val/xent but declares no metric_names."""

        num_sums = 2
        metric_names = None

        def eval_sums(self, model, batch):
            images, labels = batch
            logits = model(images).float()
            return torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                                torch.tensor(float(len(labels)), device=logits.device)])

        def eval_metrics(self, sums, split):
            loss, count = sums.tolist()
            return {f"{split}/xent": loss / max(count, 1.0)}


    def never_load():
        raise AssertionError("the dataset was loaded")
''')


@pytest.fixture
def lab_path(tmp_path, monkeypatch):
    """A folder holding the lab's module `labtask`, importable here and in train.py."""
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "labtask.py").write_text(LAB_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("labtask", None)
    return folder


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as caught:
        validation.validate(cfg)
    message = user_error_message(caught.value)
    assert message is not None and "\n" not in message, message
    return message


@pytest.mark.parametrize("monitor, closest", [
    ("val/accc", "val/acc"),
    ("val/acc_5", "val/acc5"),
    ("val_loss", "val/loss"),
    ("train/los", "train/loss"),
    ("test/acc", "val/acc"),  # the test split is evaluated after training: it cannot pick best.pt
    ("best/val/loss", "val/loss"),  # the trainer's record of the best val/loss so far
])
def test_a_monitor_no_metric_carries_is_refused_naming_them_and_the_closest(composed, monitor,
                                                                           closest):
    message = refusal(composed(f"checkpoint.monitor={monitor}"))
    assert message.startswith(f"checkpoint.monitor={monitor} is not among the metrics"), message
    assert f"did you mean {closest}?" in message, message
    for name in ("val/loss", "val/acc", "val/acc5", "train/loss", "train/lr",
                 "perf/images_per_s", "perf/data_wait_frac", "perf/gpu_util"):
        assert name in message, f"{name} not named in {message!r}"


def test_callbacks_that_see_only_validation_metrics_need_a_val_monitor(composed):
    # Early stopping reads the epoch's validation metrics: with train/loss it saw nothing and
    # stopped the run after `patience` epochs, "best none".
    message = refusal(composed("checkpoint.monitor=train/loss", "checkpoint.mode=min",
                               "callbacks=early_stopping"))
    assert message == ("checkpoint.monitor=train/loss: callbacks.early_stopping "
                       "(labrun.train.callbacks.EarlyStopping) reads it from the validation "
                       "metrics alone (val/loss, val/acc, val/acc5); monitor one of them")
    validation.validate(composed("checkpoint.monitor=val/loss", "checkpoint.mode=min",
                                 "callbacks=early_stopping"))


def test_a_monitor_is_accepted_exactly_when_the_run_reports_it_while_training(tmp_path,
                                                                              composed):
    # A train/ monitor picks best.pt from the last logged value of each epoch: a real best.
    run_dir = tmp_path / "trained"
    run_train(*SHORT, "checkpoint.monitor=train/loss", "checkpoint.mode=min", run_dir=run_dir)
    best = read_summary(run_dir)["best/train/loss"]
    assert isinstance(best, float), best

    logged = {key for point in read_metrics(run_dir) for key in point} - {"step", "epoch", "time"}
    assert {key for key in logged if key.startswith("val/")} == {"val/loss", "val/acc", "val/acc5"}
    while_training = sorted(key for key in logged if not key.startswith("best/"))
    assert any(key.startswith("train/") for key in while_training)
    for monitor in while_training:  # val/, train/ and perf/ names
        validation.validate(composed(f"checkpoint.monitor={monitor}"))
    for monitor in ["best/train/loss", "test/acc", "test/loss"]:
        message = refusal(composed(f"checkpoint.monitor={monitor}"))
        assert message.startswith(f"checkpoint.monitor={monitor} "), message


def test_a_task_that_declares_no_metrics_gets_a_warning_and_trains(lab_path, tmp_path, composed,
                                                                  caplog):
    # A task and monitor of this test alone: the warning comes once per process for each pair.
    overrides = ["task._target_=labtask.Undeclared", "checkpoint.monitor=val/xent",
                 "checkpoint.mode=min"]
    with caplog.at_level(logging.WARNING, logger="labrun.config.validation"):
        validation.validate(composed(*overrides))
    warning = ("task labtask.Undeclared declares no metric_names: checkpoint.monitor=val/xent "
               "is not checked")
    assert [warning in record.getMessage() for record in caplog.records] == [True], caplog.text

    run_dir = tmp_path / "undeclared"
    result = run_train(*SHORT, *overrides, run_dir=run_dir, env={"PYTHONPATH": str(lab_path)})
    assert warning in result.stdout + result.stderr
    assert warning in (run_dir / "train.log").read_text()
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and isinstance(summary["best/val/xent"], float)


def test_the_monitor_is_checked_before_any_data_loads(lab_path, composed):
    from labrun.train import job

    cfg = composed("dataset=synthetic", "dataset._target_=labtask.never_load",
                   "checkpoint.monitor=val/acx")
    with pytest.raises(ConfigError, match=r"^checkpoint\.monitor=val/acx .*did you mean val/acc\?"):
        job.train(cfg)  # never_load would raise AssertionError


def test_a_sweep_with_a_bad_monitor_submits_no_job(tmp_path):
    # Job 0 alone would be fine: the sweep is refused before it starts, not when job 1 does.
    sweep_dir = tmp_path / "sweep"
    args = [PYTHON, "train.py", "-m", *FAST, *SHORT, "cluster=local",
            "checkpoint.monitor=val/acc,val/acx", f"hydra.sweep.dir={sweep_dir}"]
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.monitor=val/acx is not"), \
        result.stderr
    assert "did you mean val/acc?" in lines[0]
    # Hydra writes multirun.yaml before it calls the launcher; the launcher wrote nothing: no
    # jobs.json, no job folder, no .submitit.
    left = sorted(path.name for path in sweep_dir.iterdir()) if sweep_dir.exists() else []
    assert left in ([], ["multirun.yaml"]), left


def test_an_optuna_study_with_a_bad_monitor_asks_for_no_trial(tmp_path):
    # Refused before the study exists: no journal holds a trial left running for the next run
    # of the same folder to requeue.
    sweep_dir = tmp_path / "study"
    args = [PYTHON, "train.py", "-m", *FAST, *SHORT, "hparams_search=optuna",
            "hydra.sweeper.n_trials=2", "checkpoint.monitor=val/acx",
            f"hydra.sweep.dir={sweep_dir}"]
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: checkpoint.monitor=val/acx is not"), result.stderr
    left = sorted(path.name for path in sweep_dir.iterdir()) if sweep_dir.exists() else []
    assert left in ([], ["multirun.yaml"]), left
