"""`labrun bench data`, `labrun bench trainer` and `labrun bench startup`, shrunk to smoke runs:
every pipeline runs, the JSON has the keys, the verdict table shows each target's floor and
goal, and --check's exit status agrees with the measured figures (whatever they are on this
machine: speed is never asserted here). `labrun bench sweep`'s: tests/test_sweep_scale.py."""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from PIL import Image

from conftest import run_labrun
from labrun.bench.data import (
    DATA_TARGETS,
    baseline_loader,
    generate_photos,
    labrun_data,
    labrun_loader,
    seconds_per_sample,
)
from labrun.bench.targets import number
from labrun.bench.trainer import STARTUP_TARGETS, TRAINER_TARGETS
from labrun.data.image.transforms import TrainTransform

SMALL = argparse.Namespace(size=64, workers=2, passes=2, batch_size=8)  # labrun_data's args


def test_bench_data_measures_every_pipeline_and_writes_json(tmp_path):
    """With --decode-device cpu: labrun's pipelines decode batches in the main process (the
    default, workers, is what the tests below build)."""
    out = tmp_path / "bench.json"
    result = run_labrun("bench", "data", "--images", "24", "--work-dir", str(tmp_path),
                        "--batch-size", "8", "--size", "64", "--seconds", "0.1", "--rounds", "1",
                        "--passes", "2", "--device", "cpu", "--decode-device", "cpu",
                        "--json", str(out), "--check", check=False)
    figures = json.loads(out.read_text())
    assert set(figures) == {"baseline", "imagefolder", "hdf5", "ceiling", "speedup",
                            "of_ceiling"}
    assert all(value > 0 for value in figures.values())
    assert abs(figures["speedup"] - figures["hdf5"] / figures["baseline"]) < 0.01
    assert "speedup    (3/1)" in result.stdout and "of_ceiling (3/4)" in result.stdout
    assert "can exceed 1" in result.stdout  # of_ceiling is not a fraction
    assert "normalised floats on cpu" in result.stdout
    assert "labrun hdf5 + batched decode_jpeg on cpu" in result.stdout
    assert "resnet50" not in figures  # timed only on a GPU
    # --check: exit 1 exactly when a required target is missed by the figures it wrote. The
    # JSON rounds them to 3 places: a figure that close to its floor may fall either way.
    required = [t for t in DATA_TARGETS if t.required]
    unsure = {t.figure for t in required if abs(figures[t.figure] - t.floor) <= 5e-4}
    missed = [t.figure for t in required if not t.met(figures[t.figure])]
    said = [line.split(":")[1].strip() for line in result.stdout.splitlines()
            if line.startswith("target missed:")]
    assert [m for m in said if m.removeprefix("data ") not in unsure] == \
        [f"data {figure}" for figure in missed if figure not in unsure]
    if not unsure:
        assert result.returncode == (1 if missed else 0), result.stdout + result.stderr


def test_the_baseline_loader_has_labrun_loader_settings(tmp_path):
    root = generate_photos(tmp_path, 12)
    labrun = labrun_loader(labrun_data({"name": "imagefolder", "root": str(root)}, SMALL),
                           SMALL, torch.device("cpu"))
    settings = {"persistent_workers": labrun.persistent_workers,
                "prefetch_factor": labrun.prefetch_factor, "pin_memory": labrun.pin_memory}
    assert settings["persistent_workers"]  # labrun's loader keeps its workers between epochs
    baseline = baseline_loader(root / "train", SMALL.size, SMALL.batch_size, SMALL.workers,
                               SMALL.passes, **settings)
    assert (baseline.persistent_workers, baseline.prefetch_factor, baseline.pin_memory) == \
        tuple(settings.values())
    assert baseline.num_workers == labrun.num_workers


def test_the_ceiling_times_labrun_own_per_sample_work(tmp_path, monkeypatch):
    """The ceiling runs the train transform (decode of the crop, resize, flip) on every
    sample, not a bare full-size decode."""
    root = generate_photos(tmp_path, 12)
    data = labrun_data({"name": "imagefolder", "root": str(root)}, SMALL)
    calls = []
    transform = TrainTransform.__call__

    def counted(self, image, rng):
        calls.append(image)
        return transform(self, image, rng)

    monkeypatch.setattr(TrainTransform, "__call__", counted)
    seconds = seconds_per_sample(data, 0)
    assert seconds > 0
    assert len(calls) >= len(data.splits["train"])  # every sample at least once, after warm-up


def test_generated_photos_are_cached_deterministic_and_photo_sized(tmp_path):
    root = generate_photos(tmp_path / "a", 12)
    again = generate_photos(tmp_path / "b", 12)
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 12 + 10 and (root / ".complete").exists()
    assert generate_photos(tmp_path / "a", 12) == root  # cached: not made again
    for path in files[:4]:
        assert path.read_bytes() == (again / path.relative_to(root)).read_bytes()
        image = np.asarray(Image.open(path))
        assert all(256 <= side <= 512 for side in image.shape[:2])
        assert image.std() > 20  # content, not a flat colour


def test_bench_trainer_runs_the_session_and_the_bare_loop_on_the_same_batches(tmp_path):
    out = tmp_path / "trainer.json"
    rounds = 2
    result = run_labrun("bench", "trainer", "--image-size", "32", "--batch-size", "4",
                        "--steps", "2", "--rounds", str(rounds), "--json", str(out), "--check",
                        check=False)
    figures = json.loads(out.read_text())
    # Both tasks: classification in images/s, task=lm in tokens/s.
    for bare, session, ratio in (("bare", "session", "ratio"),
                                 ("lm_bare", "lm_session", "lm_ratio")):
        assert figures[bare] > 0 and figures[session] > 0
        assert abs(figures[ratio] - figures[session] / figures[bare]) < 1e-6
    assert "Trainer" in result.stdout and "nanoGPT's loop" in result.stdout
    # The session's side logs as a real run does: each whole epoch ends with a logged point.
    assert figures["metrics_rows"] >= rounds
    missed = [target.figure for target in TRAINER_TARGETS if not target.met(figures[target.figure])]
    assert result.returncode == (1 if missed else 0), result.stderr
    for target in TRAINER_TARGETS:
        shown = f"target missed: trainer {target.figure}:" in result.stdout
        assert shown == (target.figure in missed), target.figure


def test_bench_startup_times_a_real_run_to_its_first_step_against_the_import(tmp_path):
    """One repeat (make bench takes the best of three): `python train.py` to its first step
    and the baseline process, both for real; the ratio, the table and --check's verdict."""
    out = tmp_path / "startup.json"
    result = run_labrun("bench", "startup", "--repeats", "1", "--json", str(out), "--check",
                        check=False)
    assert out.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["baseline_s"] > 0 and figures["first_step_s"] > 0
    assert abs(figures["startup_ratio"] - figures["first_step_s"] / figures["baseline_s"]) < 1e-9
    assert "python train.py to its first step" in result.stdout
    for target in STARTUP_TARGETS:
        (row,) = [line for line in result.stdout.splitlines()
                  if f" startup {target.figure} " in line]
        assert f"{target.op} {target.floor:g}" in row and f"{target.op} {target.goal:g}" in row
        assert f"first_step_s {number(figures['first_step_s'])}" in row
    missed = [t.figure for t in STARTUP_TARGETS if not t.met(figures[t.figure])]
    assert result.returncode == (1 if missed else 0), result.stdout[-3000:] + result.stderr
    assert [line.split(":")[1].strip() for line in result.stdout.splitlines()
            if line.startswith("target missed:")] == [f"startup {figure}" for figure in missed]
