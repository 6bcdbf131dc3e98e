#!/usr/bin/env bash
# `make bench`: every benchmark with --check. The sweep benchmark submits to a SLURM cluster:
# as root the test cluster of scripts/slurm_up.sh comes up first (and goes down after), as for
# `make test`. Without root nothing starts it, and the sweep
# benchmark's targets are missed, saying why: leave it out with `labrun bench all --check
# --skip sweep`. Arguments go to `labrun bench all` (--skip NAME).
set -euo pipefail
cd "$(dirname "$0")/.."

cluster_started=0
if [ "$(id -u)" = 0 ]; then
    bash scripts/slurm_up.sh  # quick when the cluster is up already
    cluster_started=1
fi
cleanup() { [ "$cluster_started" = 1 ] && bash scripts/slurm_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT

.venv/bin/python -m labrun.cli bench all --check "$@"
