"""The default job trains a few steps, with this project's model and data."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from {{package}}.model import Net

ROOT = Path(__file__).resolve().parents[1]


def test_the_model_answers_a_batch():
    assert Net(num_classes=3)(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


def test_the_default_job_trains(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "train.py", "trainer.max_steps=3", "logger=csv",
                             "trainer.max_epochs=null", f"hydra.run.dir={run}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["step"]) == ("completed", 3)
