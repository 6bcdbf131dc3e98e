"""Shared fixtures: the project's paths, a runner for the real `python train.py`, and trained
runs made once per test session and reused (training is the slow part)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
LABRUN = str(Path(PYTHON).with_name("labrun"))

# Fast, CPU-only, no W&B: the defaults of every test run unless a test says otherwise.
FAST = ["logger=csv", "trainer.progress=log", "dataset.num_workers=0"]


def run_train(*overrides: str, run_dir: Path | None = None, check: bool = True,
              env: dict[str, str] | None = None, timeout: int = 300
              ) -> subprocess.CompletedProcess:
    """Run the real `python train.py` with `overrides` (plus FAST, which overrides may change)."""
    args = [PYTHON, str(PROJECT / "train.py"), *FAST, *overrides]
    if run_dir is not None:
        args.append(f"hydra.run.dir={run_dir}")
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}"
                             f"\n{result.stderr[-3000:]}")
    return result


def start_train(*overrides: str, run_dir: Path, env: dict[str, str] | None = None,
                output=subprocess.PIPE) -> subprocess.Popen:
    """The real `python train.py` (FAST + overrides) in the background, for tests that stop it."""
    args = [PYTHON, str(PROJECT / "train.py"), *FAST, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(args, cwd=PROJECT, stdout=output, stderr=output, text=True,
                            env={**os.environ, **(env or {})})


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `path` exists; fails if the process ends first or time runs out."""
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            detail = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"run ended before {path.name}: {detail}")
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def run_labrun(*args: str, check: bool = True, timeout: int = 300, cwd: Path = PROJECT
               ) -> subprocess.CompletedProcess:
    result = subprocess.run([LABRUN, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"labrun {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory) -> Path:
    """A short real training run on the built-in digits data, shared by every test that only
    reads a finished run folder (contract, export, serve, compare...)."""
    run_dir = tmp_path_factory.mktemp("digits_run") / "run"
    run_train("trainer.max_epochs=3", "dataset.num_workers=2", run_dir=run_dir)
    return run_dir


# A deterministic run used as the reference for every resume and fault test: three short
# epochs of 22 steps, a checkpoint every 5 steps, 2 data workers.
DETERMINISTIC = ["trainer.max_epochs=3", "trainer.deterministic=true",
                 "checkpoint.every_n_steps=5", "dataset.num_workers=2"]


def final_weights(run_dir: Path) -> dict:
    import torch

    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_identical(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="session")
def reference_weights(tmp_path_factory) -> dict:
    """Final weights of an uninterrupted DETERMINISTIC run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_train(*DETERMINISTIC, run_dir=run_dir)
    return final_weights(run_dir)
