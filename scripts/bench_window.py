"""Sliding-window attention on this machine: step time and attention FLOPs of the gpt-oss
debug shape at a long sequence, with its windows against full attention.

One process, one intra-op thread, fp32: the model's forward and backward on one sequence of
random tokens (the optimizer step left out: it does not depend on attention). Variants:

  window, LG    the debug model as shipped: a window of --window on every other layer
  window, L     the window on every layer
  full          no window (every layer attends the whole causal prefix; sinks still on, so
                the same blocked kernel runs, over the whole triangle)

Per variant: the attention FLOPs per token and the model's (titanlite's formula, which MFU
uses), and the median over the measured steps of the step's wall and CPU time. Then, per
context-parallel degree (--cp), the bytes of keys and values the busiest cp rank receives in
one step's forward for one sequence
(``titanlite.parallel.context.window.kv_bytes_received``, what the exchange plans send; the
backward sends as many back): windowed layers receive only the keys their windows reach, full
ones gather the sequence.

    python scripts/bench_window.py --seq-len 4096 --window 128 [--bytes-only]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from titanlite.models import get
from titanlite.models.decoder_spec import attention_flops_per_token
from titanlite.models.init import init_parameters
from titanlite.parallel.context.window import kv_bytes_received

VARIANTS = {"window, LG": ("LG", True), "window, L": ("L", True), "full": ("L", False)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--steps", type=int, default=2, help="measured steps")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP degrees (bytes)")
    parser.add_argument("--bytes-only", action="store_true", help="skip the timed steps")
    return parser.parse_args(argv)


def cp_bytes(args: argparse.Namespace, pattern: str, windowed: bool, cp: int) -> int:
    """Forward bytes of keys and values the busiest cp rank receives per step, all layers."""
    overrides = {"sliding_window": args.window if windowed else 0, "window_pattern": pattern}
    a = get("gpt_oss").make_args("debugmodel", args.vocab, args.seq_len, overrides)
    return sum(
        kv_bytes_received(
            seq_len=args.seq_len,
            cp=cp,
            window=a.layer_window(layer),
            batch=1,
            kv_channels=a.n_kv_heads * a.head_dim,
            element_size=4,
        )
        for layer in range(a.n_layers)
    )


def print_cp_bytes(args: argparse.Namespace) -> None:
    print(
        f"\nCP bytes moved per step (keys and values received by the busiest cp rank, forward; "
        f"backward sends as many back), 1 sequence of {args.seq_len}, fp32"
    )
    print("| variant | " + " | ".join(f"cp {cp} KiB | vs full" for cp in args.cp) + " |")
    print("|---|" + "---:|---:|" * len(args.cp))
    full = {cp: cp_bytes(args, "L", False, cp) for cp in args.cp}
    for name, variant in VARIANTS.items():
        cells = []
        for cp in args.cp:
            moved = cp_bytes(args, *variant, cp)
            cells.append(f"{moved / 1024:,.0f} | {moved / full[cp]:.3f}x")
        print(f"| {name} | " + " | ".join(cells) + " |")


def measure(args: argparse.Namespace, pattern: str, windowed: bool) -> dict[str, float]:
    spec = get("gpt_oss")
    overrides = {"sliding_window": args.window if windowed else 0, "window_pattern": pattern}
    model_args = spec.make_args("debugmodel", args.vocab, args.seq_len, overrides)
    model = spec.build(model_args)
    init_parameters(model, lambda name: spec.init_rule(model_args, name), 0)
    spec.init_buffers(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, args.seq_len + 1), generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        "attention_flops": attention_flops_per_token(model_args, args.seq_len),
        "flops": spec.flops_per_token(model_args, args.seq_len),
        "wall_s": statistics.median(t[0] for t in times),
        "cpu_s": statistics.median(t[1] for t in times),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bytes_only:
        print_cp_bytes(args)
        return 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = {name: measure(args, *variant) for name, variant in VARIANTS.items()}
    full = rows["full"]
    print(
        f"gpt-oss debugmodel, seq_len {args.seq_len}, window {args.window}, 1 sequence, fp32, "
        f"1 thread, forward + backward; torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        "| variant | attention FLOPs/token | model FLOPs/token "
        "| step wall s | step CPU s | CPU vs full |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['attention_flops']:.3g} "
            f"({r['attention_flops'] / full['attention_flops']:.2f}x) "
            f"| {r['flops']:.3g} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} "
            f"| {r['cpu_s'] / full['cpu_s']:.2f}x |"
        )
    print_cp_bytes(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
