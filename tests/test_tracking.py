"""W&B (the real client, offline: there is no W&B server here), TensorBoard, and provenance."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import PYTHON, read_metrics, read_summary, run_train
from labrun.runs import provenance

WANDB = str(Path(PYTHON).with_name("wandb"))
OFFLINE = {"WANDB_MODE": "offline", "WANDB_API_KEY": "", "NETRC": "/nonexistent"}


def inspect_records(offline_run: Path) -> list[dict]:
    """The records of an offline run, read back with W&B's own tool."""
    # Reading a small local file takes a second or two; 120 s: a hung reader fails the test.
    out = subprocess.run([WANDB, "leet", "inspect", "--json", str(offline_run)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    result = run_train("logger=wandb", "trainer.max_epochs=2", "trainer.log_every_n_steps=5",
                       "logger.tags=[smoke]", run_dir=run_dir, env=OFFLINE)
    return run_dir, result.stdout


def test_offline_run_matches_the_run_folder(wandb_run):
    run_dir, stdout = wandb_run
    [offline] = offline_runs(run_dir)
    assert f"upload it with: wandb sync {offline}" in stdout
    records = inspect_records(offline)

    run = next(r["run"] for r in records if r["type"] == "run")
    config = run["config"]["update"]
    assert config["optimizer"]["lr"] == 0.003  # nested, not a flat string
    assert config["trainer"]["max_epochs"] == 2
    assert "trainer.max_epochs=2" in config["overrides"]
    assert set(config["provenance"]) >= {"git_commit", "git_dirty", "host", "torch"}
    assert run["job_type"] == "run" and run["tags"] == ["smoke"]

    history = [r["history"] for r in records if r["type"] == "history"]
    points = read_metrics(run_dir)
    assert len(history) == len({p["step"] for p in points})  # one W&B row per logged step
    # Keyed on labrun's own `step` (define_metric), not W&B's `_step`.
    logged = {row["item"]["step"]: row["item"] for row in history}
    for point in points:
        for key, value in point.items():
            if "/" in key:
                assert logged[point["step"]][key] == pytest.approx(value), (key, point["step"])

    summary = json.loads(subprocess.run(
        [WANDB, "leet", "inspect", "--summary", "--json", str(offline)], capture_output=True,
        text=True, check=True, timeout=120).stdout)  # as in inspect_records
    local = read_summary(run_dir)
    assert summary["state"] == "finished"
    assert summary["summary"]["best/val/acc"] == pytest.approx(local["best/val/acc"])
    assert summary["summary"]["val/acc"] == pytest.approx(local["val/acc"])


def test_wandb_failure_never_stops_training(tmp_path):
    """An unreachable W&B server (a closed port on loopback) and a bad key."""
    result = run_train("logger=wandb", "logger.mode=online", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=2", run_dir=tmp_path / "run",
                       env={"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9",
                            "WANDB_INIT_TIMEOUT": "10"})
    assert "W&B could not start" in result.stderr
    assert read_summary(tmp_path / "run")["status"] == "completed"
    assert "x" * 40 not in (tmp_path / "run" / "provenance" / "command.json").read_text()


def test_tensorboard_logger_writes_event_files_and_the_runs_hparams(tmp_path):
    run_train("logger=tensorboard", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
              "optimizer.lr=0.02", run_dir=tmp_path / "run")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val/acc", "best/val/acc", "final/val/acc"} <= set(
        events.Tags()["scalars"])
    # The HParams tab's session: the run's overrides as numbers where they are, its status.
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(
        content[metadata.SESSION_START_INFO_TAG])
    assert start.hparams["optimizer.lr"].number_value == 0.02
    assert start.hparams["status"].string_value == "completed"
    assert start.hparams["logger"].string_value == "tensorboard"
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == ["best/val/acc", "final/val/acc"]
    best = events.Scalars("best/val/acc")[-1].value
    assert best == pytest.approx(read_summary(tmp_path / "run")["best/val/acc"])


def test_provenance_records_a_patch_when_the_tree_is_dirty(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "model.py").write_text("width = 32\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    (repo / "model.py").write_text("width = 64\n")
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-value")
    argv = ["train.py", "+wandb.api_key=abc123", "optimizer.lr=0.1"]
    recorded = provenance.write(tmp_path / "prov", ["optimizer.lr=0.1"], repo, argv,
                                str(tmp_path))
    assert recorded["git_dirty"] is True
    assert "+width = 64" in (tmp_path / "prov" / "git.diff").read_text()
    everything = "".join(p.read_text() for p in (tmp_path / "prov").iterdir())
    assert "secret-key-value" not in everything and "abc123" not in everything
    assert "+wandb.api_key=<redacted>" in everything
    (repo / "model.py").write_text("width = 32\n")
    assert provenance.write(tmp_path / "clean", [], repo, ["train.py"],
                            str(tmp_path))["git_dirty"] is False
    assert not (tmp_path / "clean" / "git.diff").exists()


def test_rerun_prints_the_command_and_warns_about_differences(digits_run, tmp_path):
    import shutil

    from conftest import run_labrun

    copy = tmp_path / "run"
    shutil.copytree(digits_run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    packages = copy / "provenance" / "packages.txt"
    packages.write_text(packages.read_text().replace("torch==", "torch==0.0.1-was-"))
    tool = copy / "provenance" / "labrun.json"
    tool.write_text(json.dumps({**json.loads(tool.read_text()), "version": "0.0.1"}))
    result = run_labrun("rerun", str(copy))
    assert "packages differ" in result.stderr and "torch" in result.stderr
    assert "labrun version differs: run 0.0.1, now" in result.stderr
    command = result.stdout.strip()
    assert command.split()[1].endswith("train.py") and "trainer.max_epochs=3" in command
    assert "hydra.run.dir" not in command  # a new folder, from scratch

    run_labrun("rerun", str(copy), "trainer.limit_train_batches=1", "trainer.max_epochs=1",
               "logger=csv", "dataset.num_workers=0", f"hydra.run.dir={tmp_path / 'again'}",
               "--exec")
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["status"] == "completed"
