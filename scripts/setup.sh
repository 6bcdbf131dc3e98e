#!/usr/bin/env bash
# Everything a fresh machine needs, from the project's own files: system packages (when root),
# then the virtual environment with labrun and its dev tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# libjpeg-turbo for PyTurboJPEG (labrun falls back to Pillow, slowly, without it).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libturbojpeg; then
    echo "installing libturbojpeg0 (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libturbojpeg0 >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
# torch==2.14.1 / torchvision==0.29.1 (pinned in pyproject.toml) come from the local wheel cache.
.venv/bin/pip install -q -e '.[dev]'
touch .venv/.installed
