#!/usr/bin/env bash
# "Results unchanged", checked by anyone: the default job trained with an earlier revision's code
# (default HEAD~1) and with this checkout's code (uncommitted changes included), then the two runs
# compared bit for bit by `labrun compare --exact`, whose exit code this script exits with:
# 0 identical, 1 different, 2 a bad input.
#
#   scripts/compare_with_previous.sh                     # HEAD~1, the full default job
#   scripts/compare_with_previous.sh --steps 30 main     # a shorter job: trainer.max_steps=30
#   scripts/compare_with_previous.sh REV -- seed=1 ...   # more overrides, the same on both sides
#   --keep                                               # keep the two run folders to look at
#
# The revision is checked out into a temporary git worktree (removed at exit) and trains from
# there: its train.py, conf/ and src/ (PYTHONPATH), with this checkout's Python (.venv/bin/python,
# or $PYTHON) and compiled extensions (*.so: build outputs, not in git). Both runs log with
# logger=csv (no W&B) and read the same data folder ($LABRUN_DATA_DIR, default this checkout's
# data/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

usage() {
    echo "usage: scripts/compare_with_previous.sh [--steps N] [--keep] [REVISION] [-- OVERRIDE...]" >&2
    exit 2
}
rev=HEAD~1 steps="" keep=0 overrides=()
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) [ $# -ge 2 ] || usage; steps="$2"; shift 2 ;;
        --keep) keep=1; shift ;;
        --) shift; overrides=("$@"); break ;;
        -*) usage ;;
        *) rev="$1"; shift ;;
    esac
done
[ -x "$PYTHON" ] || { echo "error: no $PYTHON: run make train first, or give PYTHON=..." >&2; exit 2; }
commit="$(git rev-parse --verify --quiet "$rev^{commit}")" \
    || { echo "error: $rev: no such git revision" >&2; exit 2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/labrun-compare.XXXXXX")"
code="$work/code"
cleanup() {
    git worktree remove --force "$code" >/dev/null 2>&1 || true
    git worktree prune || true  # in case the folder went before git forgot it
    if [ "$keep" = 1 ]; then echo "runs kept: $work/previous $work/current" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

git worktree add --quiet --detach "$code" "$commit"
while IFS= read -r so; do cp "$so" "$code/$so"; done < <(find src -name '*.so')
# Copied, not built: a revision whose C sources differ would run this checkout's extensions.
if ! git diff --quiet "$commit" -- '*.c'; then
    echo "warning: the C sources differ from $rev's; its run uses this checkout's compiled" \
         "extensions" >&2
fi

export LABRUN_DATA_DIR="${LABRUN_DATA_DIR:-$ROOT/data}"  # a relative data/ would be each tree's
args=(logger=csv ${steps:+"trainer.max_steps=$steps"} "${overrides[@]}")

# train NAME CODE_DIR: the job with the code of CODE_DIR, run from there (its conf/), into
# $work/NAME; its output in $work/NAME.log, the end of which is shown if it fails.
train() {
    echo "training with $3's code: python train.py ${args[*]}" >&2
    if ! (cd "$2" && PYTHONPATH="$2/src${PYTHONPATH:+:$PYTHONPATH}" \
            "$PYTHON" train.py "${args[@]}" "hydra.run.dir=$work/$1") >"$work/$1.log" 2>&1; then
        tail -n 20 "$work/$1.log" >&2
        echo "error: the run with $3's code failed (above)" >&2
        exit 2
    fi
}
train previous "$code" "$rev ($(git rev-parse --short "$commit"))"
train current "$ROOT" "this checkout"

PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m labrun.cli compare --exact "$work/previous" "$work/current" && status=0 || status=$?
exit "$status"
