"""Sweeps of a language model (task=lm with a step budget) on the local launcher: an Optuna
search whose pruner judges trials at validation steps, and a grid over the loggers whose
records (W&B offline, TensorBoard) hold the LM's metrics. (The same on the test cluster:
test_cluster_slurm.py.)"""

from __future__ import annotations

import os
import subprocess

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from test_tracking import OFFLINE, inspect_records, offline_runs

from conftest import FAST, LM_TINY, PROJECT, PYTHON, manifest, read_metrics, read_summary

# Two validations, at steps 8 and 16 of one epoch: what the pruner and the loggers see.
STEPS = ["trainer.max_steps=16", "trainer.val_every_n_steps=8", "trainer.log_every_n_steps=4",
         "trainer.limit_val_batches=2"]
GOOD = {"optimizer.lr": 3e-3, "optimizer.weight_decay": 0.0}
# Eight AdamW steps at 1e-6 leave the byte distribution where it started (about ln 256 per
# byte); at 3e-3 they reach well below it (same seed: same weights and windows).
BAD = {"optimizer.lr": 1e-6, "optimizer.weight_decay": 0.0}


def sweep(tmp_path, *overrides: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    args = [PYTHON, "train.py", "-m", "cluster=local", *LM_TINY, *STEPS, *overrides,
            f"hydra.sweep.dir={tmp_path}"]
    # Two tiny jobs, each well under a minute on a loaded 2-core machine; 600 s only keeps a
    # hung sweep from blocking the suite.
    return subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_an_optuna_search_of_a_language_model_prunes_at_a_validation_step(python_docs_tokens,
                                                                          tmp_path):
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    study = optuna.create_study(study_name="train", storage=storage, direction="minimize")
    study.enqueue_trial(GOOD)  # trial 0 completes: the pruner's one start-up trial
    study.enqueue_trial(BAD)  # trial 1 does worse at its first validation: pruned there
    result = sweep(tmp_path, *FAST, f"dataset.path={python_docs_tokens}",
                   "hparams_search=optuna", "hydra.sweeper.n_trials=2",
                   "hydra.sweeper.pruner.n_startup_trials=1")
    assert result.returncode == 0, result.stdout + result.stderr

    trials = optuna.load_study(study_name="train", storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE,
                                         optuna.trial.TrialState.PRUNED]
    # Reported by step at each validation (the run has no epoch's end), judged on val/loss,
    # the task's own monitor: no checkpoint.monitor on the command line.
    assert sorted(trials[0].intermediate_values) == [8, 16]
    assert sorted(trials[1].intermediate_values) == [8]
    assert trials[1].intermediate_values[8] > trials[0].intermediate_values[8]
    assert trials[0].value == read_summary(tmp_path / "0")["best/val/loss"]

    pruned = read_summary(tmp_path / "1")
    assert pruned["status"] == "pruned" and pruned["step"] == 8
    assert "pruned by the study's MedianPruner after step 8 (val/loss" in pruned["stopped_early"]
    assert max(row["step"] for row in read_metrics(tmp_path / "1")) == 8
    assert [(row["num"], row["state"]) for row in manifest(tmp_path)["jobs"]] == [
        (0, "completed"), (1, "pruned")]


def test_a_grid_over_the_loggers_records_the_language_models_metrics(python_docs_tokens,
                                                                     tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    result = sweep(tmp_path, "trainer.progress=log", "dataset.num_workers=0",
                   f"dataset.path={python_docs_tokens}", "logger=wandb,tensorboard", env=OFFLINE)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = manifest(tmp_path)["jobs"]
    assert [(row["num"], row["state"]) for row in jobs] == [(0, "completed"), (1, "completed")]
    wandb_dir, tensorboard_dir = tmp_path / "0", tmp_path / "1"
    assert "logger=wandb" in jobs[0]["overrides"]

    # W&B: one history row per logged step, holding the values of metrics.jsonl.
    [offline] = offline_runs(wandb_dir)
    history = {r["history"]["item"]["step"]: r["history"]["item"]
               for r in inspect_records(offline) if r["type"] == "history"}
    points = read_metrics(wandb_dir)
    assert sorted(history) == sorted({p["step"] for p in points})
    lm_keys = {"val/loss", "val/ppl", "val/acc", "best/val/loss", "perf/tokens_per_s"}
    seen = set()
    for point in points:
        for key in lm_keys & set(point):
            assert history[point["step"]][key] == pytest.approx(point[key]), key
            seen.add(key)
    assert seen == lm_keys

    # TensorBoard: the LM's scalars, and the HParams tab judging runs by the task's monitor.
    events = EventAccumulator(str(tensorboard_dir / "tensorboard"))
    events.Reload()
    assert lm_keys <= set(events.Tags()["scalars"])
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == ["best/val/loss", "final/val/loss"]
    ppl = [(e.step, e.value) for e in events.Scalars("val/ppl")]
    assert ppl == [(p["step"], pytest.approx(p["val/ppl"]))
                   for p in read_metrics(tensorboard_dir) if "val/ppl" in p]
