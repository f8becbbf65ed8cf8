#!/usr/bin/env bash
# Replica groups on this one machine (fault tolerance through torchft; docs/fault_tolerance.md):
# a lighthouse, then GROUPS replica groups, each an ordinary ./run_train.sh job.
#
#   scripts/ft_local.sh GROUPS [CONFIG.toml] [--section.key value | --section.key=value ...]
#
# Environment:
#   NGPU             processes per group (default 1)
#   FT_MIN_REPLICAS  groups the lighthouse needs for a quorum (default 1)
#   FT_JOIN_TIMEOUT_MS, FT_HEARTBEAT_TIMEOUT_MS  the lighthouse's (default 10000, 2000; below)
#   LOG_GROUP        the group whose output is also shown here (default 0; "none": none)
#   OMP_NUM_THREADS  intra-op threads per process (default: CPU cores / (GROUPS x NGPU))
# Group g trains into DUMP_FOLDER/replica-<g>/ (its metrics, checkpoints, run lock); its console
# output is appended to DUMP_FOLDER/logs/replica-<g>.log (with NGPU > 1 torchrun also keeps
# every rank's output under DUMP_FOLDER/logs/, as run_train.sh does), the lighthouse's to
# DUMP_FOLDER/logs/lighthouse.log.
# At start it prints, for every group, the line that starts that group alone against the same
# lighthouse: after a group failed, run its line while the others train on; the group heals
# from a live one and rejoins at the next step. (The lighthouse stops when the groups this
# script started have ended; a group restarted by hand is at their step and ends with them.)
# Ctrl-C is passed on to every group: each stops at the end of its current step (saving it
# when checkpoints are on); a second Ctrl-C stops them at once. SIGTERM is passed on too (each
# group saves and exits 75).
# Exit status: the worst of the groups' statuses (the highest; 0 when every group finished),
# 2 for bad input (one line on stderr), 130 for a Ctrl-C before the groups started, 1 when the
# lighthouse could not start.
set -uo pipefail

EXIT_INTERRUPTED=130
self="$(readlink -f "${BASH_SOURCE[0]}")"
repo="$(cd "$(dirname "$self")/.." && pwd)"
usage() {
  sed -n '5s/^# */usage: /p' "$self" >&2
  exit 2
}

interrupts=0 terminated=0
group_pids=()  # each group's run_train.sh (with NGPU=1: the trainer itself, it execs)
lighthouse_pid="" shown_pid=""
on_interrupt() {
  interrupts=$((interrupts + 1))
  local pid
  [ "${#group_pids[@]}" -gt 0 ] && echo "ft_local: Ctrl-C: passed on to every group" >&2
  for pid in "${group_pids[@]}"; do
    kill -INT -- -"$pid" 2>/dev/null
  done
}
on_terminate() {
  terminated=1
  local pid
  for pid in "${group_pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null  # run_train.sh passes it on to its trainers
  done
}
cleanup() {
  [ -n "$shown_pid" ] && kill "$shown_pid" 2>/dev/null
  if [ -n "$lighthouse_pid" ]; then
    kill -TERM "$lighthouse_pid" 2>/dev/null
    wait "$lighthouse_pid" 2>/dev/null
  fi
}
not_launched_if_stopped() {
  if [ "$interrupts" -gt 0 ]; then
    echo "ft_local: interrupted (Ctrl-C) before the groups started; nothing ran" >&2
    exit "$EXIT_INTERRUPTED"
  fi
  if [ "$terminated" -gt 0 ]; then
    echo "ft_local: stopped (SIGTERM) before the groups started; nothing ran" >&2
    exit 143
  fi
}
# Background jobs start with job control on (set -m ... set +m around each): each in a process
# group of its own. Then a Ctrl-C at the terminal reaches this script alone, which passes it
# on to each group's process group exactly as the terminal would to a run_train.sh in the
# foreground. (Without job control bash starts background commands with SIGINT ignored, and a
# shell cannot trap a signal ignored when it started: run_train.sh could not relay Ctrl-C to
# its trainers. Only around them: with job control on, a foreground command would get a
# process group of its own and the terminal's Ctrl-C, and this script would not see it.)
trap on_interrupt INT
trap on_terminate TERM HUP
trap cleanup EXIT

groups="${1:-}"
[ $# -gt 0 ] && shift
[[ "$groups" =~ ^[1-9][0-9]*$ ]] || usage
config="${CONFIG_FILE:-$repo/train_configs/debug_model.toml}"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
  config="$1"; shift
fi
ngpu="${NGPU:-1}"
[[ "$ngpu" =~ ^[1-9][0-9]*$ ]] || { echo "ft_local: NGPU must be a positive integer" >&2; exit 2; }

py="$("$repo/scripts/setup_env.sh")" || exit $?
lighthouse_bin="$(dirname "$py")/torchft_lighthouse"
if [ ! -x "$lighthouse_bin" ]; then
  echo "ft_local: replica groups need torchft, which is not installed:" \
    "pip install 'titanlite[ft]'" >&2
  exit 2
fi

# One machine, one job per group: a rendezvous or store address from the caller's environment
# (a multi-node setting, a shell inside torchrun) would make every group join the same one.
# run_train.sh's default rendezvous, localhost:0, is a free port per launch: one per group.
unset RDZV_ENDPOINT RDZV_ID NNODES MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK \
  LOCAL_WORLD_SIZE TITANLITE_LAUNCH_TIME
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  # run_train.sh splits the cores between the processes of its own launch only.
  cores="$(nproc 2>/dev/null || echo 1)"
  threads=$(( cores / (groups * ngpu) )); [ "$threads" -ge 1 ] || threads=1
  export OMP_NUM_THREADS="$threads"
fi

# The flags that make a run one of the groups; they come last, so they win over the same keys
# in the arguments.
ft_args() {  # ft_args REPLICA_ID LIGHTHOUSE
  printf '%s\n' --fault_tolerance.enable true --fault_tolerance.group_size "$groups" \
    --fault_tolerance.replica_id "$1" --fault_tolerance.lighthouse "$2"
}

# Check the config once, before anything starts (bad input: one line, exit 2), and learn the
# dump folder (for the logs). Group 0 stands for all: the groups differ only in replica_id. The
# lighthouse does not exist yet (its log goes into that folder); the check only needs an
# address, never connects. Ctrl-C is ignored meanwhile and counted (below), as run_train.sh does.
answer="$(mktemp -t titanlite-dump-folder.XXXXXX)" || exit 1
mapfile -t args0 < <(ft_args 0 http://127.0.0.1:0)
(
  trap '' INT
  TITANLITE_DUMP_FOLDER_FILE="$answer" WORLD_SIZE="$ngpu" \
    exec "$py" -m titanlite.preflight --job.config_file "$config" "$@" "${args0[@]}"
)
status=$?
dump_folder="$(cat "$answer" 2>/dev/null)"
rm -f "$answer"
not_launched_if_stopped
[ "$status" -eq 100 ] && exit 0  # a dry run (--job.dry_run): done, nothing to launch
[ "$status" -eq 0 ] || exit "$status"
logs="$dump_folder/logs"
mkdir -p "$logs" || exit 1

# The lighthouse, on loopback only (every group is on this machine), on a free port: it binds
# port 0 and says which port it got in its log. Its timeouts are for one machine, where
# heartbeats (every 100 ms) and quorum requests travel over loopback and arrive in
# milliseconds unless a process is gone:
# - heartbeat 2 s (torchft's default 5 s allows for networks between nodes): a group silent
#   for 2 s is dead. The survivors' next step waits about that long at most (less, below).
# - join 10 s (default 60 s): once a member of the previous quorum is missing, how long a
#   quorum waits for groups that heartbeat but have not asked to join. A live group is waited
#   for that long (a save or a validation slower in one group, a pause): one that asks later
#   is left out of the step and healed at the next, its step lost. The timer starts with the
#   first request, and a group coming back asks early and waits, so a join timeout shorter
#   than a step would leave out whichever survivor asks second. A dead group is not waited for
#   so long: it stops heartbeating and is out after the heartbeat timeout, whatever this is.
# Its log says which groups were in each quorum (about 1 kB a step; RUST_LOG=info is needed
# for the line that names the port).
lighthouse_log="$logs/lighthouse.log"
offset="$(stat -c %s "$lighthouse_log" 2>/dev/null || echo 0)"
set -m
RUST_LOG=info "$lighthouse_bin" --bind 127.0.0.1:0 --min_replicas "${FT_MIN_REPLICAS:-1}" \
  --join_timeout_ms "${FT_JOIN_TIMEOUT_MS:-10000}" \
  --heartbeat_timeout_ms "${FT_HEARTBEAT_TIMEOUT_MS:-2000}" --quorum_tick_ms 100 \
  >>"$lighthouse_log" 2>&1 &
lighthouse_pid=$!
set +m
port=""
for _ in $(seq 100); do  # 10 s at most
  port="$(tail -c +"$((offset + 1))" "$lighthouse_log" 2>/dev/null \
    | sed -n 's/.*listening on: http:\/\/[^ ]*:\([0-9][0-9]*\).*/\1/p' | head -n 1)"
  [ -n "$port" ] && break
  kill -0 "$lighthouse_pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  echo "ft_local: the lighthouse did not start; see $lighthouse_log" >&2
  exit 1
fi
lighthouse="http://127.0.0.1:$port"
echo "ft_local: lighthouse $lighthouse (pid $lighthouse_pid, log $lighthouse_log)"

# The groups. Each line printed is the whole command for one group: run again as it is, it
# restarts that group against this lighthouse.
for ((g = 0; g < groups; g++)); do
  mapfile -t ftg < <(ft_args "$g" "$lighthouse")
  printf -v line '%q ' "$repo/run_train.sh" "$config" "$@" "${ftg[@]}"
  printf -v line 'cd %q && NGPU=%q OMP_NUM_THREADS=%q %s>>%q 2>&1' "$PWD" "$ngpu" \
    "$OMP_NUM_THREADS" "$line" "$logs/replica-$g.log"
  echo "ft_local: replica $g: $line"
done
not_launched_if_stopped
for ((g = 0; g < groups; g++)); do
  # Stopped while launching: the groups already started got the signal; start no more.
  [ "$interrupts" -gt 0 ] || [ "$terminated" -gt 0 ] && break
  if [ "${LOG_GROUP:-0}" = "$g" ]; then  # shown here as it is written
    touch "$logs/replica-$g.log"
    set -m
    tail -n 0 --pid=$$ -f "$logs/replica-$g.log" &
    shown_pid=$!
    set +m
  fi
  mapfile -t ftg < <(ft_args "$g" "$lighthouse")
  echo "ft_local: replica $g started $(date '+%F %T')" >>"$logs/replica-$g.log"
  set -m
  NGPU="$ngpu" "$repo/run_train.sh" "$config" "$@" "${ftg[@]}" >>"$logs/replica-$g.log" 2>&1 &
  group_pids+=($!)
  set +m
done

# Wait for every group. A trapped signal (Ctrl-C, SIGTERM) interrupts `wait` with a status
# above 128 while the group goes on: wait again until it has really ended (a zombie still
# answers kill -0, so its status is collected by the next wait).
worst=0
for ((g = 0; g < ${#group_pids[@]}; g++)); do
  pid="${group_pids[$g]}"
  while :; do
    wait "$pid"
    status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  echo "ft_local: replica $g ended with status $status (log $logs/replica-$g.log)" >&2
  [ "$status" -gt "$worst" ] && worst="$status"
done
exit "$worst"
