"""hparams_search=optuna: labrun's own sweeper on current Optuna. Its search-space syntax
(hydra-optuna-sweeper's, parsed by Hydra), and pruning: a trial reports checkpoint.monitor
after every epoch to the study's journal file, the pruner stops it, the run ends "pruned" and
`labrun compare` shows it so. (An interrupted study continuing: test_cluster_local.py; six
trials three at a time on SLURM: test_cluster_slurm.py.)"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from conftest import FAST, LABRUN, PROJECT, PYTHON, manifest, read_metrics, read_summary
from labrun.core.errors import ConfigError
from labrun.launch import search_space


def load_study(sweep_dir: Path) -> optuna.Study:
    """The study the sweeper keeps in the sweep folder by default (a journal file)."""
    storage = JournalStorage(JournalFileBackend(str(sweep_dir / "optuna.journal")))
    return optuna.load_study(study_name="train", storage=storage)


# -- the search space --------------------------------------------------------------------------


def test_the_search_space_syntax_of_hydra_optuna_sweeper():
    params = {"optimizer.lr": "tag(log, interval(1e-4, 1e-1))",
              "optimizer.weight_decay": "interval(0.0, 0.1)",
              "trainer.batch_size": "int(interval(32, 256))",
              "trainer.max_epochs": "range(2, 10, 2)",
              "model": "choice(simple_cnn, resnet18)",
              "precision": "bf16"}
    # The command line adds to params and wins over a key both give.
    distributions, fixed = search_space.parse(params, ["model=resnet50", "+seed=choice(1,2)"])
    assert distributions == {
        "optimizer.lr": FloatDistribution(1e-4, 1e-1, log=True),
        "optimizer.weight_decay": FloatDistribution(0.0, 0.1),
        "trainer.batch_size": IntDistribution(32, 256),
        "trainer.max_epochs": IntDistribution(2, 8, step=2),  # Hydra's range: stop excluded
        "+seed": CategoricalDistribution([1, 2]),
    }
    assert fixed == ["model=resnet50", "precision=bf16"]  # in params order


@pytest.mark.parametrize(("value", "message"), [
    ("tag(lgo, interval(0, 1))", "unknown tag lgo"),
    ("interval(0, 1", "cannot parse"),
    ("glob(*)", "no search space the Optuna sweeper knows"),
])
def test_a_search_space_mistake_is_one_line_naming_it(value, message):
    with pytest.raises(ConfigError, match=message):
        search_space.parse({"optimizer.lr": value}, [])


# -- pruning -----------------------------------------------------------------------------------

# Three epochs of four steps: the bad trial is pruned after its first, long before its last.
EPOCHS = ["trainer.max_epochs=3", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]
GOOD = {"optimizer.lr": 1e-2, "optimizer.weight_decay": 0.0}
# Four AdamW steps at 1e-4 barely move the weights: its val/loss after an epoch stays where it
# started, above that of 1e-2 (same seed: same initial weights and batches).
BAD = {"optimizer.lr": 1e-4, "optimizer.weight_decay": 0.0}


def test_a_bad_trial_is_pruned_after_one_epoch_and_compare_shows_it(tmp_path):
    # val/loss, not val/acc: two validation batches make accuracy coarse enough for the two
    # trials to tie, and a tie is not pruned; a loss does not tie. The study's direction
    # follows checkpoint.mode (minimize).
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    study = optuna.create_study(study_name="train", storage=storage, direction="minimize")
    study.enqueue_trial(GOOD)  # trial 0 completes: the pruner's one start-up trial
    study.enqueue_trial(BAD)  # trial 1 does worse after its first epoch: pruned there
    args = [PYTHON, "train.py", "-m", "hparams_search=optuna", "cluster=local", *FAST, *EPOCHS,
            "checkpoint.monitor=val/loss", "checkpoint.mode=min", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.pruner.n_startup_trials=1", f"hydra.sweep.dir={tmp_path}"]
    # Two trials of three short epochs, each well under two minutes on a loaded 2-core
    # machine; 600 s only keeps a hung search from blocking the suite.
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

    # The sweeper told the study; the trials ran with the enqueued parameters.
    trials = load_study(tmp_path).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE,
                                         optuna.trial.TrialState.PRUNED]
    assert [t.params for t in trials] == [GOOD, BAD]
    assert sorted(trials[0].intermediate_values) == [1, 2, 3]  # reported after every epoch
    assert sorted(trials[1].intermediate_values) == [1]
    assert trials[1].intermediate_values[1] > trials[0].intermediate_values[1]

    # The pruned run stopped after its first epoch, and its folder says why.
    summary = read_summary(tmp_path / "1")
    assert summary["status"] == "pruned" and summary["epoch"] == 1
    assert "pruned by the study's MedianPruner after epoch 1" in summary["stopped_early"]
    assert max(row["epoch"] for row in read_metrics(tmp_path / "1")) <= 1
    assert read_summary(tmp_path / "0")["status"] == "completed"
    assert read_summary(tmp_path / "0")["epoch"] == 3
    assert [(row["num"], row["state"]) for row in manifest(tmp_path)["jobs"]] == [
        (0, "completed"), (1, "pruned")]
    assert "did not complete" not in result.stdout  # pruned is an outcome, not a failure

    out = tmp_path / "compare.csv"
    shown = subprocess.run([LABRUN, "compare", str(tmp_path), "--csv", str(out)],
                           capture_output=True, text=True, timeout=120)  # a few small files
    assert shown.returncode == 0, shown.stderr
    rows = {row["run"]: row for row in csv.DictReader(out.open())}
    assert (rows["0"]["status"], rows["0"]["epochs"]) == ("completed", "3")
    assert (rows["1"]["status"], rows["1"]["epochs"]) == ("pruned", "1")
    assert "pruned" in shown.stdout

    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0 and "pruned" in status.stdout
    results = (tmp_path / "optimization_results.yaml").read_text()
    assert "best_trial: 0" in results
    assert json.loads((tmp_path / "jobs.json").read_text())["backend"] == "local"
