#!/usr/bin/env bash
# `make bench`: every benchmark with --check. The sweep benchmark submits to a SLURM cluster:
# as root the test cluster of scripts/slurm_up.sh comes up first (and goes down after, if this
# run started it), as for `make test`. Without root nothing starts it, and the sweep
# benchmark's targets are missed, saying why: leave it out with `labrun bench all --check
# --skip sweep`. Arguments go to `labrun bench all` (--skip NAME).
set -euo pipefail
cd "$(dirname "$0")/.."

cluster_started=0
if [ "$(id -u)" = 0 ]; then
    # Stopped at exit only if this run starts it: a cluster already up is someone else's (a
    # `make test` beside this benchmark). The bring-up reports its own errors.
    if bash scripts/slurm_up.sh --check >/dev/null 2>&1; then was_up=1; else was_up=0; fi
    bash scripts/slurm_up.sh  # quick when the cluster is up already
    [ "$was_up" = 1 ] || cluster_started=1
fi
cleanup() { [ "$cluster_started" = 1 ] && bash scripts/slurm_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT

.venv/bin/python -m labrun.cli bench all --check "$@"
