"""Prometheus service discovery for the runs that train now: `labrun monitor targets`.

A training run describes each node's metrics endpoint in `RUN/monitor/node-<N>.json` (written
by labrun.monitoring.metrics_endpoint; the format is in docs/ARCHITECTURE.md). This module finds
those files under some roots, keeps the runs whose run-folder lock is held by a live process,
and writes Prometheus's file-based service discovery format (file_sd):

    [{"targets": ["ADDR:PORT"], "labels": {"run": "...", ..., "node_rank": "0"}}, ...]

Liveness is the lock's own judgement of a holder (runs/lock_holder.py's live_holder, judged as
a claimant would: stale_reason), the one a second writer gets: a run listed here is one that
`python train.py` would refuse to train into.
An ended run has released its lock (or its holder is gone), so it leaves the list at the next
refresh, even if its node file stayed behind (a killed run cannot remove it).

The file is replaced atomically (core.files): Prometheus watches it and must never read half
of it. Only `*.json` names are read by file_sd, and the temporary name ends in `.tmp`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrun.core.files import write_json_atomic
from labrun.runs.lock_holder import Holder, live_holder
from labrun.runs.rundir import RUN_MARKERS, RunDir

log = logging.getLogger(__name__)

# A node file older than its run's lock by more than this was left by an earlier attempt of
# the run (one killed before it could remove it): the node writes its file after the lock is
# taken, so only clock skew between nodes (NTP: well under a second) can put it earlier.
NODE_FILE_SKEW_S = 60.0
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclass(frozen=True)
class Target:
    run_dir: Path
    address: str  # "HOST:PORT", what Prometheus scrapes
    metrics_path: str
    labels: dict[str, str]

    def file_sd(self) -> dict[str, Any]:
        labels = dict(self.labels)
        if self.metrics_path != "/metrics":  # Prometheus's default path needs no label
            labels["__metrics_path__"] = self.metrics_path
        return {"targets": [self.address], "labels": labels}


def run_folders(roots: Iterable[str | Path]) -> Iterator[Path]:
    """Run folders under `roots` (a root may itself be a run folder), each once. Hidden folders
    are not entered: `labrun monitor up` keeps Prometheus's storage in OUTPUT_ROOT/.prometheus."""
    seen: set[str] = set()
    for root in roots:
        for folder, subfolders, files in os.walk(root):
            names = set(subfolders) | set(files)
            # A run folder (RunDir's RUN_MARKERS): checked, and not descended further (a run's
            # checkpoints/, wandb/ ... hold no runs).
            if any(marker in names for marker in RUN_MARKERS):
                subfolders[:] = []
                key = os.path.realpath(folder)
                if key not in seen:
                    seen.add(key)
                    yield Path(folder)
            else:
                subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))


def _label_value(value: Any) -> str:
    return "" if value is None else str(value)


def node_target(run_dir: Path, node: dict[str, Any], holder: Holder) -> Target | None:
    """The target one node description describes; None (with a log line) for one that is no
    endpoint description or that an earlier attempt of the run left behind."""
    try:
        address, port = str(node["address"]), int(node["port"])
        url = str(node.get("url") or "")
    except (ValueError, TypeError, KeyError) as error:
        log.warning("%s: a monitor/ file is no metrics endpoint description (%s); skipped",
                    run_dir, error)
        return None
    started = node.get("started_at")
    if isinstance(started, int | float) and started < holder.started_at - NODE_FILE_SKEW_S:
        log.info("%s: node %s's monitor/ file was left by an earlier attempt; skipped",
                 run_dir, node.get("node_rank"))
        return None
    labels = {key: _label_value(value) for key, value in (node.get("labels") or {}).items()
              if isinstance(key, str) and _LABEL_NAME.fullmatch(key)
              and not key.startswith("__")}
    labels["node_rank"] = _label_value(node.get("node_rank"))
    path = "/metrics"
    if "://" in url:
        rest = url.split("://", 1)[1]
        path = "/" + rest.split("/", 1)[1] if "/" in rest else "/metrics"
    host = f"[{address}]" if ":" in address else address  # an IPv6 address
    return Target(run_dir, f"{host}:{port}", path, labels)


def discover(roots: Iterable[str | Path]) -> list[Target]:
    """One target per node description of every run under `roots` that trains now."""
    targets = []
    for run_dir in run_folders(roots):
        folder = RunDir(run_dir)
        nodes = folder.monitor_endpoints()
        if not nodes:
            continue
        holder = live_holder(folder.lock_path)
        if holder is None:
            continue
        for node in nodes:
            target = node_target(run_dir, node, holder)
            if target is not None:
                targets.append(target)
    return targets


def write_file_sd(targets: list[Target], out: str | Path) -> bool:
    """Write `targets` to `out` in file_sd format, atomically; False when the file already
    held exactly this (no rewrite: Prometheus re-reads the file on every change)."""
    out = Path(out)
    data = [target.file_sd() for target in targets]
    try:
        if json.loads(out.read_text()) == data:
            return False
    except (OSError, ValueError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, data)
    return True
