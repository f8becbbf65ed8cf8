"""Tiny models and comparison helpers for the data-parallel tests (tests/test_ddp.py).

The models have tensors of several sizes, tied weights, branches used by some ranks only and
checkpointed or compiled blocks; the helpers build the same global batch on every rank and
compare gradients and parameters with a single-process reference and with torch's own DDP.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from titanlite.parallel.ddp import BucketedDDP

ATOL, RTOL = 1e-6, 1e-5
TINY_MB = 0.0002  # ~200-byte buckets: most tensors of the tiny models below get their own


# ----- models ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """A small net with a buffer and a LayerNorm (tensors of several sizes)."""

    def __init__(self, d_in: int = 8, width: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.fc2 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.fc3 = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = self.norm(torch.tanh(self.fc2(h))) * self.scale
        return self.head(torch.tanh(self.fc3(h)))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 24, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(tokens))))


class Branchy(nn.Module):
    """``branch`` is used only when the caller says so; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.head(h)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


class TwoBranches(nn.Module):
    """Output a(x) + b(x); ``a_first`` picks which branch runs (and so finishes backward) first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        if a_first:
            ya = self.a(x)
            return ya + self.b(x)
        yb = self.b(x)
        return self.a(x) + yb


# ----- helpers --------------------------------------------------------------------------------


def global_batch(it: int, n: int = 16, d_in: int = 8, d_out: int = 4) -> tuple:
    """The same batch on every rank for iteration ``it``, in a fresh random order."""
    g = torch.Generator().manual_seed(1000 + it)
    x, y = torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
    perm = torch.randperm(n, generator=g)
    return x[perm], y[perm]


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def assert_close(
    actual: dict[str, torch.Tensor | None],
    expected: dict[str, torch.Tensor | None],
    what: str,
    atol: float = ATOL,
    rtol: float = RTOL,
) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for name, a in actual.items():
        e = expected[name]
        if a is None or e is None:
            assert a is None and e is None, f"{what}: {name}: {a is not None} vs {e is not None}"
            continue
        torch.testing.assert_close(
            a, e, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def torch_ddp(model: nn.Module, **kwargs) -> DistributedDataParallel:
    """torch's own DDP on the default group: the second reference for every scenario."""
    return DistributedDataParallel(model, **kwargs)


def grads_are_bucket_views(engine: BucketedDDP) -> None:
    spans = [
        (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in engine.bucket_buffers()
    ]
    for name, p in engine.named_parameters():
        if p.grad is None:
            continue
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        ptr = local.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in spans), f"{name}.grad is not a view into a bucket"


def same_on_all_ranks(t: torch.Tensor) -> bool:
    hi, lo = t.detach().clone(), -t.detach().clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX)
    return torch.equal(hi, -lo)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def mse_grads_match(
    ours: nn.Module,
    reference: nn.Module,
    theirs_module: nn.Module,
    theirs: nn.Module,
    rank: int,
    world: int,
    label: str,
) -> None:
    """Three iterations of an MSE step on the global batch: titanlite's gradients equal the
    single-process reference's and torch DDP's."""
    for it in range(3):
        for m in (ours, reference, theirs_module):
            m.zero_grad()
        x, y = global_batch(it)
        xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
        F.mse_loss(ours(xl), yl).backward()
        F.mse_loss(theirs(xl), yl).backward()
        F.mse_loss(reference(x), y).backward()
        assert_close(grads(ours), grads(reference), f"iter {it} {label} vs single")
        assert_close(grads(ours), grads(theirs_module), f"iter {it} {label} vs torch")


def check_parity(rank: int, world: int, cap: float, view: bool, optim: str, iters: int = 4) -> None:
    """Ours vs one process on the global batch vs torch DDP: grads, then params after steps."""
    torch.manual_seed(rank)  # different init per rank: construction must broadcast rank 0's
    ours = BucketedDDP(
        MLP(), bucket_cap_mb=cap, first_bucket_cap_mb=min(cap, 1.0), gradient_as_bucket_view=view
    )
    for p in ours.parameters():
        assert same_on_all_ranks(p), "construction did not broadcast parameters"
    reference = MLP()
    reference.load_state_dict(ours.state_dict())
    theirs_module = copy.deepcopy(reference)
    theirs = torch_ddp(theirs_module, bucket_cap_mb=cap, gradient_as_bucket_view=view)
    if cap < 0.01:
        assert len(ours.bucket_buffers()) > 5, ours.bucket_parameter_names()
    opts = [make_optimizer(optim, m) for m in (ours, reference, theirs_module)]
    for it in range(iters):
        assert ours.buckets_rebuilt == (it >= 2), (it, ours.buckets_rebuilt)
        for opt in opts:
            opt.zero_grad(set_to_none=it % 2 == 0)
        x, y = global_batch(it)
        xl, yl = local_slice(x, rank, world), local_slice(y, rank, world)
        F.mse_loss(ours(xl), yl).backward()
        F.mse_loss(theirs(xl), yl).backward()
        F.mse_loss(reference(x), y).backward()
        assert_close(grads(ours), grads(reference), f"iter {it} grads vs single process")
        assert_close(grads(ours), grads(theirs_module), f"iter {it} grads vs torch DDP")
        if view:
            grads_are_bucket_views(ours)
        for opt in opts:
            opt.step()
        assert_close(params(ours), params(reference), f"iter {it} params vs single process")
        assert_close(params(ours), params(theirs_module), f"iter {it} params vs torch DDP")
