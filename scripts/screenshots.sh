#!/usr/bin/env bash
# The README's pictures of `labrun dashboard` and `labrun compare --plot`, taken once (not by
# the tests): synthetic sweeps (labrun.bench.dashboard: 40 grid runs, a 40-trial Optuna study),
# each viewer started with `labrun dashboard`, and Debian's headless chromium (scripts/setup.sh
# installs it as root) photographing its page, with no network beyond loopback.
#     bash scripts/screenshots.sh      -> docs/dashboard_optuna.png, docs/dashboard_hparams.png,
#                                         docs/compare_plot.png
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
LABRUN=.venv/bin/labrun
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait; rm -rf "$work"' EXIT

$PY -c "
from pathlib import Path
from labrun.bench.dashboard import make_runs, make_study
make_runs(Path('$work/grid'), 40, seed=1)
make_study(Path('$work/study'), 40)
"
$LABRUN compare "$work/grid" --plot docs/compare_plot.png > /dev/null

shoot() {  # shoot SWEEP PORT PAGE OUT
    $LABRUN dashboard "$1" --port "$2" > "$work/dashboard-$2.out" 2>&1 &
    pids+=($!)
    for _ in $(seq 240); do grep -q "^Ctrl-C stops" "$work/dashboard-$2.out" && break; sleep 0.5; done
    chromium --headless --no-sandbox --disable-gpu --no-proxy-server \
        --host-resolver-rules="MAP * ~NOTFOUND, EXCLUDE 127.0.0.1" \
        --disable-background-networking --disable-component-update --no-first-run \
        --user-data-dir="$work/chromium-$2" --hide-scrollbars --window-size=1400,900 \
        --virtual-time-budget=20000 --screenshot="$PWD/$4" "http://127.0.0.1:$2$3" 2>/dev/null
    echo "wrote $4"
}
shoot "$work/study" 18080 /dashboard/studies/0 docs/dashboard_optuna.png
shoot "$work/grid" 16006 "/#hparams" docs/dashboard_hparams.png
