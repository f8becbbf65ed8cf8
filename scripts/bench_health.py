"""Benchmark what [health] costs a training step: the collective record, the watchdog, the
straggler gather at logged steps and the replica fingerprints.

Each configuration trains the same small model through ./run_train.sh (NGPU processes,
gloo on a CPU), and the table shows the median time per step over the steps after warm-up
(from metrics.jsonl: logged steps' tokens per second) and its ratio to health off, measured in
the same invocation, the configurations interleaved over --repeats rounds so that a busy
machine slows them alike:

  off              health.enable = false
  defaults         health on with its defaults (fingerprints every 100 steps)
  fingerprints/1   fingerprints at every step: the cost of one check, which the default
                   interval divides by 100

    python scripts/bench_health.py --ngpu 2 --layout ddp --steps 40 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LAYOUTS = {
    "ddp": ["--parallelism.data_parallel_replicate_degree", "{ngpu}"],
    "fsdp": ["--parallelism.data_parallel_shard_degree", "{ngpu}"],
}
CONFIGS = {
    "off": ["--health.enable", "false"],
    "defaults": [],
    "fingerprints/1": ["--health.sdc_check_interval", "1"],
}


def step_seconds(folder: Path, skip: int) -> float:
    """Median seconds per step over the logged steps after ``skip`` (tokens per second of
    this rank and the tokens a step gives it)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "tps" in r and r["step"] > skip]
    return statistics.median(1 / r["tps"] for r in logged)


def run(config: list[str], args: argparse.Namespace, folder: Path) -> float:
    layout = [a.format(ngpu=args.ngpu) for a in LAYOUTS[args.layout]]
    cmd = [
        str(REPO / "run_train.sh"),
        str(REPO / "train_configs" / "debug_model.toml"),
        *layout,
        *config,
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(folder),
    ]
    env = {**os.environ, "NGPU": str(args.ngpu)}
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return step_seconds(folder, skip=args.warmup) * args.local_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="ddp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.local_tokens = 4 * 128
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for name, config in CONFIGS.items():
                folder = Path(tmp) / f"{name.replace('/', '_')}-{round_}"
                times[name].append(run(config, args, folder))
    base = statistics.median(times["off"])
    print(f"{args.layout}, {args.ngpu} processes, {args.steps} steps, median of {args.repeats}")
    print(f"{'configuration':<16} {'s/step':>8} {'vs off':>8}")
    for name, values in times.items():
        value = statistics.median(values)
        print(f"{name:<16} {value:8.4f} {value / base:8.3f}")
    per_check = statistics.median(times["fingerprints/1"]) - statistics.median(times["defaults"])
    print(f"one fingerprint check: ~{per_check * 1000:.1f} ms ({per_check / base:.1%} of a step)")


if __name__ == "__main__":
    main()
