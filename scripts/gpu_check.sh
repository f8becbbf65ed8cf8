#!/usr/bin/env bash
# A short single-GPU benchmark for whenever a CUDA GPU is at hand: the 1B flavor in bf16 with
# torch.compile, through ./run_train.sh exactly as a user runs it. Prints tokens/s, MFU and
# peak memory (medians over the steps after the first WARMUP), then the numbers' source file.
#
#   scripts/gpu_check.sh [--section.key value ...]     (extra overrides go to run_train.sh)
#
# Environment: STEPS (default 30), WARMUP (default 10: compilation and allocator warm-up),
# DUMP (output folder; default a new temporary folder). Exit status 2 without a CUDA GPU.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$("$repo/scripts/setup_env.sh")"
steps="${STEPS:-30}"
warmup="${WARMUP:-10}"

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
if [ "$warmup" -ge "$steps" ]; then
  echo "gpu_check: WARMUP ($warmup) must be smaller than STEPS ($steps)" >&2
  exit 2
fi
out="${DUMP:-$(mktemp -d -t titanlite-gpu-check.XXXXXX)}"

# Any device-to-host sync inside a step (there should be none) is reported as a warning.
NGPU=1 TITANLITE_CUDA_SYNC_CHECK=1 "$repo/run_train.sh" "$repo/train_configs/debug_model.toml" \
  --job.dump_folder "$out" --job.description "gpu_check: 1B bf16 compiled" \
  --model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4 \
  --training.steps "$steps" --training.mixed_precision_param bfloat16 --compile.enable \
  --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 \
  --checkpoint.enable false --validation.enable false "$@"

"$py" - "$out" "$warmup" <<'PY'
import json, statistics, sys
from pathlib import Path

out, warmup = Path(sys.argv[1]), int(sys.argv[2])
run = json.loads((out / "run.json").read_text())
steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
steps = [r for r in steps if "tps" in r and r["step"] > warmup]
if not steps:
    sys.exit("gpu_check: no steps after the warm-up were logged")
print(f"device           {run['device_name']} (peak {run['peak_flops_per_device'] / 1e12:.1f} "
      f"TFLOP/s, {run['peak_flops_source']})")
print(f"model            {run['num_params'] / 1e9:.2f} B parameters, {run['train_dtype']} compute")
print(f"tokens/s         {statistics.median(r['tps'] for r in steps):,.0f} (median of {len(steps)} steps)")
print(f"MFU              {statistics.median(r['mfu_pct'] for r in steps):.1f} %")
print(f"peak memory      {max(r['mem_peak_gib'] for r in steps):.2f} GiB allocated")
print(f"metrics          {out / 'metrics.jsonl'}")
PY
