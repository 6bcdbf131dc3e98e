"""`labrun bench <name>`: benchmarks that print side-by-side figures and ratios.

    labrun bench data [--root DIR] [--images N] [--json FILE] [--check]
    labrun bench seg-data [--images N]  segmentation pairs: labrun vs torchvision v2 (seg_data.py)
    labrun bench det-data [--images N]  detection images with boxes: labrun vs torchvision v2
                                      (det_data.py)
    labrun bench det-map [--images N]   COCO mAP: labrun's evaluator vs pycocotools (det_map.py)
    labrun bench trainer | startup | serve      (trainer.py, serve.py)
    labrun bench sweep [--jobs N]     submitting a held SLURM sweep (sweep.py)
    labrun bench dashboard [--runs N] compare and dashboard on N synthetic runs (dashboard.py)
    labrun bench all [--check] [--skip NAME]   every benchmark with its defaults (`make bench`)

Each benchmark is a configure(parser) + run(args) pair, named in BENCHES by module and
function, so a new one joins with one line and without touching the others. run(args) returns
judge(...) of its figures against its targets, which each module states once, in a *_TARGETS
constant: a Target's floor (required: set from runs of the benchmark on this project's machine,
which it records, minus a margin) and goal (the stretch figure), and its `of`, the measured and
baseline figures it compares. report() prints one table of every verdict (figure, measured,
baseline, value, floor, goal, the distance to the goal, the runs that set the floor, met or NOT
met on the floor; `all` prints one table for every benchmark at the end), and with --check
exits 1 when a required floor is broken (one line per miss: benchmark, figure, measured, floor
and goal). A benchmark that cannot run here returns unmeasured(...) verdicts: a required floor
with no figure is a miss, with its reason; `bench all --skip NAME` leaves it out, and the
summary says so. The README's Benchmarks section lists every target's floor and goal.

The data benchmark is data.py; the `labrun bench` command's arguments are labrun.cli.bench.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from labrun.bench.targets import Target, Verdict, judge, report, unmeasured  # noqa: F401 - re-exported


def write_json(path: str | os.PathLike | None, figures: dict) -> None:
    """--json FILE: the figures of a benchmark, for scripts and CI to read."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")


def bench(name: str) -> tuple[Callable, Callable]:
    """(configure, run) of benchmark `name`, importing its module only now."""
    module_name, prefix, _ = BENCHES[name]
    module = importlib.import_module(module_name)
    return getattr(module, f"configure{prefix}"), getattr(module, f"run{prefix}")


# name -> (module, suffix of its configure<suffix>/run<suffix> functions, one-line help)
BENCHES: dict[str, tuple[str, str, str]] = {
    "data": ("labrun.bench.data", "_data",
             "data loading: torchvision baseline vs labrun imagefolder and hdf5 vs a ceiling"),
    "seg-data": ("labrun.bench.seg_data", "_seg_data",
                 "segmentation data loading: torchvision v2 on (Image, Mask) vs labrun "
                 "segfolder, seg_hdf5 beside it"),
    "det-data": ("labrun.bench.det_data", "_det_data",
                 "detection data loading: torchvision v2 on (Image, BoundingBoxes) vs labrun "
                 "yolo folder (no mosaic), det_hdf5 beside it"),
    "det-map": ("labrun.bench.det_map", "_det_map",
                "COCO box mAP of the same detections: labrun's evaluator (faster-coco-eval) vs "
                "pycocotools' COCOeval"),
    "trainer": ("labrun.bench.trainer", "_trainer",
                "Trainer vs a bare PyTorch loop on the same batches"),
    "startup": ("labrun.bench.trainer", "_startup",
                "python train.py to its first step vs importing torch"),
    "serve": ("labrun.bench.serve", "",
              "POST /predict through `labrun serve` (dynamic batching) vs the bare runtime's "
              "ceiling and vs --max-batch 1"),
    "sweep": ("labrun.bench.sweep", "",
              "submitting a held SLURM sweep of N jobs: ms a job vs Hydra's per-job compose, "
              "SLURM queries a polling pass"),
    "dashboard": ("labrun.bench.dashboard", "",
                  "a large sweep's results: labrun compare, the first and a second labrun "
                  "dashboard start, on N synthetic runs"),
}
