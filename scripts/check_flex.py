"""On a CUDA GPU: does the masked core's FlexAttention path (compiled, as training runs it)
give the blocked explicit kernel's outputs and gradients (queries, keys, values, sinks)?
Grouped keys, window smaller than the sequence, sinks, documents, and a context-parallel
rank's two chunks; float32 and bfloat16. Prints the largest relative difference of each case
and exits 1 when one is over its tolerance, 2 without a GPU.

    python scripts/check_flex.py [--tolerance 1e-3] [--bf16-tolerance 3e-2]

(The two accumulate in different orders: expect about 1e-5 in float32. In bfloat16 the
explicit kernel computes logits and softmax in float32 and flex multiplies bfloat16
probabilities by the values: expect about 1e-2. FlexAttention's dense reference on a CPU,
through ``compare(device=cpu)``, gives 7e-7 and 6e-3.)
"""

from __future__ import annotations

import argparse
import sys

import torch

from titanlite.models.attention.flex import flex_masked_attention
from titanlite.models.attention.masked import banded_attention


def compare(
    *, dtype: torch.dtype, chunks: list[tuple[int, int]], documents: bool, device: torch.device
) -> float:
    gen = torch.Generator(device).manual_seed(0)
    b, h, kv, seq, d, window = 2, 8, 2, 1000, 64, 128  # 1000: not a multiple of flex's blocks
    local = sum(length for _, length in chunks)
    q = torch.randn(b, h, local, d, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(b, kv, seq, d, generator=gen, device=device, dtype=dtype) for _ in "kv")
    sinks = torch.randn(h, generator=gen, device=device)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    docs = None
    if documents:
        docs = torch.zeros(b, seq, dtype=torch.long, device=device)
        docs[0, 300:] = 1
        docs[0, 620:] = 2
    weights = torch.randn(b, h, local, d, generator=gen, device=device)
    results = []
    for attend in (banded_attention, flex_masked_attention):
        out = attend(*leaves[:3], chunks, window=window, sinks=leaves[3], documents=docs)
        grads = torch.autograd.grad((out.float() * weights).sum(), leaves)
        results.append([out, *grads])
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(*results, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--bf16-tolerance", type=float, default=3e-2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_flex: no CUDA GPU is visible; run it on a GPU machine", file=sys.stderr)
        return 2
    print("check_flex: FlexAttention (compiled) against the blocked explicit kernel")
    device = torch.device("cuda")
    worst = 0.0
    for dtype, tolerance in (
        (torch.float32, args.tolerance),
        (torch.bfloat16, args.bf16_tolerance),
    ):
        for chunks in ([(0, 1000)], [(0, 250), (750, 250)]):
            for documents in (False, True):
                diff = compare(dtype=dtype, chunks=chunks, documents=documents, device=device)
                worst = max(worst, diff / tolerance)
                print(
                    f"  {str(dtype).removeprefix('torch.'):<8} chunks={len(chunks)} "
                    f"documents={documents!s:<5} max relative difference (outputs, "
                    f"gradients incl. sinks) {diff:.2e}"
                )
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
