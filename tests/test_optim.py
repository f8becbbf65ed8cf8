"""Learning-rate schedule (warmup, WSD, decay shapes), the LambdaLR wrapper, AdamW parameter
groups and gradient clipping."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from torch import nn

from titanlite.config import JobConfig, load_config
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_factor


def schedule(*argv: str) -> JobConfig:
    return load_config(list(argv))


def factor(step: int, cfg: JobConfig) -> float:
    return lr_factor(step, cfg.lr_scheduler, cfg.training.steps)


def factors(cfg: JobConfig) -> list[float]:
    return [factor(s, cfg) for s in range(1, cfg.training.steps + 1)]


# --- lr_factor --------------------------------------------------------------------------------


def test_warmup_ramps_linearly_from_near_zero() -> None:
    cfg = schedule("--training.steps=100", "--lr_scheduler.warmup_steps=10")
    warm = [factor(s, cfg) for s in range(1, 11)]
    assert warm[0] == pytest.approx(1 / 11)
    steps = [b - a for a, b in pairwise(warm)]
    assert steps == pytest.approx([1 / 11] * 9)
    assert 0 < warm[0] < warm[-1] < 1


def test_wsd_is_flat_at_peak_then_decays() -> None:
    cfg = schedule(
        "--training.steps=100",
        "--lr_scheduler.warmup_steps=10",
        "--lr_scheduler.decay_ratio=0.2",
        "--lr_scheduler.decay_type=linear",
    )
    f = factors(cfg)
    assert f[10] == 1.0  # step 11: right after warmup
    assert f[10:80] == [1.0] * 70  # stable through step 80
    decay = f[80:]  # steps 81..100
    assert all(b < a for a, b in pairwise(decay))
    assert decay == pytest.approx([1 - k / 20 for k in range(1, 21)])
    assert f[-1] == 0.0


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
@pytest.mark.parametrize("decay_ratio", [None, 0.5])
def test_ends_at_min_lr_factor_on_the_last_step(decay_type: str, decay_ratio: float | None) -> None:
    argv = [
        "--training.steps=40",
        "--lr_scheduler.warmup_steps=5",
        f"--lr_scheduler.decay_type={decay_type}",
        "--lr_scheduler.min_lr_factor=0.1",
    ]
    if decay_ratio is not None:
        argv.append(f"--lr_scheduler.decay_ratio={decay_ratio}")
    f = factors(schedule(*argv))
    assert f[-1] == pytest.approx(0.1)
    assert min(f[5:]) == pytest.approx(0.1)  # never below the floor
    assert max(f) <= 1.0
    post_warmup = f[5:]
    assert all(b <= a for a, b in pairwise(post_warmup))  # monotone decay


@pytest.mark.parametrize(
    ("decay_type", "curve"),
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_decay_shapes_at_known_points(decay_type: str, curve) -> None:  # noqa: ANN001
    # 120 steps: warmup 10, stable to step 60, decay over the last 60 (progress k / 60 at 60 + k).
    cfg = schedule(
        "--training.steps=120",
        "--lr_scheduler.warmup_steps=10",
        "--lr_scheduler.decay_ratio=0.5",
        f"--lr_scheduler.decay_type={decay_type}",
        "--lr_scheduler.min_lr_factor=0.2",
    )
    assert factor(60, cfg) == 1.0
    for k, progress in [(15, 0.25), (30, 0.5), (45, 0.75), (60, 1.0)]:
        assert factor(60 + k, cfg) == pytest.approx(0.2 + 0.8 * curve(progress)), k
    expected_mid = {"linear": 0.6, "sqrt": 0.2 + 0.8 * (1 - math.sqrt(0.5)), "cosine": 0.6}
    assert factor(90, cfg) == pytest.approx(expected_mid[decay_type])


def test_cosine_and_linear_differ_off_the_midpoint() -> None:
    argv = ["--training.steps=100", "--lr_scheduler.warmup_steps=0"]  # decay over all steps
    linear = schedule(*argv, "--lr_scheduler.decay_type=linear")
    cosine = schedule(*argv, "--lr_scheduler.decay_type=cosine")
    assert factor(25, cosine) > factor(25, linear)  # cosine stays high early
    assert factor(75, cosine) < factor(75, linear)  # and drops faster late


def test_decay_ratio_zero_means_no_decay() -> None:
    cfg = schedule(
        "--training.steps=30", "--lr_scheduler.warmup_steps=3", "--lr_scheduler.decay_ratio=0"
    )
    assert factors(cfg)[3:] == [1.0] * 27


def test_warmup_longer_than_training() -> None:
    cfg = schedule("--training.steps=5", "--lr_scheduler.warmup_steps=50")
    f = factors(cfg)
    assert f == pytest.approx([s / 6 for s in range(1, 6)])
    assert all(0 < v < 1 for v in f)


def test_decay_ratio_one_decays_through_all_post_warmup_steps() -> None:
    argv = ["--training.steps=20", "--lr_scheduler.warmup_steps=5"]
    full = schedule(*argv, "--lr_scheduler.decay_ratio=1")
    # The decay is capped at the steps left after warmup: the same as leaving decay_ratio unset.
    assert factors(full) == factors(schedule(*argv))
    assert factors(full)[-1] == 0.0


def test_peak_lr_is_reached_without_decay_ratio() -> None:
    cfg = schedule("--training.steps=100", "--lr_scheduler.warmup_steps=10")
    assert max(factors(cfg)) == 1.0


# --- the scheduler object ---------------------------------------------------------------------


def test_lambda_lr_matches_lr_factor_over_a_run() -> None:
    cfg = schedule(
        "--training.steps=30",
        "--lr_scheduler.warmup_steps=4",
        "--lr_scheduler.decay_ratio=0.5",
        "--lr_scheduler.decay_type=cosine",
        "--lr_scheduler.min_lr_factor=0.1",
        "--optimizer.lr=0.01",
    )
    param = nn.Parameter(torch.zeros(2, 2))
    optimizer = torch.optim.AdamW([param], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    used = []
    for _ in range(cfg.training.steps):
        used.append(optimizer.param_groups[0]["lr"])  # the lr optimizer step s runs with
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx([0.01 * f for f in factors(cfg)], rel=1e-12)
    assert used[-1] == pytest.approx(0.001)


def test_scheduler_state_resumes_the_schedule() -> None:
    cfg = schedule("--training.steps=20", "--lr_scheduler.warmup_steps=5")
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    for _ in range(7):
        opt.step()
        sched.step()
    resumed_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = build_lr_scheduler(resumed_opt, cfg.lr_scheduler, cfg.training.steps)
    resumed.load_state_dict(sched.state_dict())
    resumed_opt.step()
    resumed.step()
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(factor(9, cfg))


# --- optimizer --------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)  # with a bias: 1-D
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_adamw_groups_no_decay_on_one_dimensional_params() -> None:
    model = Tiny()
    cfg = load_config(
        [
            "--optimizer.lr=0.01",
            "--optimizer.weight_decay=0.05",
            "--optimizer.beta1=0.8",
            "--optimizer.beta2=0.9",
            "--optimizer.eps=1e-6",
        ]
    )
    opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))[0]
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decay) == {id(model.emb.weight), id(model.proj.weight)}
    assert ids(no_decay) == {id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    for group in (decay, no_decay):
        assert group["lr"] == 0.01
        assert group["betas"] == (0.8, 0.9)
        assert group["eps"] == 1e-6
    assert decay["fused"] is True and not decay["foreach"]  # auto on CPU


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_implementation_choice(impl: str) -> None:
    cfg = load_config([f"--optimizer.implementation={impl}"])
    group = build_optimizer(Tiny(), cfg.optimizer, torch.device("cpu"))[0].param_groups[0]
    assert group["foreach"] is (impl == "foreach")
    assert not group["fused"]


def test_weight_decay_shrinks_matrices_but_not_norms() -> None:
    model = Tiny()
    cfg = load_config(["--optimizer.lr=0.1", "--optimizer.weight_decay=0.5"])
    opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)  # zero gradient: only decay can move a weight
    opt.step()
    params = dict(model.named_parameters())
    torch.testing.assert_close(params["proj.weight"], before["proj.weight"] * (1 - 0.1 * 0.5))
    assert torch.equal(params["norm.weight"], before["norm.weight"])
    assert torch.equal(params["proj.bias"], before["proj.bias"])
    assert torch.equal(params["frozen.weight"], before["frozen.weight"])


# --- gradient clipping ------------------------------------------------------------------------


def params_with_grads(*shapes: tuple[int, ...], scale: float = 1.0, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) * scale
        params.append(p)
    return params


def reference_norm(params: list) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


def test_clip_returns_true_norm_and_clips_to_max_norm() -> None:
    params = params_with_grads((300, 70), (70,), (5, 5, 5), scale=3.0)
    params.append(nn.Parameter(torch.zeros(4)))  # no grad: ignored
    true = reference_norm(params)
    before = [p.grad.clone() for p in params[:3]]
    total = clip_grad_norm_(params, max_norm=1.0)
    assert total.dtype == torch.float32 and total.ndim == 0
    assert total.item() == pytest.approx(true, rel=1e-6)
    assert reference_norm(params) == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params[:3], before, strict=True):  # one common scale, direction kept
        torch.testing.assert_close(p.grad, g * (1.0 / true), rtol=1e-5, atol=1e-7)
    assert params[3].grad is None


def test_clip_below_max_norm_leaves_grads_unchanged() -> None:
    params = params_with_grads((10, 10), scale=0.01)
    before = params[0].grad.clone()
    total = clip_grad_norm_(params, max_norm=100.0)
    assert total.item() == pytest.approx(reference_norm(params), rel=1e-6)
    assert torch.equal(params[0].grad, before)


def test_clip_with_max_norm_zero_only_measures() -> None:
    params = params_with_grads((50, 50), (50,), scale=10.0)
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm_(params, max_norm=0.0)
    assert total.item() == pytest.approx(reference_norm(params), rel=1e-6)
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad, g)


def test_clip_norm_is_accurate_for_many_small_values() -> None:
    """A float32 running sum over millions of elements drifts; the reported norm must not."""
    p = nn.Parameter(torch.zeros(4_000_000))
    p.grad = torch.full((4_000_000,), 1e-3)
    p.grad[::2] = 3e-3
    total = clip_grad_norm_([p], max_norm=0.0)
    assert total.item() == pytest.approx(reference_norm([p]), rel=1e-6)


def test_clip_matches_torch_reference() -> None:
    ours = params_with_grads((64, 32), (32,), scale=2.0, seed=1)
    theirs = params_with_grads((64, 32), (32,), scale=2.0, seed=1)
    total = clip_grad_norm_(ours, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.5)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_bfloat16_grads() -> None:
    params = params_with_grads((16, 16), (16,), scale=5.0)
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = p.grad.bfloat16()
    true = reference_norm(params)
    total = clip_grad_norm_(params, max_norm=1.0)
    assert total.item() == pytest.approx(true, rel=1e-6)
    assert reference_norm(params) == pytest.approx(1.0, rel=1e-2)
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


def test_clip_without_grads_returns_zero() -> None:
    assert clip_grad_norm_([nn.Parameter(torch.ones(3))], max_norm=1.0).item() == 0.0
