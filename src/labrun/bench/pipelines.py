"""What the data benchmarks of one task against torchvision share (seg_data.py, det_data.py):
three loaders raced in interleaved rounds, torchvision's, labrun's on a folder and labrun's on
its HDF5 file, and the table of their images/s with the two ratios."""

from __future__ import annotations

import logging
from collections.abc import Callable

from labrun.bench.data import measure_loader

log = logging.getLogger(__name__)


def race(pipelines: dict[str, Callable], rounds: int, seconds: float) -> dict[str, float]:
    """Each pipeline's best images/s over `rounds` interleaved rounds (measure_loader: whole
    epochs for at least `seconds` after a warm-up one), so a burst of load elsewhere costs
    each pipeline a round, not its figure."""
    results = dict.fromkeys(pipelines, 0.0)
    for round_number in range(rounds):
        for name, make_loader in pipelines.items():
            results[name] = max(results[name], measure_loader(make_loader, None, seconds))
            log.info(f"  round {round_number + 1}: {name:<12} {results[name]:8.0f} "
                     f"images/s (best so far)")
    return results


def with_ratios(results: dict[str, float], folder: str, file: str) -> dict[str, float]:
    """speedup (labrun's folder over torchvision) and hdf5_speedup (its file over torchvision)."""
    return {**results, "speedup": results[folder] / results["torchvision"],
            "hdf5_speedup": results[file] / results["torchvision"]}


def print_results(console, results: dict[str, float], title: str, rows: dict[str, str]) -> None:
    """The table of images/s, a row per pipeline in `rows` (name -> label), and both ratios."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("pipeline")
    table.add_column("images/s", justify="right")
    for key, label in rows.items():
        table.add_row(label, f"{results[key]:.0f}")
    console.print(table)
    console.print(f"speedup      (2/1): {results['speedup']:.2f}\n"
                  f"hdf5_speedup (3/1): {results['hdf5_speedup']:.2f}  (reported; no target)",
                  highlight=False)
