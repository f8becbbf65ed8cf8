#!/usr/bin/env bash
# Run titanlite's tests, installing what they need on first use (scripts/setup_env.sh --dev).
#
#   scripts/test.sh                 ruff and everything, on two pytest workers (time: BENCHMARKS.md)
#   scripts/test.sh -m "not slow"   the fast subset (under a minute; BENCHMARKS.md)
#   scripts/test.sh tests/test_ddp.py -x    any pytest arguments
#
# Also runs `ruff check` and `ruff format --check` on the whole repo when given no arguments.
# The whole suite or a subset of it by marker runs on two pytest workers; given a test file or
# a test, or -n, -s or --pdb, pytest runs in this one process (starts sooner, stops and prints
# as asked).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
py="$(scripts/setup_env.sh --dev)"
if [ $# -eq 0 ]; then
  "$py" -m ruff check .
  "$py" -m ruff format --check .
  # Much of the suite's wall time is spent waiting on process start-up and rendezvous, so
  # two pytest workers shorten it; whole files stay on one worker (their fixtures, namespaces
  # and worker pools are per module or per session), handed out in collection order, which
  # tests/conftest.py sorts longest first (xdist's default reorder put the longest last).
  set -- -n 2 --dist loadfile --no-loadscope-reorder
else
  one_process=0
  for arg in "$@"; do
    case "$arg" in
      tests/* | *.py | *.py::* | -n | -n[0-9]* | --numprocesses* | -s | --pdb | no:xdist) one_process=1 ;;
    esac
  done
  if [ "$one_process" -eq 0 ]; then
    set -- -n 2 --dist loadfile --no-loadscope-reorder "$@"
  fi
fi
# Byte-code written once: where PYTHONDONTWRITEBYTECODE is set, every trainer or worker process
# the tests start would otherwise compile titanlite's sources again (about 0.2 s of CPU each).
"$py" -m compileall -q titanlite tests >/dev/null
# Tests never reach the network: the Hub is refused at once, wandb stays offline.
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
export TITANLITE_PYTHON="$py"
exec "$py" -m pytest "$@"
