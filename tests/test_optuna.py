"""hparams_search=optuna: labrun's own sweeper on current Optuna. Its search-space syntax
(hydra-optuna-sweeper's, parsed by Hydra), and pruning: a trial reports checkpoint.monitor
after every epoch to the study's journal file, the pruner stops it, the run ends "pruned" and
`labrun compare` shows it so; `labrun dashboard` shows the study in optuna-dashboard (its API,
and its page in a headless browser). (An interrupted study continuing: test_cluster_local.py;
six trials three at a time on SLURM: test_cluster_slurm.py.)"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from conftest import (
    FAST,
    LABRUN,
    PROJECT,
    PYTHON,
    manifest,
    read_metrics,
    read_summary,
    start_dashboard,
    stop_dashboard,
)
from labrun.core.errors import ConfigError
from labrun.launch import search_space
from labrun.runs.sweepdir import SweepDir


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


@pytest.fixture(scope="module")
def pruned_study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A real two-trial study on the local launcher: trial 0 completes, trial 1 is pruned
    after its first epoch (the sweep folder, and the sweep command's result)."""
    tmp_path = tmp_path_factory.mktemp("study")
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
    return tmp_path, result


def test_a_bad_trial_is_pruned_after_one_epoch_and_compare_shows_it(pruned_study, tmp_path):
    sweep_dir, result = pruned_study
    # The sweeper told the study; the trials ran with the enqueued parameters.
    trials = load_study(sweep_dir).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE,
                                         optuna.trial.TrialState.PRUNED]
    assert [t.params for t in trials] == [GOOD, BAD]
    assert sorted(trials[0].intermediate_values) == [1, 2, 3]  # reported after every epoch
    assert sorted(trials[1].intermediate_values) == [1]
    assert trials[1].intermediate_values[1] > trials[0].intermediate_values[1]

    # The pruned run stopped after its first epoch, and its folder says why.
    summary = read_summary(sweep_dir / "1")
    assert summary["status"] == "pruned" and summary["epoch"] == 1
    assert "pruned by the study's MedianPruner after epoch 1" in summary["stopped_early"]
    assert max(row["epoch"] for row in read_metrics(sweep_dir / "1")) <= 1
    assert read_summary(sweep_dir / "0")["status"] == "completed"
    assert read_summary(sweep_dir / "0")["epoch"] == 3
    assert [(row["num"], row["state"]) for row in manifest(sweep_dir)["jobs"]] == [
        (0, "completed"), (1, "pruned")]
    assert "did not complete" not in result.stdout  # pruned is an outcome, not a failure

    out = tmp_path / "compare.csv"
    shown = subprocess.run([LABRUN, "compare", str(sweep_dir), "--csv", str(out)],
                           capture_output=True, text=True, timeout=120)  # a few small files
    assert shown.returncode == 0, shown.stderr
    rows = {row["run"]: row for row in csv.DictReader(out.open())}
    assert (rows["0"]["status"], rows["0"]["epochs"]) == ("completed", "3")
    assert (rows["1"]["status"], rows["1"]["epochs"]) == ("pruned", "1")
    assert "pruned" in shown.stdout

    status = subprocess.run([LABRUN, "status", str(sweep_dir)], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0 and "pruned" in status.stdout
    results = (sweep_dir / "optimization_results.yaml").read_text()
    assert "best_trial: 0" in results
    assert json.loads((sweep_dir / "jobs.json").read_text())["backend"] == "local"


# -- labrun dashboard: optuna-dashboard on a copy of the study --------------------------------


def dashboard_sweep(pruned_study, tmp_path: Path) -> Path:
    """The study's sweep folder copied, its jobs.json pointing at the copied journal: these
    tests add trials to the study, which the pruning test above must not see."""
    folder = tmp_path / "sweep"
    shutil.copytree(pruned_study[0], folder)
    sweep = SweepDir(folder)
    data = sweep.read_jobs()
    sweep.write_jobs(data["backend"], data["jobs"], study={
        "name": "train", "storage": str(folder / "optuna.journal")})
    return folder


def trial_states(url: str) -> list[str]:
    studies = httpx.get(f"{url}/api/studies", timeout=10).json()["study_summaries"]
    assert [s["study_name"] for s in studies] == ["train"]
    detail = httpx.get(f"{url}/api/studies/{studies[0]['study_id']}", timeout=10).json()
    return [trial["state"] for trial in detail["trials"]]


def test_dashboard_shows_the_study_and_never_writes_to_it(pruned_study, tmp_path):
    folder = dashboard_sweep(pruned_study, tmp_path)
    journal = folder / "optuna.journal"
    before = journal.read_bytes()
    proc, url, lines = start_dashboard(folder)
    try:
        assert any("ssh -L" in line for line in lines) and url.startswith("http://127.0.0.1:")
        assert trial_states(url) == ["Complete", "Pruned"]

        # What the dashboard writes (a note; deleting the study) goes to its copy alone.
        note = httpx.put(f"{url}/api/studies/0/note", json={"version": 1, "body": "tried"},
                         timeout=10)
        assert note.status_code == 204, note.text
        copy = folder / ".dashboard" / "optuna.journal"
        assert b"tried" in copy.read_bytes() and journal.read_bytes() == before

        # A trial the study gains while the dashboard runs shows up there (the copy follows).
        study = load_study(folder)
        study.add_trial(optuna.trial.create_trial(
            params={"optimizer.lr": 3e-3, "optimizer.weight_decay": 0.0},
            distributions=study.trials[0].distributions, value=0.5))
        deadline = time.monotonic() + 60  # refreshed every 2 s
        while len(trial_states(url)) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert trial_states(url) == ["Complete", "Pruned", "Complete"]

        assert httpx.delete(f"{url}/api/studies/0", timeout=10).status_code == 204
        assert len(load_study(folder).trials) == 3  # the study itself is whole
    finally:
        if proc.poll() is None:
            stop_dashboard(proc, url)


def test_the_dashboard_page_renders_the_trials_in_a_browser(pruned_study, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:  # required, as Prometheus is: a missing browser fails the suite
        pytest.fail("no chromium: `make test` as root installs it (scripts/setup.sh test: "
                    "apt-get install chromium); the optuna-dashboard page was not rendered")
    folder = dashboard_sweep(pruned_study, tmp_path)
    proc, url, _ = start_dashboard(folder)
    try:
        # Headless, and no network beyond loopback: every other host name resolves to nothing.
        page = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-proxy-server",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             "--disable-background-networking", "--disable-component-update",
             "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
             "--virtual-time-budget=15000", "--dump-dom", f"{url}/dashboard/studies/0/trials"],
            capture_output=True, text=True, timeout=120)  # a few seconds; loaded cores
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.sub(
            r"<(style|script)\b.*?</\1>", "", page.stdout, flags=re.S)))
        assert "2 Trials" in text, text[:2000]  # rendered by the page's scripts, not served
        assert "Trial 0 Complete" in text and "Trial 1 Pruned" in text
    finally:
        stop_dashboard(proc, url)
