"""How well a run uses its hardware, from its own folder: its rate (in its task's unit: images/s,
tokens/s, else samples/s), the fraction of time it waits for data, GPU utilisation, and a
verdict with what to change (`labrun status`).

The figures are metrics.jsonl's train points. Each covers the steps since the point before it
(train/progress.py, StepWindow): the rate (`perf/tokens_per_s`, `perf/images_per_s` or
`perf/samples_per_s`, over all ranks),
`perf/data_wait_frac` (rank 0's host time blocked on the loader) and, when NVML saw the node's
GPUs, `perf/gpu_util` (0..1, mean over the run's GPUs on rank 0's node).

Which points: those of the latest epoch that has any, without that epoch's first window when
the epoch has later ones.
  - The latest epoch: status is about now. A running job shows its current rate, an ended one
    its last epoch's, after the first epoch's warm-up (cuDNN autotuning, allocator, compiling).
  - Not its first window: it includes creating the loader's iterator (workers start or refill
    their prefetch queues, and the first batch's whole latency counts as waiting), which the
    epoch's other windows do not. An epoch with a single point keeps it: it is all there is.
Windows are weighed by how long they lasted (their images / their images per second), so the
figures are what one window over the same steps would have measured; a short last window of an
epoch counts for its few steps, not as much as a full one.

Thresholds are the run's own config keys, `monitor.data_bound_wait_frac`,
`monitor.gpu_idle_util` and `monitor.gpu_good_util`, read from its saved config; a run saved
before they existed gets the schema's defaults (MonitorConfig). The GPU bands are the lab
guide's: under 30% busy the GPUs are idle, from there to 70% underused, above it healthy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from labrun.config.schema import MonitorConfig
from labrun.runs.rundir import RunDir, is_metric_value

# The metric a run's rate is read from, with its unit: the first of these its points log (its
# task's unit, else samples).
RATES = (("perf/tokens_per_s", "tok/s"), ("perf/images_per_s", "img/s"),
         ("perf/samples_per_s", "samples/s"))
DATA_WAIT_FRAC = "perf/data_wait_frac"
GPU_UTIL = "perf/gpu_util"

# For runs whose saved config predates the keys: today's defaults.
DEFAULT_THRESHOLDS = {name: getattr(MonitorConfig(), name)
                      for name in ("data_bound_wait_frac", "gpu_idle_util", "gpu_good_util")}

# Verdicts
DATA_BOUND = "data-bound"
GPU_IDLE = "GPU idle"
UNDERUSED = "underused"
HEALTHY = "healthy"
NO_DATA = "no data yet"

# The image-folder loader, by the name it has, and by the one runs written before
# labrun.data.image had (their config keeps it).
IMAGEFOLDER_TARGETS = ("labrun.data.image.imagefolder.load", "labrun.data.imagefolder.load")


@dataclass
class Efficiency:
    rate: float | None  # in `unit`
    unit: str  # tok/s | img/s | samples/s
    data_wait_frac: float | None
    gpu_util: float | None  # None: not measured (no GPU, or no NVML on the node)
    verdict: str  # DATA_BOUND | GPU_IDLE | UNDERUSED | HEALTHY | NO_DATA
    reason: str | None  # what the figures say ("waits 62% of the time for data")
    fix: str | None  # what to change; None when nothing needs to
    thresholds: dict[str, float]
    points: int  # train points the figures come from

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(run_dir: RunDir) -> Efficiency:
    """The run's figures and verdict, from its metrics.jsonl and saved config."""
    config = _saved_config(run_dir)
    thresholds = {name: _number(config, f"monitor.{name}", default)
                  for name, default in DEFAULT_THRESHOLDS.items()}
    rows = run_dir.read_metrics()
    key, unit = next(((key, unit) for key, unit in RATES if any(key in row for row in rows)),
                     RATES[1])
    points = steady_points(rows, key)
    rate, data_wait, gpu_util = aggregate(points, key)
    verdict, reason, fix = judge(rate, data_wait, gpu_util, thresholds, config)
    return Efficiency(rate, unit, data_wait, gpu_util, verdict, reason, fix, thresholds,
                      len(points))


def steady_points(rows: list[dict[str, Any]], rate: str) -> list[dict[str, Any]]:
    """The train points the figures come from (see the module's docstring), each with
    "_steps": the optimizer steps its window covered; `rate`: the metric of the run's rate."""
    train = [row for row in rows if is_metric_value(row.get(rate))
             and is_metric_value(row.get(DATA_WAIT_FRAC))]
    if not train:
        return []
    latest = max(row.get("epoch", 0) for row in train)
    previous_step = {id(b): a.get("step", 0) for a, b in zip(train, train[1:], strict=False)}
    chosen = [row for row in train if row.get("epoch", 0) == latest]
    if len(chosen) > 1:
        chosen = chosen[1:]
    return [{**row, "_steps": max(row.get("step", 0) - previous_step.get(id(row), 0), 1)}
            for row in chosen]


def aggregate(points: list[dict[str, Any]], rate: str
              ) -> tuple[float | None, float | None, float | None]:
    """(the rate, data-wait fraction, GPU utilisation) over the points' windows, each window
    weighed by its duration; GPU utilisation over the windows that have it (None: none)."""
    if not points:
        return None, None, None
    # A window in which no step finished (every loss non-finite) has no rate to derive its
    # length from: it is left out, unless it is all there is.
    timed = [p for p in points if p[rate] > 0]
    if not timed:
        return 0.0, sum(p[DATA_WAIT_FRAC] for p in points) / len(points), None
    # Durations in units of "one step's items" (the batch's, the same for every window).
    durations = [p["_steps"] / p[rate] for p in timed]
    total = sum(durations)
    per_s = sum(p["_steps"] for p in timed) / total
    data_wait = sum(p[DATA_WAIT_FRAC] * d for p, d in zip(timed, durations, strict=True)) / total
    gpu = [(p[GPU_UTIL], d) for p, d in zip(timed, durations, strict=True)
           if is_metric_value(p.get(GPU_UTIL))]
    gpu_util = sum(u * d for u, d in gpu) / sum(d for _, d in gpu) if gpu else None
    return per_s, data_wait, gpu_util


def judge(rate: float | None, data_wait: float | None, gpu_util: float | None,
          thresholds: dict[str, float], config: DictConfig | None
          ) -> tuple[str, str | None, str | None]:
    """(verdict, reason, fix). Data comes first: GPUs that wait for data are idle because of
    it, and more batch per step would only wait longer."""
    if rate is None or data_wait is None:
        return NO_DATA, None, None
    if data_wait > thresholds["data_bound_wait_frac"]:
        return DATA_BOUND, f"waits {data_wait:.0%} of the time for data", _data_fix(config)
    if gpu_util is not None and gpu_util < thresholds["gpu_idle_util"]:
        return (GPU_IDLE, f"GPUs busy {gpu_util:.0%} of the time, not waiting for data",
                f"raise trainer.batch_size{_now(config, 'trainer.batch_size')} so each step "
                f"gives the GPUs more work, or look for host work in the step (CPU-side "
                f"transforms, .item() syncs, tiny kernels of a small model)")
    if gpu_util is not None and gpu_util < thresholds["gpu_good_util"]:
        return (UNDERUSED, f"GPUs busy {gpu_util:.0%} of the time, under "
                           f"{thresholds['gpu_good_util']:.0%}, not waiting for data",
                _underused_fix(config))
    return HEALTHY, None, None


def _now(config: DictConfig | None, key: str) -> str:
    """" (now VALUE)" of the run's own `key`, or "" where its config does not say."""
    value = _select(config, key)
    return f" (now {value:g})" if is_metric_value(value) else ""


def _underused_fix(config: DictConfig | None) -> str:
    """What to change, in the run's own settings: more work a step, then less time a step."""
    fixes = [f"raise trainer.batch_size{_now(config, 'trainer.batch_size')}"]
    precision = _select(config, "precision.name")
    if precision == "fp32":
        fixes.append("train in precision=bf16 (now fp32)")
    if _select(config, "trainer.compile") is False:
        fixes.append("try trainer.compile=true (now false)")
    if _select(config, "trainer.channels_last") is False:
        fixes.append("trainer.channels_last=true for a convolutional model (now false)")
    return ", ".join(fixes[:-1]) + f" or {fixes[-1]}" if len(fixes) > 1 else fixes[0]


def _data_fix(config: DictConfig | None) -> str:
    workers = _number(config, "dataset.num_workers", None)
    if workers is None:
        fix = "raise dataset.num_workers"
    elif workers == 0:
        fix = "raise dataset.num_workers (now 0: the training process loads every batch itself)"
    else:
        fix = f"raise dataset.num_workers (now {workers:g})"
    if _select(config, "dataset._target_") in IMAGEFOLDER_TARGETS:
        root = _select(config, "dataset.root")
        root = root if isinstance(root, str) else "ROOT"  # unknown here: the placeholder
        fix += (f" or convert the folder to HDF5 (labrun convert {root} OUT.h5, then train "
                f"with dataset=hdf5 dataset.path=OUT.h5)")
    return fix


def _saved_config(run_dir: RunDir) -> DictConfig | None:
    try:
        return run_dir.saved_config_node()
    except (OSError, yaml.YAMLError):  # copied half-way: the figures, with default thresholds
        return None


def _select(config: DictConfig | None, key: str) -> Any:
    if config is None:
        return None
    # Saved configs are unresolved: an interpolation that cannot resolve here (`${hydra:...}`,
    # an environment variable of the run's node) reads as unknown, not as an error.
    return OmegaConf.select(config, key, default=None, throw_on_resolution_failure=False)


def _number(config: DictConfig | None, key: str, default: float | None) -> float | None:
    value = _select(config, key)
    return value if is_metric_value(value) else default
