#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for multi-node tests.
#
#   scripts/local_cluster.sh up     [--dir D]   start it (installs slurm-wlm and munge if missing)
#   scripts/local_cluster.sh down   [--dir D]   stop everything it started, remove the namespaces
#   scripts/local_cluster.sh status [--dir D]   sinfo (exit 1 when the cluster is not up)
#   scripts/local_cluster.sh exec NODE [--dir D] -- CMD [ARG...]
#                                               run CMD on node1 or node2 (its network, hostname
#                                               and hosts file; SLURM_CONF set), e.g. sbatch
#
# Two "hosts" are two network namespaces, tl1 (10.200.0.1, node1) and tl2 (10.200.0.2, node2),
# joined by a veth pair; each daemon also gets its own hostname and a hosts file naming both
# nodes, in a private UTS and mount namespace (the machine's /etc/hosts and hostname are never
# touched). Only /etc/hosts is covered there, so the repository, its .venv, /tmp and the rest
# of the filesystem are the same on both nodes: they share it, as nodes of a real cluster share
# their network filesystem. munged runs in the root namespace and is reached through its unix
# socket (a path, so every namespace sees it); slurmctld and slurmd listen only on the veth
# addresses. No traffic leaves the machine. Recipe: docs/multinode.md ("The local test cluster").
#
# All state (configuration, munge key, daemon logs, spool) lives under D (default
# /tmp/titanlite-cluster, or $TITANLITE_CLUSTER_DIR). `up` is idempotent; `down` stops the
# daemons by the PIDs in their pid files, ends any process still inside the namespaces by PID,
# and deletes the namespaces. Needs root; when not root, or when namespaces cannot be created,
# it refuses with one line and exit status 2. Other failures exit 1 and name the log to read.
set -uo pipefail

NODES=(node1 node2)
NETNS=(tl1 tl2)
ADDRS=(10.200.0.1 10.200.0.2)
VETH=(vtl1 vtl2)
# Remembers which folder the running cluster uses, so `down` and `exec` find it without --dir.
ACTIVE=/run/titanlite-cluster.dir

self="$(readlink -f "${BASH_SOURCE[0]}")"
die() { echo "local_cluster: $*" >&2; exit 1; }
refuse() { echo "local_cluster: $*" >&2; exit 2; }
usage() {
  sed -n '3,9p' "$self" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd="${1:-}"; [ $# -gt 0 ] && shift
node=""
if [ "$cmd" = exec ] || [ "$cmd" = _node ]; then
  node="${1:-}"; [ $# -gt 0 ] && shift
fi
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) [ $# -ge 2 ] || usage; dir="$2"; shift 2 ;;
    --dir=*) dir="${1#--dir=}"; shift ;;
    --) shift; break ;;
    *) [ "$cmd" = exec ] || [ "$cmd" = _node ] || usage; break ;;
  esac
done
if [ -z "$dir" ]; then
  dir="${TITANLITE_CLUSTER_DIR:-}"
  if [ -z "$dir" ] && [ "$cmd" != up ] && [ -s "$ACTIVE" ]; then dir="$(cat "$ACTIVE")"; fi
  dir="${dir:-/tmp/titanlite-cluster}"
fi
D="$(realpath -m "$dir")"
export SLURM_CONF="$D/slurm.conf"

node_index() {  # node_index NAME: 0 or 1
  local i
  for i in "${!NODES[@]}"; do [ "${NODES[$i]}" = "$1" ] && { echo "$i"; return 0; }; done
  return 1
}

# on_node NAME CMD...: CMD in the node's network namespace, with its own hostname and hosts
# file. nsenter rather than `ip netns exec`: the latter remounts /sys, and slurmd 22.05 then
# fails with "Unable to initialize cgroup plugin".
on_node() {
  local i; i="$(node_index "$1")" || die "unknown node '$1' (node1 or node2)"
  shift
  ${ON_NODE_EXEC:+exec} nsenter --net="/run/netns/${NETNS[$i]}" \
    unshare --uts --mount --propagation private "$self" _node "${NODES[$i]}" --dir "$D" -- "$@"
}

# In the node's fresh UTS and mount namespaces (see on_node): name the host, cover /etc/hosts.
if [ "$cmd" = _node ]; then
  hostname "$node" && mount --bind "$D/hosts" /etc/hosts || exit 1
  exec "$@"
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
netns_exists() { [ -e "/run/netns/$1" ]; }
daemon_pidfiles() { echo "$D/slurmd-node1.pid $D/slurmd-node2.pid $D/slurmctld.pid"; }

is_up() {
  local f
  for f in $(daemon_pidfiles) "$D/munge/munged.pid"; do alive "$f" || return 1; done
  for f in "${NETNS[@]}"; do netns_exists "$f" || return 1; done
}

slurm_cmd() {  # a SLURM client command, run from inside node1's network namespace
  nsenter --net="/run/netns/${NETNS[0]}" "$@"
}

stop_pid() {  # stop_pid PID: SIGTERM, then SIGKILL after 10 s
  local pid="$1" _
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null
}

stop_pidfile() {
  [ -s "$1" ] && stop_pid "$(cat "$1")"
  rm -f "$1"
}

down() {
  local f ns pid
  if netns_exists "${NETNS[0]}" && alive "$D/slurmctld.pid"; then
    # Running jobs first, so that slurmd can end their steps in order.
    slurm_cmd scancel --user=root >/dev/null 2>&1 || true
  fi
  for f in $(daemon_pidfiles); do stop_pidfile "$f"; done
  # Whatever is still inside the namespaces (job steps, trainers, commands run with `exec`)
  # was started through this cluster: end it by PID.
  for ns in "${NETNS[@]}"; do
    if netns_exists "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do stop_pid "$pid"; done
      ip netns del "$ns" 2>/dev/null || echo "local_cluster: could not delete namespace $ns" >&2
    fi
  done
  stop_pidfile "$D/munge/munged.pid"
  # Only forget the active folder if it is this one.
  if [ -s "$ACTIVE" ] && [ "$(cat "$ACTIVE")" = "$D" ]; then rm -f "$ACTIVE"; fi
}

install_packages() {
  local missing=0 c
  for c in munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel; do
    command -v "$c" >/dev/null 2>&1 || missing=1
  done
  [ "$missing" = 0 ] && return 0
  echo "local_cluster: installing slurm-wlm and munge (apt-get)..." >&2
  mkdir -p "$D/log"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge; } \
    >"$D/log/apt.log" 2>&1 || die "apt-get install slurm-wlm munge failed; see $D/log/apt.log"
}

make_namespaces() {
  local i err
  for i in 0 1; do
    err="$(ip netns add "${NETNS[$i]}" 2>&1)" \
      || refuse "cannot create network namespace ${NETNS[$i]}: ${err//$'\n'/ }"
  done
  ip link add "${VETH[0]}" type veth peer name "${VETH[1]}" || return 1
  for i in 0 1; do
    ip link set "${VETH[$i]}" netns "${NETNS[$i]}" &&
      ip -n "${NETNS[$i]}" addr add "${ADDRS[$i]}/24" dev "${VETH[$i]}" &&
      ip -n "${NETNS[$i]}" link set lo up &&
      ip -n "${NETNS[$i]}" link set "${VETH[$i]}" up || return 1
  done
}

write_config() {
  mkdir -p "$D/log" "$D/state" "$D/spool" "$D/munge"
  printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$D/hosts"
  local i
  for i in 0 1; do printf '%s %s\n' "${ADDRS[$i]}" "${NODES[$i]}" >>"$D/hosts"; done
  cat >"$D/slurm.conf" <<EOF
# Written by scripts/local_cluster.sh: two nodes on this machine, all state under $D.
ClusterName=titanlite-test
SlurmctldHost=${NODES[0]}(${ADDRS[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket.2
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
NodeName=${NODES[0]} NodeAddr=${ADDRS[0]} CPUs=1
NodeName=${NODES[1]} NodeAddr=${ADDRS[1]} CPUs=1
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  local m="$D/munge"
  chmod 755 "$m"  # munged refuses a socket folder that others cannot enter
  if [ ! -s "$m/munge.key" ]; then
    (umask 077 && head -c 1024 /dev/urandom >"$m/munge.key") || return 1
  fi
  chmod 400 "$m/munge.key"
  # --force: munged also wants every folder above the socket open to all; a private test
  # folder (pytest's are 0700) is fine here, since only root talks to this munged.
  munged --force --socket="$m/munge.socket.2" --key-file="$m/munge.key" --log-file="$m/munged.log" \
    --pid-file="$m/munged.pid" --seed-file="$m/munged.seed" >>"$D/log/daemons.log" 2>&1
}

start_nodes() {
  # Each node's daemons live in that node's namespaces (slurmctld on node1 only).
  # (Both fork into the background and write their pid files.)
  on_node node1 slurmctld -f "$SLURM_CONF" >>"$D/log/daemons.log" 2>&1 &&
    on_node node1 slurmd -f "$SLURM_CONF" >>"$D/log/daemons.log" 2>&1 &&
    on_node node2 slurmd -f "$SLURM_CONF" >>"$D/log/daemons.log" 2>&1
}

wait_idle() {  # both nodes idle in sinfo (they are in about a second)
  local _ states
  for _ in $(seq 150); do
    states="$(slurm_cmd sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')"
    [ "$states" = "idle " ] && return 0
    sleep 0.2
  done
  return 1
}

up() {
  [ "$(id -u)" = 0 ] || refuse "needs root (network namespaces, daemons); run as root or skip"
  if is_up; then echo "local_cluster: already up ($D)"; return 0; fi
  local other
  other="$(cat "$ACTIVE" 2>/dev/null)"
  if [ -n "$other" ] && [ "$other" != "$D" ] && alive "$other/slurmctld.pid"; then
    die "another local cluster is up (--dir $other); stop it first: $0 down --dir $other"
  fi
  # A half-started or stale cluster (e.g. after a crash): clear it out first.
  if netns_exists "${NETNS[0]}" || netns_exists "${NETNS[1]}" || [ -s "$D/munge/munged.pid" ]; then
    down
  fi
  local err
  err="$(unshare --uts --mount --propagation private true 2>&1)" \
    || refuse "cannot create UTS/mount namespaces: ${err//$'\n'/ }"
  make_namespaces || { down; die "could not set up the veth pair between tl1 and tl2"; }
  install_packages || { down; exit 1; }
  write_config
  echo "$D" >"$ACTIVE"
  start_munge || { down; die "munged did not start; see $D/munge/munged.log"; }
  start_nodes || { down; die "slurm daemons did not start; see $D/log/"; }
  wait_idle || { down; die "nodes did not become idle; see $D/log/slurmctld.log"; }
  echo "local_cluster: up: node1 ${ADDRS[0]}, node2 ${ADDRS[1]}; SLURM_CONF=$D/slurm.conf"
}

case "$cmd" in
  up) up ;;
  down)
    [ "$(id -u)" = 0 ] || refuse "needs root"
    down
    echo "local_cluster: down" ;;
  status)
    if ! is_up; then echo "local_cluster: not up ($D)"; exit 1; fi
    slurm_cmd sinfo ;;
  exec)
    [ $# -gt 0 ] || usage
    is_up || die "not up ($D); run: $0 up"
    ON_NODE_EXEC=1 on_node "$node" "$@" ;;
  *) usage ;;
esac
