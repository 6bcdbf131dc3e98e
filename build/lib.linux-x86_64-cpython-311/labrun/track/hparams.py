"""TensorBoard HParams summaries of runs, written from labrun's own files (whatever logger the
runs used), for `labrun dashboard` on a grid sweep or a folder of runs:

    SWEEP/.dashboard/tensorboard/
      events.out.tfevents.*.labrun   the experiment: the keys that vary across the runs (with
                                     `status`) and the metrics best/<metric>, final/<metric>
      written.json                   what was written: {"keys", "metric", "runs": {name: stamp}}
      <run name>/events...           one session per run: its values of those keys, its status,
                                     best/ and final/<metric>, and metrics.jsonl's scalars

The folder is the dashboard's own, beside the runs, never inside a run folder (a running job
holds its run folder). A run whose files have not changed since they were written (its stamp:
summary.json's and metrics.jsonl's size and time) is skipped; when the varying keys or the
metric change, every run is written again.

tensorboard's own protos and record writer do the writing (summary_v2 builds the HParams protos
without TensorFlow); labrun only chooses what goes in.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from labrun.runs.rundir import ROW_BOOKKEEPING, RunDir, best_key, is_metric_value

if TYPE_CHECKING:
    from labrun.views.compare import Run

FOLDER = Path(".dashboard") / "tensorboard"
WRITTEN = "written.json"
STATUS = "status"  # labrun's run status, shown as one more hparam (pruned, failed...)


def hparam_value(text: str) -> float | str:
    """An override's value as TensorBoard should sort it: a number when it reads as one."""
    try:
        return float(text)
    except ValueError:
        return text


def metric_tags(metric: str) -> tuple[str, str]:
    """The tags of `metric`'s best and last value; the best as summary.json names it."""
    return best_key(metric), f"final/{metric}"


@dataclass
class Written:
    folder: Path
    keys: list[str]
    metric: str
    written: int = 0
    skipped: int = 0


def up_to_date(root: Path, run_paths: list[Path], metric: str | None) -> Written | None:
    """What was written, when it was written for exactly these runs as they are now (and for
    `metric`, when one is asked for): a second start then reads no run. None otherwise."""
    folder = root / FOLDER
    record = _read_record(folder)
    runs = record.get("runs") or {}
    if metric not in (None, record.get("metric")) or len(runs) != len(run_paths):
        return None
    for path in run_paths:
        if runs.get(str(path.relative_to(root))) != _stamp(path):
            return None
    return Written(folder, record["keys"], record["metric"], skipped=len(runs))


def write(root: Path, runs: list[Run], keys: list[str], metric: str) -> Written:
    """The experiment and one session per run under root/.dashboard/tensorboard/; runs already
    written with the same keys and metric are skipped."""
    folder = root / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    record = _read_record(folder)
    if record.get("keys") != keys or record.get("metric") != metric:
        for old in folder.iterdir():  # another experiment: every session again
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        record = {"keys": keys, "metric": metric, "runs": {}}
    names = {str(one.path.relative_to(root)) for one in runs}
    for gone in set(record["runs"]) - names:  # a run folder removed since: its session too
        shutil.rmtree(folder / gone, ignore_errors=True)
        del record["runs"][gone]
    numeric = numeric_keys(runs, keys)
    _write_experiment(folder, runs, keys, numeric, metric)
    result = Written(folder, keys, metric)
    for one in runs:
        name = str(one.path.relative_to(root))
        stamp = _stamp(one.path)
        if record["runs"].get(name) == stamp:
            result.skipped += 1
            continue
        session = folder / name
        if session.exists():
            shutil.rmtree(session)
        _write_session(session, one, session_hparams(one, keys, numeric), metric)
        record["runs"][name] = stamp
        result.written += 1
    (folder / WRITTEN).write_text(json.dumps(record))
    return result


def numeric_keys(runs: list[Run], keys: list[str]) -> set[str]:
    """The keys whose every value reads as a number: one type a key, as TensorBoard wants."""
    return {key for key in keys
            if all(isinstance(hparam_value(one.overrides[key]), float)
                   for one in runs if key in one.overrides)}


def session_hparams(run: Run, keys: Iterable[str], numeric: set[str]) -> dict[str, float | str]:
    values: dict[str, float | str] = {
        key: hparam_value(run.overrides[key]) if key in numeric else run.overrides[key]
        for key in keys if key in run.overrides}
    values[STATUS] = run.status
    return values


def _read_record(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / WRITTEN).read_text())
    except (OSError, ValueError):
        return {}


def _stamp(path: Path) -> list[int]:
    folder = RunDir(path)
    stamp = []
    for file in (folder.summary_path, folder.metrics_path):
        try:
            info = file.stat()
            stamp += [info.st_size, info.st_mtime_ns]
        except FileNotFoundError:
            stamp += [-1, -1]
    return stamp


def _write_experiment(folder: Path, runs: list[Run], keys: list[str], numeric: set[str],
                      metric: str) -> None:
    from tensorboard.plugins.hparams import summary_v2 as hp

    hparams = []
    for key in [*keys, STATUS]:
        values = {session_hparams(one, [key], numeric).get(key) for one in runs} - {None}
        if key in numeric and len(values) > 1:
            hparams.append(hp.HParam(key, hp.RealInterval(min(values), max(values))))
        else:
            hparams.append(hp.HParam(key, hp.Discrete(sorted(values))))
    for old in folder.glob("events.out.tfevents.*"):
        old.unlink()
    summary = hp.hparams_config_pb(hparams, [hp.Metric(tag) for tag in metric_tags(metric)])
    _write_events(folder, [(0, summary)])


def _write_session(session: Path, run: Run, hparams: dict[str, float | str],
                   metric: str) -> None:
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import summary_v2 as hp

    events: list[tuple[int, Any]] = [(0, hp.hparams_pb(hparams, trial_id=run.name))]
    last_step = 0
    for row in run.history:
        step = row.get("step")
        scalars = [Summary.Value(tag=tag, simple_value=float(value))
                   for tag, value in row.items()
                   if tag not in ROW_BOOKKEEPING and is_metric_value(value)]
        if scalars and isinstance(step, int):
            events.append((step, Summary(value=scalars)))
            last_step = max(last_step, step)
    values = [Summary.Value(tag=tag, simple_value=float(value))
              for tag, value in zip(metric_tags(metric), (run.best, run.final), strict=True)
              if value is not None]
    if values:
        events.append((last_step, Summary(value=values)))
    _write_events(session, events)


def _write_events(folder: Path, summaries: list[tuple[int, Any]]) -> None:
    """One event file: the version record TensorBoard expects first, then the summaries."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    with open(folder / f"events.out.tfevents.{int(now)}.labrun", "wb") as f:
        writer = RecordWriter(f)
        writer.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        for step, summary in summaries:
            writer.write(Event(wall_time=now, step=step, summary=summary).SerializeToString())
