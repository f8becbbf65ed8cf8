"""Step time against sequence length: the Qwen3.5 hybrid (3 Gated DeltaNet layers to 1 gated
full-attention layer) against the same family with every layer full attention.

One process, one intra-op thread, float32, one sequence per step: forward, cross-entropy over
random labels and backward of the ``qwen3_5`` debug flavor (``--layers`` blocks), timed as the
median of ``--repeats`` steps after one unmeasured step. The hybrid's DeltaNet layers cost
linear time in the sequence; full attention's grow with its square, so the table shows where
the hybrid becomes the faster and how the time per token grows.

    python scripts/bench_linear_attention.py --seq-lens 1024 2048 4096 8192 16384
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from titanlite.models import get
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params

VOCAB = 4096  # the shipped test tokenizer's size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--layers", type=int, default=4, help="blocks (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per length")
    return parser.parse_args(argv)


def build(interval: int, layers: int, max_seq: int) -> tuple[torch.nn.Module, int]:
    spec = get("qwen3_5")
    overrides = {"full_attention_interval": interval, "n_layers": layers}
    args = spec.make_args("debugmodel", VOCAB, max_seq, overrides)
    model = spec.build(args)
    init_parameters(model, lambda name: spec.init_rule(args, name), 0)
    return model, count_params(model)


def step_seconds(model: torch.nn.Module, seq: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, VOCAB, (1, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (1, seq), generator=gen)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first step warms the allocator and kernels
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    max_seq = max(a.seq_lens)
    hybrid, hybrid_params = build(4, a.layers, max_seq)
    full, full_params = build(1, a.layers, max_seq)
    print(f"# {platform.machine()}, torch {torch.__version__}, 1 thread, float32, batch 1")
    print(
        f"# hybrid {hybrid_params / 1e6:.2f} M parameters, full attention "
        f"{full_params / 1e6:.2f} M, {a.layers} blocks"
    )
    print(
        "| seq_len | hybrid s | full attention s | hybrid / full | hybrid us/token | "
        "full us/token |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for seq in a.seq_lens:
        h, f = step_seconds(hybrid, seq, a.repeats), step_seconds(full, seq, a.repeats)
        print(
            f"| {seq:,} | {h:.2f} | {f:.2f} | {h / f:.2f} | {h / seq * 1e6:.0f} | "
            f"{f / seq * 1e6:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
