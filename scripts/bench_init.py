"""Start-up initialization cost per rank: titanlite's counter-based local init against the
full-tensor init it replaced (every rank generated every full parameter, kept its slice).

    python scripts/bench_init.py [--rows 8192 --cols 8192] [--repeats 3]

Both are timed on the same parameter shape in one run (best of --repeats), as nanoseconds
per element; the report extrapolates each to one rank of Llama 3 405B on 2,048 ranks
(dp_shard 256 x tp 8), where the old way generates all 405.9 B elements on every rank and
the new one only the rank's ~196 M. For the real thing on this machine, run the dry run:

    NGPU=8 NNODES=256 ./run_train.sh train_configs/llama3_405b.toml --job.dry_run \\
        --model.vocab_size 128256 --job.dry_run_init_rank 1234
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from titanlite.models.init import fill_local_  # noqa: E402
from titanlite.models.spec import InitRule  # noqa: E402

LLAMA_405B_PARAMS = 405_853_388_800
LLAMA_405B_LOCAL = 196_132_672  # rank 1234 of dp_shard 256 x tp 8 (the dry run reports it)


def old_full_init(shape: tuple[int, int], std: float) -> torch.Tensor:
    """What titanlite did before: a seeded generator per parameter, the full tensor."""
    generator = torch.Generator().manual_seed(1234)
    value = torch.empty(shape)
    nn.init.trunc_normal_(value, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
    return value


def best_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = (args.rows, args.cols)
    n = args.rows * args.cols
    rule = InitRule.normal(0.02)
    out = torch.empty(shape)
    old_s = best_seconds(lambda: old_full_init(shape, 0.02), args.repeats)
    new_s = best_seconds(
        lambda: fill_local_(out, rule, 0, "layers.0.w", global_shape=shape, global_offset=(0, 0)),
        args.repeats,
    )
    old_ns, new_ns = 1e9 * old_s / n, 1e9 * new_s / n
    old_rank_s = LLAMA_405B_PARAMS * old_ns / 1e9
    new_rank_s = LLAMA_405B_LOCAL * new_ns / 1e9
    print(
        f"parameter {args.rows} x {args.cols} ({n:,} elements), {torch.get_num_threads()} threads"
    )
    print(f"  full-tensor init (old)   {old_ns:6.2f} ns/element")
    print(
        f"  counter-based (new)      {new_ns:6.2f} ns/element  ({old_ns / new_ns:.2f}x per element)"
    )
    print("one rank of Llama 3 405B, dp_shard 256 x tp 8 (extrapolated from the rates above):")
    print(f"  old: every full parameter  {old_rank_s / 3600:6.2f} h")
    print(
        f"  new: the local shard only  {new_rank_s:6.1f} s  ({old_rank_s / new_rank_s:,.0f}x less)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
