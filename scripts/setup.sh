#!/usr/bin/env bash
# Everything a fresh machine needs, from the project's own files: system packages (when root),
# then the virtual environment with labrun and its dev tools. Safe to run again.
#
#   bash scripts/setup.sh train   what a run needs (`make train`)
#   bash scripts/setup.sh test    that, and what only the tests use (`make test`): Prometheus,
#                                 Chromium, Podman with runc, debootstrap (SLURM and MariaDB:
#                                 scripts/slurm_up.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-train}
case "$MODE" in train|test) ;; *) echo "usage: scripts/setup.sh train|test" >&2; exit 2;; esac

missing=()
ldconfig -p | grep -q libturbojpeg || missing+=(libturbojpeg0)
[ -e /usr/include/jpeglib.h ] || missing+=(libjpeg62-turbo-dev)
[ -e /usr/include/png.h ] || missing+=(libpng-dev)
command -v cc >/dev/null || missing+=(gcc libc6-dev)
# trainer.compile=true on the CPU: torch.compile's inductor writes and compiles C++.
command -v g++ >/dev/null || missing+=(g++)
PYTHON=${PYTHON:-python3}
[ -e "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] \
    || missing+=(python3-dev)
# Debian splits venv (and the ensurepip it needs) out of python3.
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if [ "$MODE" = test ]; then
    # tests/test_monitoring.py: the Prometheus server and promtool (`labrun monitor up` names
    # its apt line when it is missing; --no-install-recommends below: its recommends bring
    # node-exporter and IPMI tools).
    command -v prometheus >/dev/null || missing+=(prometheus)
    # The headless browser that tests/test_optuna.py renders optuna-dashboard's page in.
    command -v chromium >/dev/null || missing+=(chromium)
    # cluster.container=podman on the test cluster (tests/test_cluster_container.py): podman,
    # the runc it runs with here (scripts/podman/containers.conf), and debootstrap for the
    # test image.
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
fi
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
# The tested torch / torchvision (constraints.txt; pyproject.toml declares ranges) come from the
# local wheel cache. nlp: text classification (model=hf), whose tests are part of the suite.
.venv/bin/pip install -q -c constraints.txt -e '.[dev,nlp]'
touch ".venv/.installed-$MODE"
