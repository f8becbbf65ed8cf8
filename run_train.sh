#!/usr/bin/env bash
# Train titanlite.
#
#   ./run_train.sh [CONFIG.toml] [--section.key value | --section.key=value ...]
#
# CONFIG defaults to $CONFIG_FILE or train_configs/debug_model.toml. The first run installs
# what is missing (scripts/setup_env.sh). Environment:
#   NGPU           processes on this node (default: number of CUDA GPUs, else 1)
#   LOG_RANK       comma-separated local ranks whose output is shown (default 0)
#   NNODES         nodes in the job (default 1); with >1 also set RDZV_ENDPOINT=HOST:PORT
#   RDZV_ENDPOINT  c10d rendezvous address (default localhost:0, a free port)
#   RDZV_ID        rendezvous id shared by all nodes of one job (default: none)
#   MAX_RESTARTS   times torchrun restarts the group after a rank fails (default 0)
#   OMP_NUM_THREADS  intra-op threads per rank (default: CPU cores / NGPU)
#   TITANLITE_TORCHRUN=1  launch through torchrun even for a single process
#   PYTORCH_CUDA_ALLOC_CONF  CUDA allocator settings (default expandable_segments:True)
# Exit status: 0 done, 2 bad input (one line on stderr), 3 loss became non-finite,
# 4 a rank was lost (a collective failed or timed out; one line names the rank),
# 75 stopped by SIGTERM/SIGUSR1 after saving a checkpoint (run the same command to resume),
# 130 stopped by Ctrl-C: the first stops at the end of the current step and saves it, a second
# stops at once without saving (the same command resumes from the latest complete checkpoint).
set -uo pipefail

# Ctrl-C. One process is exec'd (below) and gets the terminal's SIGINT itself. On the torchrun
# path the trainers run in sessions of their own (torchrun starts them so) and see no terminal
# signal, and torchrun is told not to handle SIGINT (its own handling turns a second Ctrl-C
# into SIGTERM and a 30 s wait); this script relays it instead: the first as SIGINT to every
# trainer listed in $pids_file (each adds its pid once its handler is in place, so one that
# is still starting gets it as soon as it can take it), the second as SIGKILL: at once, and as
# safe for the checkpoints as any kill.
EXIT_INTERRUPTED=130
interrupts=0  # Ctrl-Cs so far
relayed=0     # lines of $pids_file relayed so far
pids_file=""  # set once trainers are launched
on_interrupt() {
  interrupts=$((interrupts + 1))
  [ -n "$pids_file" ] || return 0  # not launched yet: checked before launching
  if [ "$interrupts" -eq 1 ]; then
    echo "run_train: Ctrl-C: stopping at the end of the current step (saving it when" \
      "checkpoints are on); Ctrl-C again stops at once without saving" >&2
  else
    echo "run_train: Ctrl-C again: stopping at once, without saving" >&2
    relayed=0  # every trainer again, now with SIGKILL
  fi
  relay_interrupt
}
relay_interrupt() {
  local sig=INT n=0 pid
  [ "$interrupts" -ge 2 ] && sig=KILL
  [ -f "$pids_file" ] || return 0
  while read -r pid; do
    n=$((n + 1))
    [ "$n" -gt "$relayed" ] && kill -"$sig" "$pid" 2>/dev/null
  done <"$pids_file"
  relayed=$n
}

# Runs a command in the background and returns its exit status. Preemption (SLURM signals
# every process of the step, or only this script with --signal=B:USR1) is passed on as SIGTERM;
# a signal interrupts `wait`, so it waits again until the command is really gone. After a
# Ctrl-C it looks for newly started trainers to relay it to, five times a second.
supervise() {
  "$@" &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM USR1
  local ended=""
  while kill -0 "$child" 2>/dev/null; do
    if [ "$interrupts" -gt 0 ]; then
      relay_interrupt
      # torchrun takes any exit for a failure: with MAX_RESTARTS it would start the trainers
      # again after they stopped on Ctrl-C. SIGTERM makes it stop the rest instead, as it does
      # without restarts (a trainer still saving finishes first: it is already stopping).
      if [ -z "$ended" ] && [ "${MAX_RESTARTS:-0}" != 0 ] \
         && grep -q "^$EXIT_INTERRUPTED"$'\t' "${TITANLITE_ERROR_FILE:-/dev/null}"; then
        ended=1
        kill -TERM "$child" 2>/dev/null
      fi
      sleep 0.2 & wait $!
    else
      wait "$child"
    fi
  done
  wait "$child"
}

not_launched_if_interrupted() {
  if [ "$interrupts" -gt 0 ]; then
    echo "titanlite: interrupted (Ctrl-C) before the run started; nothing ran" >&2
    exit "$EXIT_INTERRUPTED"
  fi
}

# The whole script is one function, read completely before it runs: editing this file
# while a run is in flight cannot change what that run executes.
main() {
  trap on_interrupt INT
  # The trainer reports its start-up time from here (a caller may set an earlier start).
  export TITANLITE_LAUNCH_TIME="${TITANLITE_LAUNCH_TIME:-$(date +%s.%N)}"
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

  config="${CONFIG_FILE:-$repo/train_configs/debug_model.toml}"
  if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    config="$1"; shift
  fi

  py="$("$repo/scripts/setup_env.sh")"
  status=$?
  not_launched_if_interrupted  # a Ctrl-C while it checked or installed
  [ "$status" -eq 0 ] || exit "$status"

  for arg in "$@"; do
    if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
      exec "$py" -m titanlite.train --help
    fi
  done

  if [ -z "${NGPU:-}" ]; then
    NGPU=1
    if command -v nvidia-smi >/dev/null 2>&1; then
      gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
      [ "${gpus:-0}" -gt 0 ] && NGPU="$gpus"
    fi
  fi
  NNODES="${NNODES:-1}"
  LOG_RANK="${LOG_RANK:-0}"
  # CUDA: growable segments instead of fixed blocks cut fragmentation when shapes vary
  # (e.g. the last, shorter batch of an epoch). No effect on CPU.
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
  if [ -z "${OMP_NUM_THREADS:-}" ]; then
    # Split the cores between the ranks of this node instead of oversubscribing them.
    cores="$(nproc 2>/dev/null || echo 1)"
    threads=$(( cores / NGPU )); [ "$threads" -ge 1 ] || threads=1
    export OMP_NUM_THREADS="$threads"
  fi

  # Config, layout and input files are checked once, before any process starts. Status 100
  # means preflight did a dry run (--job.dry_run) and there is nothing to launch.
  # It also says where the run writes (for torchrun's logs, below), in a file removed at once.
  # It runs with Ctrl-C ignored (this script counts it and stops before launching, below): cut
  # short while Python starts or imports, it printed a traceback and exited 1 or 130.
  answer="$(mktemp -t titanlite-dump-folder.XXXXXX 2>/dev/null)"
  (
    trap '' INT
    TITANLITE_DUMP_FOLDER_FILE="$answer" WORLD_SIZE=$(( NGPU * NNODES )) \
      exec "$py" -m titanlite.preflight --job.config_file "$config" "$@"
  )
  status=$?
  dump_folder=""
  if [ -n "$answer" ]; then
    dump_folder="$(cat "$answer" 2>/dev/null)"
    rm -f "$answer"
  fi
  [ "$status" -eq 100 ] && exit 0
  [ "$status" -eq 0 ] || exit "$status"

  # Multi-node (docs/multinode.md): every node must name the same rendezvous address; the
  # default localhost:0 (a free local port) would leave each node waiting for the others
  # forever. (Checked after preflight: a dry run is one local process and needs none.)
  if [ "$NNODES" != 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "run_train: NNODES=$NNODES needs RDZV_ENDPOINT=HOST:PORT, the same on every node" >&2
    exit 2
  fi

  not_launched_if_interrupted

  # One process on one node without restarts needs no torchrun: starting the trainer directly
  # saves torchrun's own `import torch` (~4 s of CPU here) on every launch. It replaces this
  # shell (exec): signals reach it as they would reach the script (Ctrl-C included), exit
  # statuses and outputs are the same, and no process is left behind when either ends. Set
  # TITANLITE_TORCHRUN=1 to go through torchrun anyway.
  if [ "$NGPU" = 1 ] && [ "$NNODES" = 1 ] && [ "${MAX_RESTARTS:-0}" = 0 ] \
     && [ "${TITANLITE_TORCHRUN:-0}" != 1 ]; then
    unset TITANLITE_ERROR_FILE TITANLITE_INTERRUPT_PIDS TITANLITE_LAUNCHER_PID
    exec "$py" -m titanlite.train --job.config_file "$config" "$@"
  fi

  # Two small files of this launch: the ranks' error lines and their pids (for the Ctrl-C relay).
  # They live in the run's logs folder, named by node and launcher pid (a second launch on the
  # same folder, refused by the run lock, must not touch the first's): a launcher killed with
  # SIGKILL cannot remove them, and in /tmp they piled up, so each launch removes this node's
  # files of launchers that are gone. (uname, not $HOSTNAME: sbatch exports the submitting
  # host's environment to every node.)
  node="$(uname -n 2>/dev/null || echo node)"
  errors="" pids=""
  if [ -n "$dump_folder" ] && mkdir -p "$dump_folder/logs" 2>/dev/null; then
    for old in "$dump_folder/logs/launcher.$node".*.{errors,pids}; do
      [ -e "$old" ] || [ -L "$old" ] || continue
      pid="${old%.*}"; pid="${pid##*.}"
      [[ "$pid" =~ ^[0-9]+$ ]] || continue
      kill -0 "$pid" 2>/dev/null || [ -d "/proc/$pid" ] || rm -f "$old"
    done
    errors="$dump_folder/logs/launcher.$node.$$.errors"
    pids="$dump_folder/logs/launcher.$node.$$.pids"
    rm -f "$errors" "$pids"
    # Created anew (noclobber): never through a link left in their place.
    if ! (set -C; : >"$errors" && : >"$pids") 2>/dev/null; then
      rm -f "$errors" "$pids"; errors="" pids=""
    fi
  fi
  if [ -z "$errors" ]; then
    errors="$(mktemp -t titanlite-errors.XXXXXX)"
    pids="$(mktemp -t titanlite-pids.XXXXXX)"
  fi
  trap 'rm -f "$errors" "$pids"' EXIT
  export TITANLITE_ERROR_FILE="$errors" TITANLITE_INTERRUPT_PIDS="$pids" TITANLITE_LAUNCHER_PID=$$

  rdzv_args=(--rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:-localhost:0}")
  # Every rank's output, the ranks LOG_RANK leaves off the console included, goes to files
  # under the run's folder, one folder per launch and node:
  #   DUMP_FOLDER/logs/<RDZV_ID or none>_<random>/attempt_N/LOCAL_RANK/{stdout,stderr}.log
  # Without --log-dir torchrun would keep them in a new /tmp/torchelastic_* folder per launch,
  # never removed.
  log_args=()
  [ -n "$dump_folder" ] && log_args=(--log-dir "$dump_folder/logs")
  # With restarts, give each attempt a fresh store: torchrun otherwise shares its rendezvous
  # store with the trainers, and keys of the failed attempt survive into the next, so a
  # restarted rank can read a dead peer's address and fail ("Gloo connectFullMesh failed ...
  # Connection refused"; seen across nodes; pytorch/pytorch#135712).
  if [ "${MAX_RESTARTS:-0}" != 0 ]; then
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
  fi
  [ -n "${RDZV_ID:-}" ] && rdzv_args+=(--rdzv_id "$RDZV_ID")

  not_launched_if_interrupted
  pids_file="$pids"
  # torchrun passes SIGTERM on to every rank, which saves and exits 75. It handles its default
  # signals but SIGINT, which stays ignored (a background command's) for it and for the
  # trainers until they handle it: this script relays Ctrl-C (on_interrupt).
  supervise "$py" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NGPU" \
    "${rdzv_args[@]}" --max-restarts="${MAX_RESTARTS:-0}" --local-ranks-filter "$LOG_RANK" \
    --signals-to-handle SIGTERM,SIGHUP,SIGQUIT --role rank --tee 3 "${log_args[@]}" \
    -m titanlite.train --job.config_file "$config" "$@"
  status=$?

  if [ "$interrupts" -ge 2 ]; then
    echo "titanlite: stopped at once on the second Ctrl-C, nothing saved; the latest complete" \
      "checkpoint is untouched: run the same command to resume" >&2
    exit "$EXIT_INTERRUPTED"
  fi
  # A rank that stopped on bad input or divergence wrote "STATUS<TAB>message" lines: repeat
  # them last, after torchrun's own report (once each: every rank writes the same), and exit
  # with the first status.
  if [ "$status" -ne 0 ] && [ -s "$errors" ]; then
    IFS=$'\t' read -r code _ <"$errors"
    awk -F '\t' -v code="$code" '$1 == code && !seen[$2]++ { print $2 }' "$errors" >&2
    exit "$code"
  fi
  exit "$status"
}

main "$@"
exit $?
