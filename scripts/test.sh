#!/usr/bin/env bash
# `make test`: the whole suite, SLURM tests included. As root (CI always) the SLURM cluster of
# scripts/slurm_up.sh comes up first, and a failed bring-up fails `make test` with its own error.
# The only way to run without SLURM is to say so: LABRUN_NO_SLURM=1 make test; the end-of-run
# summary then says in one line that the SLURM tests did not run.
set -euo pipefail
cd "$(dirname "$0")/.."

cluster_started=0
if [ "${LABRUN_NO_SLURM:-0}" != 1 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "error: the SLURM tests need the test cluster, which only root can start" \
             "(scripts/slurm_up.sh); run as root, or LABRUN_NO_SLURM=1 make test to skip them" >&2
        exit 2
    fi
    # Their errors, if any, are the last thing printed; set -e ends the run with the exit code.
    # The image the container tests run their jobs in (built once, then cached by name):
    bash scripts/container_image.sh >/dev/null
    # Stopped at exit only if this run starts it: a cluster already up is someone else's (a
    # `make bench` or another `make test` beside this one). The bring-up reports its own errors.
    if bash scripts/slurm_up.sh --check >/dev/null 2>&1; then was_up=1; else was_up=0; fi
    bash scripts/slurm_up.sh
    [ "$was_up" = 1 ] || cluster_started=1
fi
cleanup() { [ "$cluster_started" = 1 ] && bash scripts/slurm_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT

# --durations: every run shows where the time goes.
# -n 2 --dist loadgroup: a worker per core (tests/conftest.py groups a file's tests, and all
# SLURM tests, onto one worker). A third worker filled the cores' idle eighth here (2076 s
# against 2247 s), but CI's machine took 2615 s with three, against about 1930 s with two.
.venv/bin/python -m pytest -n 2 --dist loadgroup --durations=25 "$@"
