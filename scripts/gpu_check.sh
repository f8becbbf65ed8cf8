#!/usr/bin/env bash
# A short single-GPU benchmark for whenever a CUDA GPU is at hand, through ./run_train.sh
# exactly as a user runs it, with torch.compile: bf16 against float8 (model.converters =
# ["float8"], the rowwise recipe) for the 1B flavor and for Llama 3 8B's blocks. Prints
# tokens/s, MFU and peak memory of each run (medians over the steps after the first WARMUP),
# then float8's speed-up over bf16 per model.
#
#   scripts/gpu_check.sh [--section.key value ...]     (extra overrides go to every run)
#
# The 8B runs keep 8 of its 32 blocks (--model.n_layers 8): the full model's weights, gradients
# and AdamW states (16 bytes a parameter, 128 GB) do not fit one GPU, and each block has the
# full model's shapes, which is what float8's gain depends on.
# Environment: STEPS (default 30), WARMUP (default 10: compilation and allocator warm-up),
# DUMP (output folder; default a new temporary folder), RUNS (default "1B 1B-float8 8B
# 8B-float8"; also 1B-tensorwise, 8B-tensorwise and moe, moe-float8: Qwen3 30B-A3B's blocks
# (4 of 48) with float8 linears and float8 grouped-matmul experts). Exit status 2 without a
# CUDA GPU, 1 when a run fails. With flash-linear-attention installed it first compares that
# package's gated delta rule kernel with titanlite's plain one (scripts/check_fla.py); it then
# compares the sliding-window/sink FlexAttention path with the explicit kernel
# (scripts/check_flex.py).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/setup_env.sh")"
steps="${STEPS:-30}"
warmup="${WARMUP:-10}"
runs="${RUNS:-1B 1B-float8 8B 8B-float8}"

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
if [ "$warmup" -ge "$steps" ]; then
  echo "gpu_check: WARMUP ($warmup) must be smaller than STEPS ($steps)" >&2
  exit 2
fi
out="${DUMP:-$(mktemp -d -t titanlite-gpu-check.XXXXXX)}"
mkdir -p "$out"

args_of() {  # the run's overrides
  local model="${1%%-*}" kind="${1#*-}"
  [ "$kind" = "$1" ] && kind=bf16
  case "$model" in
    1B) echo --model.flavor 1B --training.local_batch_size 4 ;;
    8B) echo --model.flavor 8B --model.n_layers 8 --training.local_batch_size 2 ;;
    moe) echo --model.name qwen3_moe --model.flavor 30B-A3B --model.n_layers 4 \
           --training.local_batch_size 2 ;;
    *) echo "gpu_check: unknown run $1 (RUNS: 1B, 8B, moe, each with -float8 or -tensorwise)" >&2
       return 2 ;;
  esac
  case "$kind" in
    bf16) ;;
    float8) echo --model.converters float8 --float8.recipe rowwise
            if [ "$model" = moe ]; then echo --float8.experts true; fi ;;
    tensorwise) echo --model.converters float8 --float8.recipe tensorwise ;;
    *) echo "gpu_check: unknown run $1" >&2; return 2 ;;
  esac
}

for run in $runs; do args_of "$run" >/dev/null || exit 2; done
done_runs="" failed=""
if "$py" -c 'import fla' 2>/dev/null; then  # the Gated DeltaNet kernel, where installed
  "$py" "$repo/scripts/check_fla.py" || failed="$failed check_fla"
fi
# The masked core's FlexAttention path (windows, sinks, documents) against the explicit kernel.
"$py" "$repo/scripts/check_flex.py" || failed="$failed check_flex"
for run in $runs; do
  echo "gpu_check: $run" >&2
  # Any device-to-host sync inside a step (there should be none) is reported as a warning.
  # shellcheck disable=SC2046
  if NGPU=1 TITANLITE_CUDA_SYNC_CHECK=1 "$repo/run_train.sh" "$repo/train_configs/debug_model.toml" \
    --job.dump_folder "$out/$run" --job.description "gpu_check: $run compiled" \
    --training.seq_len 2048 --training.steps "$steps" \
    --training.mixed_precision_param bfloat16 --compile.enable \
    --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 \
    --checkpoint.enable false --validation.enable false $(args_of "$run") "$@"; then
    done_runs="$done_runs $run"
  else
    failed="$failed $run"
  fi
done
[ -n "$failed" ] && echo "gpu_check: failed:$failed (their output is above)" >&2
[ -n "$done_runs" ] || exit 1

# shellcheck disable=SC2086
"$py" - "$out" "$warmup" $done_runs <<'PY'
import json, statistics, sys
from pathlib import Path

out, warmup, runs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rows = {}
for name in runs:
    info = json.loads((out / name / "run.json").read_text())
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in steps if "tps" in r and r["step"] > warmup]
    if not steps:
        sys.exit(f"gpu_check: {name}: no steps after the warm-up were logged")
    rows[name] = (
        statistics.median(r["tps"] for r in steps), statistics.median(r["mfu_pct"] for r in steps),
        max(r["mem_peak_gib"] for r in steps), info, len(steps),
    )
info = next(iter(rows.values()))[3]
print(f"device  {info['device_name']} (peak {info['peak_flops_per_device'] / 1e12:.1f} TFLOP/s "
      f"bf16, {info['peak_flops_source']}); medians of the steps after {warmup}")
print(f"{'run':<16}{'parameters':>12}{'tokens/s':>12}{'MFU %':>8}{'peak GiB':>10}")
for name, (tps, mfu, mem, info, n) in rows.items():
    print(f"{name:<16}{info['num_params'] / 1e9:>11.2f}B{tps:>12,.0f}{mfu:>8.1f}{mem:>10.2f}")
for name, (tps, *_ ) in rows.items():
    base = name.split("-")[0]
    if name != base and base in rows:
        print(f"{name}: {tps / rows[base][0]:.2f}x the tokens/s of {base} (bf16)")
print(f"runs    {out}")
PY
[ -z "$failed" ]
