#!/usr/bin/env bash
# Tear down the test SLURM cluster started by scripts/slurm_up.sh: cancel jobs, stop each daemon by
# the PID recorded in $LABRUN_SLURM_STATE/pids/ (default /tmp/labrun-slurm), end whatever still
# runs in the nodes' network namespaces, delete the namespaces, the bridge, the state dir and the
# config files in /etc/slurm. Idempotent: nothing running and no state dir is a success.
set -euo pipefail

# shellcheck source=scripts/slurm/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/slurm/common.sh"
log() { echo "slurm_down: $*"; }

# Cancel jobs while the controller is still up so no job steps outlive the cluster.
if [ -s "$STATE/pids/slurmctld.pid" ] && command -v scancel >/dev/null \
   && timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs="$(timeout 10 squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        # KillWait=10: give the steps a moment to finish before slurmd goes away.
        for _ in $(seq 30); do
            [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null || true)" ] && break
            sleep 0.5
        done
    fi
fi


# stop NAME EXPECTED_COMM: SIGTERM the recorded PID (only if it still is that daemon: a stale pid
# file after a reboot may point at an unrelated process), wait up to 15 s, then SIGKILL.
stop() {
    local name=$1 comm=$2 f="$STATE/pids/$1.pid" pid
    [ -s "$f" ] || return 0
    pid="$(cat "$f")"
    if running "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 75); do running "$pid" || break; sleep 0.2; done
        if running "$pid"; then
            log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
        fi
        log "stopped $name (pid $pid)"
        stopped+=("$pid")
    fi
    rm -f "$f"
}

stopped=()
# Reverse start order: compute daemons first, munged last (the others authenticate through it).
for f in "$STATE"/pids/slurmd*.pid; do
    [ -e "$f" ] || continue
    name="$(basename "$f" .pid)"
    stop "$name" slurmd
done
stop slurmctld slurmctld
stop slurmdbd slurmdbd
stop mariadbd mariadbd
stop munged munged

# slurmstepd processes detach from slurmd; any of this cluster's left over (a job that ignored
# the cancel), and a daemon of it whose pid file was lost (an earlier cluster killed half-way):
# end them by PID.
for p in /proc/[0-9]*; do
    comm="$(cat "$p/comm" 2>/dev/null)" || continue
    case "$comm" in slurmstepd|slurmd|slurmctld|slurmdbd|munged|mariadbd) ;; *) continue;; esac
    pid="${p#/proc/}"
    running "$pid" && ours "$pid" || continue
    log "killing leftover $comm (pid $pid)"
    kill -KILL "$pid" 2>/dev/null || true
    stopped+=("$pid")
done

# The nodes: anything still running in their network namespaces (an orphaned job step, a
# training process) belongs to this cluster; then the namespaces and the bridge themselves.
for ns in $(ip netns list 2>/dev/null | awk '/^labrun-node/ {print $1}'); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
        log "killing pid $pid left in $ns"
        kill -KILL "$pid" 2>/dev/null || true
        stopped+=("$pid")
    done
    ip netns delete "$ns" 2>/dev/null || true
done
ip link delete labrun0 2>/dev/null || true
for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/slurmdbd.conf; do
    grep -qF "$MARKER" "$f" 2>/dev/null && rm -f "$f"
done

# Let PID 1 reap the exited daemons (up to 5 s) so that `ps` right after this script shows none.
for _ in $(seq 25); do
    left=0
    for pid in "${stopped[@]}"; do [ -d "/proc/$pid" ] && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.2
done

rm -rf "$STATE"
log "cluster down, state removed ($STATE)"
