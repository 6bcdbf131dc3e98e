#!/usr/bin/env bash
# Tear down the dev SLURM cluster started by scripts/slurm_up.sh: cancel jobs, stop each daemon by
# the PID recorded in $LABRUN_SLURM_STATE/pids/ (default /tmp/labrun-slurm), delete the state dir.
# Idempotent: nothing running and no state dir is a success.
set -euo pipefail

STATE="${LABRUN_SLURM_STATE:-/tmp/labrun-slurm}"
log() { echo "slurm_down: $*"; }

# Cancel jobs while the controller is still up so no job steps outlive the cluster.
if [ -s "$STATE/pids/slurmctld.pid" ] && command -v scancel >/dev/null \
   && timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs="$(timeout 10 squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        # KillWait=5: give the steps a moment to finish before slurmd goes away.
        for _ in $(seq 20); do
            [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null || true)" ] && break
            sleep 0.5
        done
    fi
fi

# running PID: true if PID exists and is not a zombie. Our daemons are re-parented to PID 1, which
# reaps them only a second or two after they exit; `kill -0` alone would make every stop that slow.
running() {
    local st
    st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
    [ -n "$st" ] && [ "$st" != Z ]
}

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
stop slurmd slurmd
stop slurmctld slurmctld
stop slurmdbd slurmdbd
stop mariadbd mariadbd
stop munged munged

# slurmstepd processes detach from slurmd; any left over (a job that ignored the cancel) belong to
# this cluster, the only one on the machine: end them by PID.
for p in /proc/[0-9]*; do
    [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] && running "${p#/proc/}" || continue
    pid="${p#/proc/}"
    log "killing leftover slurmstepd (pid $pid)"
    kill -KILL "$pid" 2>/dev/null || true
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
