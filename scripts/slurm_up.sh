#!/usr/bin/env bash
# Bring up a real single-node SLURM cluster (cluster "labrun", partition "dev") on this machine.
#
#   bash scripts/slurm_up.sh        # idempotent; exits 0 quickly if the cluster is already healthy
#   bash scripts/slurm_down.sh      # stops every daemon by PID and deletes the state
#
# No systemd here, so package scripts cannot start services: this script installs the packages
# (Debian 12: Slurm 22.05, MariaDB, munge), then starts munged, mariadbd, slurmdbd, slurmctld and
# slurmd itself, in the background, and records their PIDs in $LABRUN_SLURM_STATE/pids/.
# It finishes with a real test job and an sacct query, then prints a summary.
#
# Env: LABRUN_SLURM_STATE  state dir (default /tmp/labrun-slurm): logs, pids, spool, database.
#                          Must be the same for slurm_up.sh and slurm_down.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${LABRUN_SLURM_STATE:-/tmp/labrun-slurm}"
PARTITION=dev
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server mariadb-client rsync)
# mariadbd listens on this unix socket only (--skip-networking); slurmdbd finds it via MYSQL_UNIX_PORT.
DB_SOCKET="$STATE/mysql/mysqld.sock"
T0=$(date +%s)

STARTED=0   # set to 1 once daemons are being started: from then on a failure also tears down

# die MSG: one-line error and exit 1. If daemons were already started, keep a copy of the logs
# next to the state dir and tear the half-started cluster down so nothing is left running.
die() {
    local msg="$*"
    if [ "$STARTED" = 1 ]; then
        rm -rf "$STATE.failed-logs"
        mkdir -p "$STATE.failed-logs"
        cp -r "$STATE/log/." "$STATE.failed-logs/" 2>/dev/null || true
        cp "$STATE/mysql/mariadbd.err" "$STATE.failed-logs/" 2>/dev/null || true
        bash "$HERE/slurm_down.sh" >/dev/null 2>&1 || true
        msg="$msg (cluster torn down; logs in $STATE.failed-logs/)"
    fi
    echo "slurm_up: ERROR: $msg" >&2
    exit 1
}
log() { echo "slurm_up: $*"; }

[ "$(id -u)" = 0 ] || die "must run as root (starts daemons, writes /etc/slurm)"

# running PID: true if PID exists and is not a zombie. Daemons here are re-parented to PID 1,
# which reaps them only after a second or two, so `kill -0` alone would see a dead daemon as alive.
running() {
    local st
    st="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
    [ -n "$st" ] && [ "$st" != Z ]
}

# pid_alive NAME: true if the daemon recorded under NAME is still running.
pid_alive() {
    local f="$STATE/pids/$1.pid" pid
    [ -s "$f" ] || return 1
    pid=$(cat "$f")
    running "$pid"
}

# Wait up to $1 seconds for command "$2..." to succeed (polling every 0.5 s).
wait_for() {
    local timeout=$1; shift
    local end=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 0.5
    done
}

node_state() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1; }
node_usable() { case "$(node_state)" in idle|mixed|allocated|completing) return 0;; *) return 1;; esac; }

# Fingerprint of this script and the templates: a running cluster brought up from other
# versions of them is restarted, so config edits take effect on the next slurm_up.sh.
config_id() { cat "$HERE/slurm_up.sh" "$HERE"/slurm/*.in | sha256sum | cut -d' ' -f1; }

healthy() {
    local d
    [ "$(cat "$STATE/config_id" 2>/dev/null)" = "$(config_id)" ] || return 1
    for d in munged mariadbd slurmdbd slurmctld slurmd; do pid_alive "$d" || return 1; done
    [ -f /etc/slurm/slurm.conf ] || return 1
    timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' || return 1
    node_usable || return 1
    timeout 10 sacct -n -X -S now >/dev/null 2>&1 || return 1
}

summary() {
    local cpus mem
    cpus=$(sinfo -h -N -n "$NODE" -o '%c')
    mem=$(sinfo -h -N -n "$NODE" -o '%m')
    echo "slurm_up: cluster labrun UP: partition=$PARTITION (default) node=$NODE cpus=$cpus memory=${mem}MB" \
         "state=$(node_state) statedir=$STATE ($(( $(date +%s) - T0 ))s)"
}

NODE="$(hostname -s)"

# ---- 0. Already up? -------------------------------------------------------------------------
if [ -d "$STATE/pids" ] && command -v sinfo >/dev/null && healthy; then
    config_id >"$STATE/config_id"
summary
    exit 0
fi
# Anything half-up (a daemon died, machine restarted with /tmp kept, ...): start from scratch.
if [ -d "$STATE" ]; then
    log "found a stale or unhealthy cluster in $STATE; tearing it down first"
    bash "$HERE/slurm_down.sh" >/dev/null || die "slurm_down.sh failed while cleaning a stale cluster"
fi

# ---- 1. Packages ----------------------------------------------------------------------------
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt-get, takes a minute or two)"
    # Stop package scripts from trying to start services (no init system here): a policy-rc.d
    # that exits 101 makes invoke-rc.d skip the start. Only added if none exists, removed after.
    added_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    aptlog="$(mktemp /tmp/labrun-slurm-apt.XXXXXX.log)"
    export DEBIAN_FRONTEND=noninteractive
    ok=1
    { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1 || ok=0
    [ "$added_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$ok" = 1 ] || die "apt-get install failed, see $aptlog"
    rm -f "$aptlog"
fi

# ---- 2. Config files (before any Slurm command: client commands read slurm.conf) -------------
mkdir -p "$STATE"/{pids,log,run,slurmctld,slurmd}
chmod 755 "$STATE"   # mariadbd runs as mysql and must traverse it

# Node line as slurmd detects this machine. RealMemory is lowered by 5% so a slightly smaller
# reading at some later registration cannot DRAIN the node ("Low RealMemory").
node_line="$(slurmd -C 2>/dev/null | head -n1)"
case "$node_line" in NodeName=*RealMemory=*) ;; *) die "unexpected 'slurmd -C' output: $node_line";; esac
real_mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")"
node_line="$(sed "s/RealMemory=[0-9]*/RealMemory=$(( real_mem * 95 / 100 ))/" <<<"$node_line")"
# slurmd -C names the node after `hostname -s`; the config must use the same name.
node_line="$(sed "s/^NodeName=[^ ]*/NodeName=$NODE/" <<<"$node_line")"

mkdir -p /etc/slurm
render() {  # render TEMPLATE DEST MODE
    sed -e "s|@HOST@|$NODE|g" -e "s|@NODE@|$NODE|g" -e "s|@STATE@|$STATE|g" \
        -e "s|@NODE_LINE@|$node_line|g" "$1" >"$2.tmp"
    chmod "$3" "$2.tmp"
    chown root:root "$2.tmp"
    mv "$2.tmp" "$2"
}
render "$HERE/slurm/slurm.conf.in" /etc/slurm/slurm.conf 644
# slurmdbd refuses a slurmdbd.conf that is not 0600 and owned by SlurmUser (root).
render "$HERE/slurm/slurmdbd.conf.in" /etc/slurm/slurmdbd.conf 600

# ---- 3. munged ------------------------------------------------------------------------------
# munged refuses to run as root, so it runs as the munge user; it needs its key (owned by munge,
# 0400) and /run/munge for its socket (the default path Slurm's auth/munge connects to).
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 700 /etc/munge
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge

# start NAME CMD...: run CMD in the foreground mode of the daemon, detached (own session, stdio
# to a log file so callers capturing our output do not hang), and record its PID.
# setsid/setpriv exec (no fork) here, so $! is the daemon's own PID.
start() {
    local name=$1; shift
    setsid "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 &
    echo $! >"$STATE/pids/$name.pid"
}
# check_started NAME SECONDS CMD...: wait for CMD to succeed while the daemon is still alive.
check_started() {
    local name=$1 timeout=$2; shift 2
    local end=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        pid_alive "$name" || die "$name exited at start-up"
        [ "$(date +%s)" -lt "$end" ] || die "$name not ready after ${timeout}s"
        sleep 0.5
    done
}

STARTED=1
start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
check_started munged 15 bash -c 'munge -n | unmunge'

# ---- 4. MariaDB (throw-away datadir inside the state dir, unix socket only) ------------------
if [ ! -d "$STATE/mysql/mysql" ]; then
    mkdir -p "$STATE/mysql"
    chown mysql:mysql "$STATE/mysql"
    # root@localhost authenticates through unix_socket: root processes (slurmdbd) need no password.
    mysql_install_db --no-defaults --user=mysql --datadir="$STATE/mysql" \
        --auth-root-authentication-method=socket --skip-test-db >"$STATE/log/mysql_install_db.out" 2>&1 \
        || die "mysql_install_db failed"
fi
# Its own pid file and error log go in the datadir: mariadbd runs as mysql and cannot write elsewhere.
# The innodb values are the minimums slurmdbd checks for (it logs an error otherwise).
start mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --socket="$DB_SOCKET" --pid-file="$STATE/mysql/mariadbd.pid" --skip-networking \
    --log-error="$STATE/mysql/mariadbd.err" \
    --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 --innodb-log-file-size=64M
check_started mariadbd 60 mariadb-admin --no-defaults --socket="$DB_SOCKET" -uroot ping

# ---- 5. slurmdbd ----------------------------------------------------------------------------
# MYSQL_UNIX_PORT points the MariaDB client library inside slurmdbd at our socket.
start slurmdbd env MYSQL_UNIX_PORT="$DB_SOCKET" /usr/sbin/slurmdbd -D
# First start creates the accounting tables; sacctmgr answering means slurmdbd is serving.
check_started slurmdbd 60 timeout 10 sacctmgr -n list cluster
# Register the cluster before slurmctld starts so it is accounted from its first job.
if ! sacctmgr -n -P list cluster format=cluster | grep -qx labrun; then
    sacctmgr -i add cluster labrun >/dev/null || die "sacctmgr add cluster labrun failed"
fi

# ---- 6. slurmctld + slurmd ------------------------------------------------------------------
# -i: ignore errors found while reading state files (there are none on a fresh state dir).
start slurmctld /usr/sbin/slurmctld -D -i
check_started slurmctld 30 bash -c 'timeout 5 scontrol ping | grep -q "is UP"'
start slurmd /usr/sbin/slurmd -D
check_started slurmd 60 node_usable

# ---- 7. Smoke test: a real job, then its accounting record ----------------------------------
out="$(timeout 60 srun -N1 -n1 -p "$PARTITION" -t 1 -J labrun-smoke hostname 2>&1)" \
    || die "test job 'srun -N1 hostname' failed: $out"
[ -n "$out" ] || die "test job 'srun -N1 hostname' printed nothing"
# Accounting is written asynchronously (slurmctld -> slurmdbd, a few seconds behind): poll for
# the job's record (any state) to prove the slurmctld -> slurmdbd -> MariaDB path works.
wait_for 30 bash -c 'sacct -n -X -P --name=labrun-smoke -o JobID | grep -q .' \
    || die "sacct has no record of the test job (accounting via slurmdbd is broken)"

config_id >"$STATE/config_id"
summary
