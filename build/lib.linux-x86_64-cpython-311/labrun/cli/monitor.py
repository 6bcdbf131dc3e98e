"""`labrun monitor targets`, `labrun monitor queue` and `labrun monitor up`: Prometheus for
labrun's runs and for the cluster's queue.

The arguments and the refresh loop; discovery is labrun.monitoring.targets's, the queue exporter
labrun.monitoring.queue_exporter's, the Prometheus process labrun.monitoring.prometheus's, and the
shipped configuration is in monitoring/ (docs/monitoring.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from labrun.core.errors import LabrunError

log = logging.getLogger(__name__)

TARGETS_HELP = """\
Writes Prometheus file-based service discovery (file_sd) for the runs under ROOTS that train
now: one target per node endpoint (RUN/monitor/node-N.json), labelled with the run's labels
and node_rank. A run counts as training when its folder's lock is held by a live process,
judged exactly as a second `python train.py` on that folder would judge it.

examples:
  labrun monitor targets --out /etc/prometheus/targets/labrun.json
  labrun monitor targets /nfs/outputs /nfs/multirun --out targets/labrun.json --watch 30
"""

QUEUE_HELP = """\
Serves the SLURM queue as the lab sees it on GET /metrics: jobs pending (held ones too) and
running, the GPUs they ask for or hold, each partition's oldest pending job's wait, fair share,
nodes down or drained; labelled by partition, account, user and QOS, never by job. SLURM is
asked at most once every --cache seconds (one squeue, sshare and sinfo), however often it is
scraped; a controller that does not answer gives labrun_queue_up 0.
"""

UP_HELP = """\
Starts Debian's prometheus on 127.0.0.1 with monitoring/prometheus.yml and rules.yml, its
labrun job fed from a target file this command rewrites every --refresh seconds, storing in
OUTPUT_ROOT/.prometheus/. Where a SLURM cluster answers, it also serves the queue exporter
(`labrun monitor queue`) on a free port of 127.0.0.1 and scrapes it. Prints its URL; Ctrl-C
stops it.
"""


def default_roots() -> list[Path]:
    """Where runs land by default: paths.output_root and paths.multirun_root, which
    conf/paths/default.yaml reads from the same variables."""
    return [Path(os.environ.get("LABRUN_OUTPUT_ROOT", "outputs")),
            Path(os.environ.get("LABRUN_MULTIRUN_ROOT", "multirun"))]


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    targets = actions.add_parser(
        "targets", help="write Prometheus file_sd targets for the runs training now",
        description=TARGETS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    targets.add_argument("roots", nargs="*", type=Path, metavar="ROOT",
                         help="folders holding run folders (default: the output root and the "
                              "multirun root, $LABRUN_OUTPUT_ROOT / $LABRUN_MULTIRUN_ROOT or "
                              "outputs and multirun)")
    targets.add_argument("--out", type=Path, required=True, metavar="FILE",
                         help="the file_sd JSON file to write (replaced atomically)")
    targets.add_argument("--watch", type=float, metavar="SECONDS",
                         help="rewrite the file every SECONDS until interrupted")
    queue = actions.add_parser("queue", help="serve the SLURM queue as Prometheus metrics",
                               description=QUEUE_HELP)
    queue.add_argument("--port", type=int, default=9102,
                       help="port to serve on (default 9102; 0: any free port)")
    queue.add_argument("--bind", default="127.0.0.1",
                       help="address to serve on (default 127.0.0.1: this machine only)")
    queue.add_argument("--cache", type=float, default=10.0, metavar="SECONDS",
                       help="how long one answer of SLURM serves scrapes (default and least: 10)")
    up = actions.add_parser("up", help="start a local Prometheus for labrun's runs",
                            description=UP_HELP)
    up.add_argument("--port", type=int, default=9090,
                    help="port on 127.0.0.1 (default 9090; 0: any free port)")
    up.add_argument("--roots", nargs="+", type=Path, metavar="ROOT",
                    help="folders holding run folders (default: the output root and the "
                         "multirun root)")
    up.add_argument("--output-root", type=Path, metavar="DIR",
                    help="where .prometheus/ (storage, target file, log) goes (default: "
                         "$LABRUN_OUTPUT_ROOT or outputs)")
    up.add_argument("--refresh", type=float, default=15.0, metavar="SECONDS",
                    help="how often the target file is rewritten (default 15)")


def _roots(given: list[Path] | None) -> list[Path]:
    """The roots named on the command line, which must exist (a typo would list nothing,
    silently), or the default ones, which need not yet (searched once they do)."""
    if not given:
        return default_roots()
    for root in given:
        if not root.is_dir():
            raise LabrunError(f"{root}: no such folder; name the folders that hold run "
                              f"folders (outputs, multirun)")
    return given


def refresh(roots: list[Path], out: Path) -> int:
    """Discover and write the target file; the number of targets."""
    from labrun.monitoring.targets import discover, write_file_sd

    found = discover(roots)
    if write_file_sd(found, out):
        runs = sorted({str(target.run_dir) for target in found})
        log.info("%s: %d targets of %d runs%s", out, len(found), len(runs),
                 (": " + ", ".join(runs)) if runs else "")
    return len(found)


def _positive(seconds: float, flag: str) -> None:
    if seconds <= 0:
        raise LabrunError(f"{flag} {seconds:g}: give a number of seconds above 0")


def run_targets(args: argparse.Namespace) -> int:
    roots = _roots(args.roots)
    if args.watch is None:
        refresh(roots, args.out)
        return 0
    _positive(args.watch, "--watch")
    try:
        while True:
            refresh(roots, args.out)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def run_queue(args: argparse.Namespace) -> int:
    from labrun.monitoring import queue_exporter

    if args.cache < queue_exporter.MIN_CACHE_S:
        raise LabrunError(f"--cache {args.cache:g}: give {queue_exporter.MIN_CACHE_S:g} seconds "
                          f"or more (two Prometheus servers scraping every 15 s would otherwise "
                          f"load the SLURM controller)")
    _slurm_client_or_fail()
    try:
        server, port = queue_exporter.serve(args.port, args.bind, args.cache)
    except OSError as error:
        raise LabrunError(f"cannot serve on {args.bind}:{args.port} ({error.strerror}); "
                          f"choose another --port (0: any free one) or --bind") from None
    print(f"queue metrics: http://{args.bind}:{port}/metrics  (SLURM asked at most every "
          f"{max(args.cache, queue_exporter.MIN_CACHE_S):g} s; Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()


def _slurm_client_or_fail() -> None:
    """One line, before anything is served, where this machine is no SLURM client at all (a
    controller that is down is no error: the exporter says so in labrun_queue_up)."""
    from labrun.core import probes
    from labrun.core.scheduler import SlurmScheduler

    try:
        SlurmScheduler.require_client()
    except probes.SlurmError as error:
        raise LabrunError(f"{error}; run labrun monitor queue on a login node") from None


def _queue_exporter_if_slurm():
    """The queue exporter on a free port of 127.0.0.1 where a SLURM cluster answers here
    (its server, HOST:PORT), else (None, None)."""
    from labrun.core import probes
    from labrun.core.scheduler import SlurmScheduler
    from labrun.monitoring import queue_exporter

    try:
        SlurmScheduler().partitions()
    except probes.SlurmError:
        return None, None
    server, port = queue_exporter.serve(0, "127.0.0.1")
    return server, f"127.0.0.1:{port}"


def run_up(args: argparse.Namespace) -> int:
    from labrun.monitoring import prometheus

    prometheus.binary()  # missing: one line naming the install, before anything is written
    _positive(args.refresh, "--refresh")
    output_root = args.output_root or default_roots()[0]
    roots = _roots(args.roots) if args.roots else [output_root, default_roots()[1]]
    home = output_root / ".prometheus"
    targets_file = home / "targets" / "labrun.json"
    refresh(roots, targets_file)
    exporter, queue_target = _queue_exporter_if_slurm()
    config = prometheus.write_config(home / "prometheus.yml", prometheus.local_config(
        targets_file, queue_target=queue_target))
    prom = prometheus.start(config, home / "data", home / "prometheus.log", port=args.port)
    try:
        queue = f"; the SLURM queue from {queue_target}" if queue_target else ""
        print(f"Prometheus: {prom.url}  (runs under {', '.join(map(str, roots))}{queue}"
              f"; storage {home / 'data'}; log {home / 'prometheus.log'}; Ctrl-C stops it)",
              flush=True)
        while True:
            time.sleep(args.refresh)
            prom.check_alive()
            refresh(roots, targets_file)
    except KeyboardInterrupt:
        return 0
    finally:
        prom.stop()
        if exporter is not None:
            exporter.shutdown()


def run(args: argparse.Namespace) -> int:
    return {"targets": run_targets, "queue": run_queue, "up": run_up}[args.action](args)
