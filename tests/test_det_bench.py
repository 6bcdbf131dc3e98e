"""`labrun bench det-data` and `labrun bench det-map` shrunk to smoke runs (speed is never
asserted here), in this process: a subprocess would double their time."""

from __future__ import annotations

import json

import pytest

from labrun import cli
from labrun.bench.det_data import DET_DATA_TARGETS, FOLDER_VERSION
from labrun.bench.det_map import DET_MAP_TARGETS, check_agree
from labrun.core.errors import LabrunError


def bench_row(out: str, name: str) -> str:
    (row,) = [line for line in out.splitlines() if f" {name} speedup " in line]
    return row


def test_bench_det_data_runs_end_to_end_and_reports_the_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "det-data", "--images", "6", "--width", "96", "--height", "64",
                     "--size", "32", "--batch-size", "4", "--workers", "1", "--passes", "1",
                     "--seconds", "0.05", "--rounds", "1", "--work-dir", str(tmp_path),
                     "--json", str(out), "--check"])
    stdout = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert set(figures) == {"torchvision", "yolo", "det_hdf5", "speedup", "hdf5_speedup"}
    assert all(value > 0 for value in figures.values())
    assert abs(figures["speedup"] - figures["yolo"] / figures["torchvision"]) < 0.01
    assert "speedup      (2/1)" in stdout and "(reported; no target)" in stdout
    (target,) = DET_DATA_TARGETS
    row = bench_row(stdout, "det-data")
    assert f">= {target.floor:g}" in row and f">= {target.goal:g}" in row  # floor and goal
    # --check: exit 1 exactly when the target is missed by the figures it wrote.
    assert code == (0 if target.met(figures["speedup"]) else 1), stdout
    folder = tmp_path / f"det-yolo-v{FOLDER_VERSION}-n6-96x64-seed0"
    assert (tmp_path / f"{folder.name}.h5").is_file()
    assert len(list((folder / "labels" / "train").glob("*.txt"))) == 6


def test_bench_det_map_runs_end_to_end_and_both_evaluators_agree(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "det-map", "--images", "20", "--classes", "3", "--detections",
                     "10", "--rounds", "1", "--json", str(out), "--check"])
    stdout = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert set(figures) == {"pycocotools", "labrun", "map", "map_50", "speedup"}
    assert 0 < figures["map"] <= figures["map_50"] <= 1  # found boxes near the truth score
    assert figures["speedup"] == pytest.approx(figures["pycocotools"] / figures["labrun"],
                                               rel=0.01)
    (target,) = DET_MAP_TARGETS
    row = bench_row(stdout, "det-map")
    assert f">= {target.floor:g}" in row and f">= {target.goal:g}" in row
    assert code == (0 if target.met(figures["speedup"]) else 1), stdout
    assert "Accumulating" not in stdout and "Average Precision" not in stdout  # one table
    with pytest.raises(LabrunError, match=r"disagree: mAP@\.5 "):
        check_agree({"labrun": (0.5, 0.6), "pycocotools": (0.5, 0.6 + 1e-5)})
