"""Benchmark how long a checkpoint save blocks training: sync vs async.

For each model, one subprocess builds a single-process Trainer (gloo, CPU unless CUDA is
there) with its checkpoint folder in a temporary directory, runs one training step so the
AdamW state exists, then alternates saves:

  sync             Checkpointer.save(step, force_sync=True): training waits for all of it
  async blocking   Checkpointer.save(step) with async_mode=async, until it returns (staging
                   the state dict to a CPU copy and starting the background write)
  async total      from the same save() until Checkpointer.wait() returns (write + commit)

Each save writes a new step-N folder (folders are removed between repeats, untimed). The
table shows the median of --repeats saves and the size of one checkpoint on disk.

    python scripts/bench_checkpoint.py --models debugmodel bench --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(flavor: str, repeats: int, folder: str) -> dict:
    from titanlite.config import load_config
    from titanlite.trainer import Trainer

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            folder,
            "--model.flavor",
            flavor,
            "--training.local_batch_size",
            "2",
            "--training.seq_len",
            "128",
            "--validation.enable",
            "false",
            "--checkpoint.async_mode",
            "async",
            "--checkpoint.keep_latest_k",
            "0",
        ]
    )
    trainer = Trainer(cfg)
    trainer.state.step = 1
    batch = next(trainer.train_iter)
    trainer.train_step([batch])
    ckpt = trainer.checkpointer
    sync_s, blocking_s, total_s, size = [], [], [], 0
    step = 1
    for _ in range(repeats):
        step += 1
        t0 = time.perf_counter()
        ckpt.save(step, force_sync=True)
        sync_s.append(time.perf_counter() - t0)
        path = ckpt.folder / f"step-{step}"
        size = sum(p.stat().st_size for p in path.iterdir())
        shutil.rmtree(path)

        step += 1
        t0 = time.perf_counter()
        ckpt.save(step)
        blocking_s.append(time.perf_counter() - t0)
        ckpt.wait()
        total_s.append(time.perf_counter() - t0)
        shutil.rmtree(ckpt.folder / f"step-{step}")
    trainer.close()
    return {
        "model": flavor,
        "params": trainer.num_params,
        "size_mb": size / 1e6,
        "sync_s": statistics.median(sync_s),
        "async_blocking_s": statistics.median(blocking_s),
        "async_total_s": statistics.median(total_s),
        "repeats": repeats,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["debugmodel", "bench"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as folder:
            result = worker(args.worker, args.repeats, folder)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        return 0

    rows = []
    for model in args.models:
        # One process per model: a process group can be initialized only once per process.
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", model, "--repeats", str(args.repeats)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            text=True,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stderr[-3000:])
            return 1
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))

    print(f"checkpoint save time, median of {args.repeats}, 1 process, {os.cpu_count()} CPUs\n")
    print("| model | params | checkpoint MB | sync s | async blocking s | async total s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['size_mb']:.0f} | {r['sync_s']:.2f} "
            f"| {r['async_blocking_s']:.2f} | {r['async_total_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
