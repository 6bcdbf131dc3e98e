#!/usr/bin/env bash
# Bring up labrun's test SLURM cluster on this one machine, shaped like a small lab's:
#   - slurmctld, slurmdbd and a private MariaDB and munged in this machine's namespace;
#   - three compute nodes node1..node3, each a slurmd in its own network namespace with its own
#     hostname and address on a bridge this script creates (10.77.0.0/24; nothing else is
#     contacted), four GPUs each as GRES (placeholder character devices);
#   - partitions gpu (default) and dev (the same nodes, for CPU-only quick sweeps);
#   - QOS normal, urgent (higher priority) and scavenger (preempted by QOS, requeued);
#   - fair share across the accounts vision and nlp (root belongs to both, and to lab, its
#     default account).
#
#   bash scripts/slurm_up.sh        # idempotent; exits 0 quickly if the cluster is already healthy
#   bash scripts/slurm_up.sh --check  # exit 0 if it is up and healthy, 1 if not; changes nothing
#   bash scripts/slurm_down.sh      # stops every daemon by PID, removes namespaces and state
#
# No systemd here: this script installs the packages (Debian 12: Slurm 22.05, MariaDB, munge),
# then starts every daemon itself and records its PID in $LABRUN_SLURM_STATE/pids/. It ends
# with a real job on the nodes and an sacct query, then prints a summary.
#
# Env: LABRUN_SLURM_STATE  state dir (default /tmp/labrun-slurm): logs, pids, spool, database.
#                          Must be the same for slurm_up.sh and slurm_down.sh.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/slurm/common.sh
. "$HERE/slurm/common.sh"
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server mariadb-client rsync iproute2)
DB_SOCKET="$STATE/mysql/mysqld.sock"
MUNGE_SOCKET="$STATE/munge/munge.socket"
# The cluster's network: the bridge holds the controller's address, node N has .1N.
BRIDGE=labrun0
CTL_ADDR=10.77.0.1
NODES=(node1 node2 node3)
NODE_RANGE="node[1-3]"
node_addr() { echo "10.77.0.1${1#node}"; }
netns() { echo "labrun-$1"; }
# What each node declares (SlurmdParameters=config_overrides): a lab's GPU node, so that
# cluster=lab as written (8 CPUs per task, 32 GB per node) fits two 2-GPU jobs on one node.
NODE_CPUS=32
NODE_MEM_MB=196608
NODE_GPUS=4
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
# Any command that fails without its own `|| die` still ends in one line naming it.
trap 'trap - ERR; die "line $LINENO: $BASH_COMMAND failed"' ERR

[ "$(id -u)" = 0 ] || die "must run as root (starts daemons, network namespaces, writes /etc/slurm)"
if [ -e /etc/slurm/slurm.conf ] && ! grep -qF "$MARKER" /etc/slurm/slurm.conf; then
    die "/etc/slurm/slurm.conf was not written by slurm_up.sh: this machine has a Slurm of its" \
        "own, which the test cluster would replace; run the tests on another machine"
fi


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

node_state() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n1; }
node_usable() { case "$(node_state "$1")" in idle|mixed|allocated|completing) return 0;; *) return 1;; esac; }
all_nodes_usable() { local n; for n in "${NODES[@]}"; do node_usable "$n" || return 1; done; }

# Fingerprint of this script and the templates: a running cluster brought up from other
# versions of them is restarted, so config edits take effect on the next slurm_up.sh.
config_id() { cat "$HERE/slurm_up.sh" "$HERE/slurm_down.sh" "$HERE"/slurm/* | sha256sum | cut -d' ' -f1; }

healthy() {
    local d
    [ "$(cat "$STATE/config_id" 2>/dev/null)" = "$(config_id)" ] || return 1
    for d in munged mariadbd slurmdbd slurmctld "${NODES[@]/#/slurmd-}"; do pid_alive "$d" || return 1; done
    [ -f /etc/slurm/slurm.conf ] || return 1
    timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' || return 1
    all_nodes_usable || return 1
    timeout 10 sacct -n -X -S now >/dev/null 2>&1 || return 1
}
# already_up: this script's cluster runs and is healthy (what `--check` answers).
already_up() { [ -d "$STATE/pids" ] && command -v sinfo >/dev/null && healthy; }

# --check: asked by scripts/test.sh and bench.sh before they bring the cluster up, so that at
# exit they stop only a cluster they started, never one a `make test` beside them is using.
if [ "${1:-}" = --check ]; then
    if already_up; then exit 0; fi
    exit 1
fi

summary() {
    echo "slurm_up: cluster labrun UP: nodes=${NODES[*]} (each $NODE_CPUS CPUs, ${NODE_MEM_MB}MB," \
         "gpu:$NODE_GPUS) partitions=gpu (default),dev qos=normal,urgent,scavenger" \
         "accounts=lab,vision,nlp statedir=$STATE ($(( $(date +%s) - T0 ))s)"
}

# start NAME CMD...: run CMD in the foreground mode of the daemon, detached (own session, stdio
# to a log file so callers capturing our output do not hang), and record its PID.
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
        pid_alive "$name" || die "$name exited at start-up (log: $STATE/log/$name.out)"
        [ "$(date +%s)" -lt "$end" ] || die "$name not ready after ${timeout}s"
        sleep 0.5
    done
}

# start_node NAME: the node's slurmd in the node's network namespace. Not `ip netns exec`: it
# remounts /sys, which hides the cgroup tree slurmd needs. A UTS namespace gives the node its
# hostname, a mount namespace its /etc/hosts.
start_node() {
    start "slurmd-$1" nsenter --net="/run/netns/$(netns "$1")" unshare --uts --mount \
        sh -c "hostname $1 && mount --bind '$STATE/hosts' /etc/hosts && exec /usr/sbin/slurmd -D -N $1"
}

# --restart-node NAME: bring one node back after a test took it away (its slurmd killed): end
# what is left in its namespace (an orphaned job step), start its slurmd, resume it.
if [ "${1:-}" = --restart-node ]; then
    n="${2:?--restart-node needs a node name}"
    for pid in $(ip netns pids "$(netns "$n")" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    # The old slurmd must be gone before the new one binds its port.
    wait_for 10 bash -c "[ -z \"\$(ip netns pids $(netns "$n"))\" ]" || die "$n: processes survive SIGKILL"
    start_node "$n"
    # The node registers within seconds; DOWN (not responding) nodes need an explicit resume.
    wait_for 60 bash -c "sinfo -h -N -n $n -o %T | grep -qv '\*'" || true
    scontrol update nodename="$n" state=resume 2>/dev/null || true
    wait_for 60 node_usable "$n" || die "$n did not come back: $(sinfo -h -N -n "$n" -o '%T %E' | head -n1)"
    log "$n is back ($(node_state "$n"))"
    exit 0
fi

# restart_controller: slurmctld reads slurm.conf afresh. Not `scontrol reconfigure`: Slurm
# 22.05's slurmctld keeps the MaxArraySize it checked its first job array against until it
# restarts (it reports the new value, and refuses arrays by the old one). Jobs survive: their
# state is saved in $STATE/slurmctld.
restart_controller() {
    local pid; pid="$(cat "$STATE/pids/slurmctld.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 30 bash -c "! [ -d /proc/$pid ] || grep -q '^State:.Z' /proc/$pid/status" \
        || die "slurmctld ($pid) did not stop"
    start slurmctld /usr/sbin/slurmctld -D -i
    check_started slurmctld 30 bash -c 'timeout 5 scontrol ping | grep -q "is UP"'
    for n in "${NODES[@]}"; do check_started slurmctld 60 node_usable "$n"; done
}
# --restart-controller: slurm.conf read again (tests/test_sweep_scale.py's MaxArraySize).
if [ "${1:-}" = --restart-controller ]; then
    restart_controller
    log "slurmctld restarted (MaxArraySize $(scontrol show config | awk '/^MaxArraySize/ {print $3}'))"
    exit 0
fi

# ---- 0. Already up? -------------------------------------------------------------------------
# tests/test_sweep_scale.py sets a small MaxArraySize and puts SLURM's default back when done; a
# run killed in between would leave it, so a healthy cluster gets the default back here.
reset_max_array_size() {
    grep -q '^MaxArraySize=' /etc/slurm/slurm.conf || return 0
    sed -i '/^MaxArraySize=/d' /etc/slurm/slurm.conf
    restart_controller
    log "MaxArraySize is SLURM's default again (a test had changed it)"
}
if already_up; then
    reset_max_array_size
    summary
    exit 0
fi
# Anything an earlier cluster may have left (daemons, namespaces, the bridge, stale state, an
# old /etc/slurm/slurm.conf): slurm_down.sh clears all of it, and is a no-op on a clean machine.
bash "$HERE/slurm_down.sh" >/dev/null || die "slurm_down.sh failed while clearing an earlier cluster"

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
mkdir -p "$STATE"/{pids,log,run,slurmctld,slurmd,munge,dev}
chmod 755 "$STATE"   # mariadbd (mysql) and munged (munge) must traverse it

node_lines=""
for n in "${NODES[@]}"; do
    node_lines+="NodeName=$n NodeAddr=$(node_addr "$n") CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB"
    node_lines+=" Gres=gpu:$NODE_GPUS State=UNKNOWN\n"
done
HOST="$(hostname -s)"
mkdir -p /etc/slurm
render() {  # render TEMPLATE DEST MODE
    sed -e "s|@HOST@|$HOST|g" -e "s|@CTL_ADDR@|$CTL_ADDR|g" -e "s|@STATE@|$STATE|g" \
        -e "s|@NODES@|$NODE_RANGE|g" -e "s|@NODE_LINES@|$node_lines|g" "$1" >"$2.tmp"
    chmod "$3" "$2.tmp"
    chown root:root "$2.tmp"
    mv "$2.tmp" "$2"
}
render "$HERE/slurm/slurm.conf.in" /etc/slurm/slurm.conf 644
render "$HERE/slurm/gres.conf.in" /etc/slurm/gres.conf 644
# slurmdbd refuses a slurmdbd.conf that is not 0600 and owned by SlurmUser (root).
render "$HERE/slurm/slurmdbd.conf.in" /etc/slurm/slurmdbd.conf 600

# The nodes' GPUs: character devices with NVIDIA's major number (slurmd refuses plain files).
for i in $(seq 0 $(( NODE_GPUS - 1 ))); do mknod "$STATE/dev/nvidia$i" c 195 "$i"; done

# Names every node (and the controller) resolves, bind-mounted over /etc/hosts inside each
# node's mount namespace only: gloo's rendezvous on tcp://node1:PORT needs them. The machine's
# own /etc/hosts is untouched, and node names are never looked up outside the nodes.
{
    echo "127.0.0.1 localhost"
    echo "$CTL_ADDR $HOST"
    for n in "${NODES[@]}"; do echo "$(node_addr "$n") $n"; done
} >"$STATE/hosts"

# ---- 3. The network: a bridge, and one namespace per node on it -----------------------------
STARTED=1   # from here on a failure tears down what was made (slurm_down.sh removes it all)
ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE"
ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for n in "${NODES[@]}"; do
    ns="$(netns "$n")"
    ip netns add "$ns" || die "cannot create network namespace $ns"
    ip link add "veth-$n" type veth peer name eth0 netns "$ns"
    ip link set "veth-$n" master "$BRIDGE" up
    ip -n "$ns" addr add "$(node_addr "$n")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

# ---- 4. munged (the cluster's own: socket and key in the state dir) -------------------------
dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
chown -R munge:munge "$STATE/munge"
chmod 755 "$STATE/munge"   # munged requires its socket's folder to be reachable by everyone
chmod 400 "$STATE/munge/munge.key"
start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground \
    --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    --seed-file="$STATE/munge/munged.seed"
check_started munged 15 bash -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET'"

# ---- 5. MariaDB (throw-away datadir inside the state dir, unix socket only) ------------------
mkdir -p "$STATE/mysql"
chown mysql:mysql "$STATE/mysql"
mysql_install_db --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --auth-root-authentication-method=socket --skip-test-db >"$STATE/log/mysql_install_db.out" 2>&1 \
    || die "mysql_install_db failed"
# The innodb values are the minimums slurmdbd checks for (it logs an error otherwise).
start mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --socket="$DB_SOCKET" --pid-file="$STATE/mysql/mariadbd.pid" --skip-networking \
    --log-error="$STATE/mysql/mariadbd.err" \
    --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 --innodb-log-file-size=64M
check_started mariadbd 60 mariadb-admin --no-defaults --socket="$DB_SOCKET" -uroot ping

# ---- 6. slurmdbd, then the accounting the cluster's policy needs -----------------------------
start slurmdbd env MYSQL_UNIX_PORT="$DB_SOCKET" /usr/sbin/slurmdbd -D
check_started slurmdbd 60 timeout 10 sacctmgr -n list cluster
mgr() { sacctmgr -i "$@" >/dev/null || die "sacctmgr $* failed"; }
mgr add cluster labrun
# scavenger first: urgent and normal name it as the QOS they preempt. A preempted scavenger
# job gets its --signal at once and is requeued after GraceTime.
mgr add qos scavenger Priority=0 PreemptMode=requeue GraceTime=15
mgr add qos urgent Priority=1000 Preempt=scavenger
mgr modify qos normal set Priority=10 Preempt=scavenger
# Accounts: lab (everyone's default) and two groups that share the GPUs by fair share.
mgr add account lab,vision,nlp Cluster=labrun Fairshare=1
mgr add user root Account=lab,vision,nlp DefaultAccount=lab
mgr modify user root set QOS=normal,urgent,scavenger DefaultQOS=normal

# ---- 7. slurmctld, then one slurmd per node namespace ---------------------------------------
# -i: ignore errors found while reading state files (there are none on a fresh state dir).
start slurmctld /usr/sbin/slurmctld -D -i
check_started slurmctld 30 bash -c 'timeout 5 scontrol ping | grep -q "is UP"'
for n in "${NODES[@]}"; do start_node "$n"; done
for n in "${NODES[@]}"; do check_started "slurmd-$n" 60 node_usable "$n"; done

# ---- 8. Smoke test: a real job on the nodes, then its accounting record ----------------------
# sbatch --wait, not srun: srun here would have the nodes call back to this namespace's address.
out="$(timeout 60 sbatch --wait -N3 -t 1 -J labrun-smoke -o "$STATE/log/smoke-%j.out" \
    --wrap 'srun hostname' 2>&1)" || die "test job on the three nodes failed: $out"
smoke="$(cat "$STATE"/log/smoke-*.out 2>/dev/null | sort | tr '\n' ' ')"
[ "$smoke" = "node1 node2 node3 " ] || die "test job ran on '$smoke', expected node1 node2 node3"
wait_for 30 bash -c 'sacct -n -X -P --name=labrun-smoke -o JobID | grep -q .' \
    || die "sacct has no record of the test job (accounting via slurmdbd is broken)"

config_id >"$STATE/config_id"
summary
