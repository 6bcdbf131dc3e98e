#!/usr/bin/env bash
# The test image of tests/test_cluster_container.py: a minimal Debian 12 root file system with
# the shared libraries the project's Python, torch and PyTurboJPEG load, imported into podman.
# Nothing can be pulled from an image registry here, so it is built with debootstrap from the
# Debian mirror apt uses; the project's Python and venv are mounted read-only at run time. Built
# once and cached by name in podman's storage (overlay, on ext4 here); prints the name.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=localhost/labrun-test:bookworm
export CONTAINERS_CONF="$PWD/scripts/podman/containers.conf"
if podman image exists "$IMAGE"; then
    echo "$IMAGE"
    exit 0
fi
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
         || true)
WORK=/var/tmp/labrun-image
rm -rf "$WORK/rootfs"
mkdir -p "$WORK"
start=$SECONDS
# libssl3 ... liblzma5: the modules of CPython's standard library; libgomp1 and libstdc++6:
# torch; libturbojpeg0: PyTurboJPEG; procps: ps for the tests' looks inside.
if ! debootstrap --variant=minbase \
        --include=libssl3,libffi8,zlib1g,libbz2-1.0,libsqlite3-0,liblzma5,libgomp1,libturbojpeg0,libjpeg62-turbo,libstdc++6,procps \
        bookworm "$WORK/rootfs" "${MIRROR:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1; then
    echo "error: debootstrap of the test image failed; see $WORK/debootstrap.log" >&2
    tail -3 "$WORK/debootstrap.log" >&2
    exit 1
fi
tar -C "$WORK/rootfs" -c . | podman import --quiet - "$IMAGE" >/dev/null
rm -rf "$WORK/rootfs"
echo "container_image: built $IMAGE in $((SECONDS - start)) s" >&2
echo "$IMAGE"
