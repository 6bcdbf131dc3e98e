"""`python train.py` end to end: the run-folder contract of docs/ARCHITECTURE.md."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import (
    PROJECT,
    PYTHON,
    final_weights,
    read_metrics,
    read_summary,
    run_train,
    same_weights,
)
from labrun.core.project import LABRUN_CONF


def test_default_job_writes_the_run_folder_contract(digits_run):
    summary = read_summary(digits_run)
    assert summary["status"] == "completed" and summary["error"] is None
    # Digits has 10 classes: chance is 0.1; three epochs of the small CNN clear 0.5 easily.
    assert summary["val/acc"] > 0.5, summary
    assert summary["best/val/acc"] >= summary["val/acc"]
    assert summary["epoch"] == 3 and summary["step"] == 3 * 22  # 1437 train images / 64

    hydra = digits_run / ".hydra"
    assert {"config.yaml", "overrides.yaml", "hydra.yaml"} <= {p.name for p in hydra.iterdir()}
    saved = yaml.safe_load((hydra / "config.yaml").read_text())
    assert saved["trainer"]["max_epochs"] == 3 and saved["dataset"]["name"] == "digits"

    points = read_metrics(digits_run)
    train_points = [p for p in points if "train/loss" in p]
    val_points = [p for p in points if "val/acc" in p]
    assert len(val_points) == 3
    assert all(0 <= p["val/acc"] <= 1 and 0 <= p["val/acc5"] <= 1 for p in val_points)
    assert all(p["perf/images_per_s"] > 0 and 0 <= p["perf/data_wait_frac"] <= 1
               for p in train_points)
    steps = [p["step"] for p in train_points]
    assert steps == sorted(steps) and steps[-1] == 66
    assert train_points[-1]["train/loss"] < train_points[0]["train/loss"]

    checkpoints = {p.name for p in (digits_run / "checkpoints").iterdir()}
    assert {"last.pt", "best.pt", "step-00000022.pt", "step-00000044.pt",
            "step-00000066.pt"} <= checkpoints
    state = torch.load(digits_run / "checkpoints" / "last.pt", weights_only=True)
    expected = {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "data",
                "best", "wandb_run_id", "config", "class_names", "labrun_version"}
    assert expected <= set(state)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert state["class_names"] == [str(d) for d in range(10)]
    assert state["best"] == summary["best/val/acc"]

    provenance = digits_run / "provenance"
    env = json.loads((provenance / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["hostname"]
    assert "torch==" in (provenance / "packages.txt").read_text()
    command = json.loads((provenance / "command.json").read_text())
    assert command["argv"][0].endswith("train.py")
    assert "trainer.max_epochs=3" in command["overrides"]
    assert "commit" in json.loads((provenance / "git.json").read_text())
    assert (digits_run / "metrics.csv").read_text().startswith("step,")


def test_help_lists_groups_and_cfg_job_prints_the_config():
    import subprocess

    help_text = subprocess.run([PYTHON, "train.py", "--help"], cwd=PROJECT, capture_output=True,
                               text=True, check=True).stdout
    # Every option of every group, as conf/ holds them.
    for group in ("dataset", "model", "optimizer", "precision", "schedule", "logger", "task",
                  "callbacks", "experiment"):
        options = sorted(path.stem for path in (LABRUN_CONF / group).glob("*.yaml"))
        assert len(options) > 1 and f"{group}: {', '.join(options)}\n" in help_text, group
    job = subprocess.run([PYTHON, "train.py", "--cfg", "job", "model=resnet18",
                          "optimizer.lr=0.2"], cwd=PROJECT, capture_output=True, text=True,
                         check=True).stdout
    cfg = yaml.safe_load(job)
    assert cfg["model"]["name"] == "resnet18" and cfg["optimizer"]["lr"] == 0.2


def test_run_folders_started_together_never_collide_and_a_pipe_gets_log_lines(tmp_path):
    """Two runs started at once get a run folder each. Their output goes to a pipe, where
    trainer.progress=auto prints log lines, not the terminal's live bar (the test below)."""
    import subprocess

    env_root = {"LABRUN_OUTPUT_ROOT": str(tmp_path)}
    import os
    procs = [subprocess.Popen([PYTHON, "train.py", "logger=none", "trainer.max_epochs=1",
                               "trainer.limit_train_batches=1", "trainer.limit_val_batches=1",
                               "dataset.num_workers=0", "trainer.progress=auto"],
                              cwd=PROJECT, env={**os.environ, **env_root},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    # Two one-step runs at once, mostly start-up: well under a minute each on a loaded
    # 2-core machine, even sharing it; 300 s (run_train's limit) only stops a hang.
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    runs = list(tmp_path.glob("*/*"))
    assert len(runs) == 2 and all((r / "summary.json").exists() for r in runs)
    for piped in outputs:
        assert "\x1b[" not in piped and "━" not in piped
        assert "epoch 1/1" in piped


# Three deterministic steps: enough for the precision of the arithmetic to show in the weights.
# Batches of 16: CPU autocast in bf16 and fp16 is several times slower than fp32, and the
# arithmetic shows as well in a small batch.
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2",
         "trainer.deterministic=true", "trainer.batch_size=16"]


@pytest.fixture(scope="module")
def fp32_weights(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("fp32") / "run"
    run_train(*SHORT, "precision=fp32", run_dir=run_dir)
    return final_weights(run_dir)


def test_bf16_autocasts_without_a_grad_scaler(tmp_path, fp32_weights):
    run_train(*SHORT, "precision=bf16", run_dir=tmp_path / "bf16")
    assert read_summary(tmp_path / "bf16")["status"] == "completed"
    state = torch.load(tmp_path / "bf16/checkpoints/last.pt", weights_only=True)
    assert state["scaler"] == {}, "bf16 needs no loss scaling: the GradScaler must be off"
    # The same seed and data in fp32 give other weights: the bf16 arithmetic really ran.
    assert not same_weights(state["model"], fp32_weights), "bf16 trained exactly like fp32"


def test_fp16_uses_a_grad_scaler(tmp_path, fp32_weights):
    result = run_train(*SHORT, "precision=fp16", run_dir=tmp_path / "fp16")
    assert read_summary(tmp_path / "fp16")["status"] == "completed"
    if "running bf16 instead" in result.stderr:
        pytest.skip("CPU autocast of this torch cannot do float16: labrun warned and ran bf16, "
                    "so there is no fp16 GradScaler to check")
    state = torch.load(tmp_path / "fp16/checkpoints/last.pt", weights_only=True)
    assert "scale" in state["scaler"], "the GradScaler was not enabled"
    assert 0 < state["scaler"]["scale"] <= 65536.0  # precision.init_scale, halved on overflow
    assert not same_weights(state["model"], fp32_weights), "fp16 trained exactly like fp32"


def test_test_split_is_evaluated_with_the_best_checkpoint(tmp_path):
    run_train("dataset=synthetic", "dataset.num_train=256", "dataset.num_val=64",
              "dataset.num_test=64", "trainer.max_epochs=2", run_dir=tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    # The synthetic classes differ by colour: the best checkpoint separates them well.
    assert 0.5 < summary["test/acc"] <= 1 and "test/loss" in summary


def test_init_from_loads_weights_only(digits_run, tmp_path):
    best = digits_run / "checkpoints" / "best.pt"
    result = run_train(f"model.init_from={best}", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=1", "optimizer.lr=1e-6",
                       run_dir=tmp_path / "finetune")
    summary = read_summary(tmp_path / "finetune")
    assert "resuming" not in result.stdout  # weights only: a new run, step 1
    assert summary["step"] == 1
    # Started from trained weights, it is as good as the run it came from after one tiny step.
    assert summary["val/acc"] > 0.5
    from_scratch = read_summary(digits_run)["val/acc"]
    assert abs(summary["val/acc"] - from_scratch) < 0.1


def test_a_terminal_gets_the_progress_bar(tmp_path):
    """trainer.progress=auto: rich's live bar on a TTY (a real pseudo-terminal here)."""
    import os
    import pty
    import re
    import subprocess

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([PYTHON, str(PROJECT / "train.py"), "logger=csv",
                             "dataset.num_workers=0", "trainer.max_epochs=1",
                             f"hydra.run.dir={tmp_path / 'tty'}"],
                            cwd=PROJECT, stdin=terminal, stdout=terminal, stderr=terminal,
                            env={**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"})
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    # The process has closed the terminal (the loop above ended): it is exiting, in moments;
    # 120 s is only a bound on a process stuck after closing it.
    assert proc.wait(timeout=120) == 0, shown.decode(errors="replace")[-2000:]
    text = shown.decode(errors="replace")
    assert "\x1b[?25l" in text and "━" in text  # a live display (cursor hidden) with a bar
    assert re.search(r" (\d+)/\1 ", text)  # N/N steps
    assert re.search(r"epoch 1/1 step \d+: val/loss", text)  # then the validation's line
    # In a pipe, the same setting prints lines: test_run_folders_started_together_...
