#!/usr/bin/env bash
# `make test`: the whole suite. As root on Debian/Ubuntu (CI always) the single-node SLURM
# cluster comes up first, so the SLURM tests run against real daemons; elsewhere they are
# skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster_started=0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ -f scripts/slurm_up.sh ] \
        && [ "${LABRUN_NO_SLURM:-0}" != 1 ]; then
    if bash scripts/slurm_up.sh; then
        cluster_started=1
    else
        echo "SLURM bring-up failed: the SLURM tests will be skipped" >&2
    fi
fi
cleanup() { [ "$cluster_started" = 1 ] && bash scripts/slurm_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT

.venv/bin/python -m pytest "$@"
