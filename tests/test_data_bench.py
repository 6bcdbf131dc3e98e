"""`labrun bench data` and `labrun bench trainer`, shrunk to smoke runs: every pipeline runs
and the JSON has the keys."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from conftest import run_labrun
from labrun.bench import generate_photos


def test_bench_data_measures_every_pipeline_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = run_labrun("bench", "data", "--images", "24", "--work-dir", str(tmp_path),
                        "--batch-size", "8", "--size", "64", "--seconds", "0.1", "--rounds", "1",
                        "--passes", "2", "--device", "cpu", "--json", str(out))
    figures = json.loads(out.read_text())
    assert set(figures) == {"baseline", "imagefolder", "hdf5", "ceiling", "speedup",
                            "of_ceiling"}
    assert all(value > 0 for value in figures.values())
    assert abs(figures["speedup"] - figures["hdf5"] / figures["baseline"]) < 0.01
    assert "speedup    (3/1)" in result.stdout and "of_ceiling (3/4)" in result.stdout
    assert "normalised floats on cpu" in result.stdout


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
    result = run_labrun("bench", "trainer", "--image-size", "32", "--batch-size", "4",
                        "--steps", "2", "--rounds", "1", "--json", str(out))
    figures = json.loads(out.read_text())
    assert figures["bare"] > 0 and figures["session"] > 0
    assert abs(figures["ratio"] - figures["session"] / figures["bare"]) < 1e-6
    assert "TrainingSession" in result.stdout
