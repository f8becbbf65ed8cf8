"""On a CUDA GPU with flash-linear-attention installed: does its gated delta rule, as titanlite
calls it (``titanlite.models.attention.fla_rule``), give the plain chunked rule's outputs,
final states and gradients? float32, with and without document resets and an initial state
(the cases training and context parallelism use). Prints the largest relative difference of
each and exits 1 when one is over --tolerance, 2 without a GPU or the package.

    python scripts/check_fla.py [--tolerance 1e-3]

(fla's kernels compute in TF32/float32 blocks of their own: expect about 1e-4, not 1e-7.)
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from titanlite.models.attention import fla_rule
from titanlite.models.attention.delta_rule import chunk_gated_delta_rule


def case(*, resets: bool, with_state: bool, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    b, h, T, dk, dv = 2, 4, 300, 64, 64  # 300: not a multiple of the 64-token chunks

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = F.normalize(rand(b, h, T, dk), dim=-1) * dk**-0.5
    k = F.normalize(rand(b, h, T, dk), dim=-1)
    tensors = [q, k, rand(b, h, T, dv), -F.softplus(rand(b, h, T)), torch.sigmoid(rand(b, h, T))]
    tensors.append(rand(b, h, dk, dv) if with_state else None)
    flags = None
    if resets:
        flags = torch.zeros(b, T, dtype=torch.bool, device=device)
        flags[0, [1, 70, 71, 200]] = True
        flags[1, [0, 128]] = True  # a row that begins a document: its initial state is dropped
    return [*(x.requires_grad_() if x is not None else x for x in tensors), flags]


def compare(op, *, resets: bool, with_state: bool, device: torch.device) -> float:  # noqa: ANN001
    q, k, v, g, beta, state, flags = case(resets=resets, with_state=with_state, device=device)
    leaves = [x for x in (q, k, v, g, beta, state) if x is not None]
    results = []
    for run in (chunk_gated_delta_rule, lambda *a, **kw: fla_rule.run(op, *a, **kw)):
        out, final = run(q, k, v, g=g, beta=beta, resets=flags, initial_state=state)
        grads = torch.autograd.grad(out.square().sum() + final.square().sum(), leaves)
        results.append([out, final, *grads])
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(*results, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_fla: no CUDA GPU is visible; run it on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    op = fla_rule.choose("auto", device)
    if op is None:
        print(f"check_fla: {fla_rule.fast_op()[1]}", file=sys.stderr)
        return 2
    print(f"check_fla: {fla_rule.fast_op()[1]} against the chunked PyTorch rule (float32)")
    worst = 0.0
    for resets in (False, True):
        for with_state in (False, True):
            diff = compare(op, resets=resets, with_state=with_state, device=device)
            worst = max(worst, diff)
            print(
                f"  resets={resets!s:<5} initial_state={with_state!s:<5} "
                f"max relative difference (outputs, states, gradients) {diff:.2e}"
            )
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
