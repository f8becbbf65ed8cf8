"""Mixture of experts: the MoE layer against a per-token reference, grouped matmuls, the
balancing options, the Qwen3-MoE family (counts, Hugging Face round trip with equal logits)
and the trainer on data-parallel layouts against one process."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import write_checkpoint

from titanlite.metrics.moe_tracker import MoETracker
from titanlite.models import get
from titanlite.models.decoder import Decoder
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params
from titanlite.models.moe import MoE, grouped_mm
from titanlite.models.moe.experts import _padded_bmm
from titanlite.models.qwen3_moe.args import FLAVORS, Qwen3MoeArgs

REPO = Path(__file__).resolve().parent.parent
SPEC = get("qwen3_moe")


def moe_args(**changes: object) -> Qwen3MoeArgs:
    base: dict = dict(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        num_experts=6,
        top_k=2,
        moe_hidden_dim=16,
        vocab_size=512,
        max_seq_len=64,
        tie_embeddings=False,
    )
    return Qwen3MoeArgs(**(base | changes))


def layer(seed: int = 0, **changes: object) -> MoE:
    torch.manual_seed(seed)
    args = moe_args(**{k: v for k, v in changes.items() if k != "shared_expert_gate"})
    # The gate is a field of the families that have it (qwen3_5_moe), read by the layer.
    args.shared_expert_gate = changes.get("shared_expert_gate", False)  # type: ignore[attr-defined]
    moe = MoE(32, args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written per token and per chosen expert, the obvious way."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ moe.router.weight.t()
    scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
    out = torch.zeros_like(flat)
    size = moe.num_experts // moe.n_groups
    for t in range(flat.shape[0]):
        choice = scores[t] + moe.expert_bias
        ratings = [
            sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(moe.n_groups)
        ]
        groups = sorted(range(moe.n_groups), key=lambda g: -sum(ratings[g]))[: moe.topk_groups]
        allowed = [e for e in range(moe.num_experts) if e // size in groups]
        top = torch.tensor(allowed)[torch.topk(choice[allowed], moe.top_k).indices]
        w = scores[t, top]
        w = (w / w.sum() if moe.norm_topk else w) * moe.route_scale
        for e, weight in zip(top.tolist(), w, strict=True):
            ex = moe.experts
            h = F.silu(flat[t] @ ex.w1[e]) * (flat[t] @ ex.w3[e])
            out[t] += weight * (h @ ex.w2[e])
        if moe.shared is not None:
            gate = (
                1.0
                if moe.shared_gate is None
                else torch.sigmoid(moe.shared_gate.weight[0] @ flat[t])
            )
            out[t] += gate * moe.shared(flat[t])
    return out.view_as(x)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"score_func": "sigmoid"},
        {"norm_topk": False},
        {"shared_experts": 2},
        {"shared_experts": 1, "shared_expert_gate": True},
        {
            "score_func": "sigmoid",
            "n_groups": 3,
            "topk_groups": 2,
            "top_k": 3,
            "route_scale": 2.5,
            "shared_experts": 1,
        },
    ],
    ids=["softmax", "sigmoid", "no-renorm", "shared", "shared-gated", "deepseek-groups"],
)
def test_layer_matches_the_per_token_reference(changes: dict) -> None:
    moe = layer(**changes)
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1))
    got = moe(x)
    assert torch.allclose(got, reference(moe, x), atol=1e-5, rtol=1e-5)
    assert int(moe.last.counts.sum()) == 3 * 10 * moe.top_k and int(moe.last.dropped) == 0


def test_group_limited_routing_chooses_only_inside_the_best_groups() -> None:
    """Every chosen expert lies in one of the token's topk_groups groups, those rated best by
    the sum of their two best choice scores (scores plus bias); with one group the choice is
    plain top-k, whatever the bias."""
    changes = {"score_func": "sigmoid", "num_experts": 12, "top_k": 3, "aux_loss_coef": 0.0}
    grouped = layer(n_groups=4, topk_groups=2, **changes)
    with torch.no_grad():  # a bias that moves choices: it must rate the groups too
        grouped.expert_bias.copy_(torch.linspace(-0.3, 0.3, 12))
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(6))
    flat = x.reshape(-1, 32)
    choice = (flat @ grouped.router.weight.t()).sigmoid() + grouped.expert_bias
    chosen = torch.topk(grouped._within_best_groups(choice), 3, dim=-1).indices
    ratings = choice.view(-1, 4, 3).topk(2, dim=-1).values.sum(-1)
    best = torch.topk(ratings, 2, dim=-1).indices
    assert (chosen // 3)[..., None].eq(best[:, None, :]).any(-1).all()
    plain_top = torch.topk(choice, 3, dim=-1).indices
    assert not torch.equal(chosen.sort(-1).values, plain_top.sort(-1).values)  # groups bite
    one = layer(n_groups=1, topk_groups=1, **changes)
    one.load_state_dict(grouped.state_dict())
    one(x)
    assert torch.equal(one.last.counts, torch.bincount(plain_top.reshape(-1), minlength=12))
    plain = layer(**changes)
    plain.load_state_dict(grouped.state_dict())
    assert torch.equal(one(x), plain(x))


def test_first_k_dense_blocks_have_a_dense_feed_forward() -> None:
    from titanlite.models.layers import FeedForward

    model = Decoder(moe_args(n_layers=3, first_k_dense=2))
    kinds = [type(b.feed_forward) for b in model.layers.values()]
    assert kinds == [FeedForward, FeedForward, MoE]
    assert model.layers["0"].feed_forward.w1.weight.shape == (16 * 2, 32)  # the active width
    total = count_params(model)
    assert (
        SPEC.active_params(moe_args(n_layers=3, first_k_dense=2), total) == total - 4 * 3 * 32 * 16
    )


def test_grouped_matmul_and_its_fallback_match_a_loop_forward_and_backward() -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=g, requires_grad=True)
    pieces = torch.split(x, counts.tolist())
    want = torch.cat([p @ w[i] for i, p in enumerate(pieces)])
    grad = torch.randn(9, 8, generator=g)
    gx, gw = torch.autograd.grad(want, (x, w), grad)
    for fn in (grouped_mm, _padded_bmm):
        got = fn(x, w, counts)
        assert torch.allclose(got, want, atol=1e-6)
        fx, fw = torch.autograd.grad(got, (x, w), grad)
        assert torch.allclose(fx, gx, atol=1e-5) and torch.allclose(fw, gw, atol=1e-5)


def test_capacity_factor_drops_and_counts_the_overflow() -> None:
    moe = layer(capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] += 5.0  # every token prefers expert 0 ...
        moe.router.weight[1] += 4.0  # ... then expert 1
    x = torch.ones(1, 12, 32)
    moe(x)
    capacity = 12 * 2 // 6  # an even share of the 24 slots
    assert moe.last.counts[:2].tolist() == [12, 12]
    assert int(moe.last.dropped) == 24 - 2 * capacity
    dropless = layer()
    dropless.load_state_dict(moe.state_dict())
    assert not torch.allclose(dropless(x), moe(x))  # dropped tokens lose the expert output


def test_aux_loss_is_per_sequence_so_any_split_of_the_batch_gives_the_same_sum() -> None:
    moe = layer(aux_loss_coef=0.01)
    x = torch.randn(4, 10, 32, generator=torch.Generator().manual_seed(2))
    moe(x)
    whole = moe.last.aux
    parts = []
    for piece in x.split(1):
        moe(piece)
        parts.append(moe.last.aux)
    assert whole > 0 and torch.allclose(whole, torch.stack(parts).sum())
    # An even router gives the minimum coef x top_k... f = P = uniform -> sum f P = 1.
    even = layer(aux_loss_coef=1.0)
    with torch.no_grad():
        even.router.weight.zero_()
    even(x)
    assert torch.isclose(even.last.aux, torch.tensor(4.0), rtol=0.3)


def test_bias_update_evens_out_a_skewed_load() -> None:
    """Tokens that share a direction two of the six experts' router rows favour: the
    auxiliary-loss-free bias moves routing towards the others, and the max/mean load falls
    from above 2 to about 1.5 within 20 steps (it then settles, oscillating slightly)."""
    moe = layer(bias_update_rate=0.02)
    g = torch.Generator().manual_seed(3)
    shared = torch.ones(32) / 32**0.5
    x = torch.randn(4, 32, 32, generator=g) + 2 * shared
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.3, generator=g)
        moe.router.weight[:2] += 1.5 * shared
    tracker = MoETracker([moe], None, global_batch=4)
    balance = []
    for _ in range(30):
        moe(x)
        balance.append(tracker.after_step(log=True)["moe_load_max_mean"])
    assert balance[0] > 2.0, balance
    assert max(balance[20:]) < 0.8 * balance[0], balance
    assert moe.expert_bias[:2].max() < 0 < moe.expert_bias[2:].min()
    # Without the update the skew stays.
    still = layer(bias_update_rate=0.0)
    still.load_state_dict(moe.state_dict() | {"expert_bias": torch.zeros(6)})
    still(x)
    counts = still.last.counts.float()
    assert (counts.max() / counts.mean()).item() == pytest.approx(balance[0])


def test_the_aux_loss_gradient_arrives_through_the_layers_backward() -> None:
    """Training forwards hand the balancing loss its gradient (``aux_weight``) inside the
    layer's backward: the same gradients as adding ``aux_weight x aux`` to the loss; the
    forward's statistics add up in ``totals``, and a no-grad forward records nothing."""
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(5))
    injected, explicit = layer(aux_loss_coef=0.1), layer(aux_loss_coef=0.1)
    injected.aux_weight = 0.25
    (injected(x) * probe).sum().backward()
    ((explicit(x) * probe).sum() + 0.25 * explicit.last.aux).backward()
    for (name, a), b in zip(injected.named_parameters(), explicit.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    assert injected.router.weight.grad.abs().sum() > 0
    injected(x)
    assert injected.totals[:-3].sum() == 2 * 2 * 10 * 2  # two forwards, 20 tokens, top 2
    with torch.no_grad():
        injected(x)
    assert injected.totals[:-3].sum() == 2 * 2 * 10 * 2


def test_the_router_z_loss_is_its_definition_and_its_gradient_arrives_the_same_way() -> None:
    """router_z_loss_coef x sum over tokens of logsumexp(router logits)^2, recorded and handed
    its gradient (``router_z_weight``) inside the layer's backward, next to the aux loss's."""
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(5))
    changes = {"aux_loss_coef": 0.1, "router_z_loss_coef": 0.01}
    injected, explicit = layer(**changes), layer(**changes)
    injected.aux_weight, injected.router_z_weight = 0.25, 0.5
    (injected(x) * probe).sum().backward()
    out = explicit(x)
    ((out * probe).sum() + 0.25 * explicit.last.aux + 0.5 * explicit.last.router_z).backward()
    for (name, a), b in zip(injected.named_parameters(), explicit.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    logits = x.reshape(-1, 32).double() @ injected.router.weight.detach().double().T
    direct = 0.01 * torch.log(torch.exp(logits).sum(-1)).square().sum()
    assert torch.isclose(injected.last.router_z.double(), direct, rtol=1e-6)
    assert injected.totals[-1] == injected.last.router_z.detach() and direct > 0
    plain = layer(aux_loss_coef=0.1)
    plain.aux_weight = 0.25
    (plain(x) * probe).sum().backward()  # without it the router's gradient differs
    assert not torch.allclose(plain.router.weight.grad, injected.router.weight.grad)


def test_published_shapes_and_active_counts() -> None:
    """Qwen3-30B-A3B and Qwen3-235B-A22B (model cards: 30.5 B / 3.3 B and 235 B / 22 B)."""
    for flavor, total_b, active_b in (("30B-A3B", 30.5, 3.3), ("235B-A22B", 235, 22)):
        args = dataclasses.replace(FLAVORS[flavor], vocab_size=151936)
        with torch.device("meta"):
            total = count_params(SPEC.build(args))
        active = SPEC.active_params(args, total)
        assert abs(total / 1e9 - total_b) / total_b < 0.02, (flavor, total)
        assert abs(active / 1e9 - active_b) / active_b < 0.04, (flavor, active)
        # FLOPs count the active weights: about 6 x active per token, far below 6 x total.
        assert SPEC.flops_per_token(args, 1) < 6.2 * active


@pytest.mark.slow
def test_export_to_transformers_gives_equal_logits_and_imports_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf
    import convert_to_hf

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    args = moe_args(vocab_size=4096)
    model = Decoder(args)
    init_parameters(model, lambda name: SPEC.init_rule(args, name), 1)
    model.init_buffers()
    with torch.no_grad():  # a router that decides, so a wrong expert order shows
        for name, p in model.named_parameters():
            if "router" in name:
                p.mul_(40)
    ckpt = write_checkpoint(tmp_path / "step-3", model, step=3, model_name="qwen3_moe")
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 6
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
    assert (ours - theirs).abs().max().item() <= 1e-5 * max(ours.abs().max().item(), 1.0)
    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back")
    assert back.spec.name == "qwen3_moe" and back.args == model.args
    with torch.no_grad():
        assert torch.equal(back.model(x), ours)
    # Options Hugging Face's layer does not have cannot be exported.
    shutil.rmtree(out)
    shared = Decoder(moe_args(vocab_size=4096, shared_experts=1))
    init_parameters(shared, lambda name: SPEC.init_rule(shared.args, name), 1)
    ckpt = write_checkpoint(tmp_path / "s" / "step-1", shared, step=1, model_name="qwen3_moe")
    assert convert_to_hf.main([str(ckpt), str(out)]) == 2


# --------------------------------------------------------------------------- training
MOE_ARGS = [
    "--model.name",
    "qwen3_moe",
    "--model.n_layers",
    "2",
    "--training.steps",
    "8",
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.interval",
    "4",
    "--model.aux_loss_coef",
    "0.01",
    "--model.bias_update_rate",
    "0.001",
]


def train(world: int, out: Path, local_batch: int, *args: str) -> dict:
    from train_scenarios import on_pool

    argv = [
        *MOE_ARGS,
        "--training.local_batch_size",
        str(local_batch),
        "--job.dump_folder",
        str(out),
        *args,
    ]
    return on_pool(world, argv)


def by_key(run: dict, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run["records"] if key in r}


def losses(run: dict) -> dict[int, float]:
    return by_key(run, "loss")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The baseline of both training tests: one process, global batch 4, 8 steps, saving at
    step 4 (its run folder, and what train returned)."""
    out = tmp_path_factory.mktemp("moe") / "one"
    return out, train(1, out, 4)


@pytest.mark.slow
def test_data_parallel_layouts_match_one_process_and_resume_across_them(
    tmp_path: Path, one_process: tuple[Path, dict]
) -> None:
    """qwen3_moe debug (2 layers), fp32, dropless, with the sequence-wise aux loss and the
    bias update on: FSDP over 2 ranks, and context parallelism 2 (each sequence split over
    the ranks: the aux loss's expert shares and the bias update's counts summed over them;
    titanlite's DDP engine over the cp ranks) against one process with the same global
    batch, 8 steps (relative loss, gradient-norm and aux-loss differences <= 1e-5, the same
    expert load); the 2-rank step-4 checkpoint resumes on 1 process; the metrics carry
    expert load and aux loss."""
    _, one = one_process
    base = losses(one)
    assert sorted(base) == list(range(1, 9)) and base[8] < base[1]
    record = one["records"][-1]
    assert record["moe_load_max_mean"] >= 1.0 and record["moe_aux_loss"] > 0
    assert record["moe_dropped_fraction"] == 0.0 and "moe_load_max_mean_1" in record
    info = one["info"]
    assert info["active_params"] < info["num_params"]
    worst = {}
    cp2 = ("--parallelism.context_parallel_degree", "2")
    for name, local_batch, extra in (("fsdp", 2, ()), ("cp2", 4, cp2)):
        run = train(2, tmp_path / name, local_batch, *extra)
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            got, want = by_key(run, key), by_key(one, key)
            worst[f"{name}_{key}"] = max(abs(got[s] - want[s]) / want[s] for s in base)
        load = run["records"][-1]["moe_load_max_mean_1"]
        worst[f"{name}_load"] = abs(load - record["moe_load_max_mean_1"])
    print(f"moe parity, worst relative loss difference: {worst}")
    assert all(v <= 1e-5 for v in worst.values()), worst
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "fsdp" / "checkpoint" / "step-4", resumed_dir / "checkpoint" / "step-4"
    )
    resumed = losses(train(1, resumed_dir, 4))
    gap = max(abs(resumed[s] - base[s]) / base[s] for s in range(5, 9))
    print(f"moe resume 2 ranks -> 1: worst relative difference {gap:.3g}")
    assert sorted(resumed) == list(range(5, 9)) and gap <= 1e-5


def test_context_parallelism_is_a_valid_moe_layout_and_a_bad_top_k_is_an_error() -> None:
    from titanlite.checks import check
    from titanlite.config import load_config

    cfg = load_config(
        [
            "--model.name",
            "qwen3_moe",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
            "--model.n_layers",
            "2",
        ]
    )
    assert check(cfg, 4) is not None
    with pytest.raises(ValueError, match="top_k 9 exceeds num_experts 8"):
        SPEC.make_args("debugmodel", 4096, 64, {"top_k": 9})


@pytest.mark.slow  # starts worker pools: the fast subset stays under a minute
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_dispatch_matches_local_experts(world: int) -> None:
    """The all-to-all dispatch and combine of expert parallelism, on real gloo ranks: outputs,
    input gradients and summed expert gradients equal every expert held locally."""
    import moe_scenarios
    from pool import get_pool

    results = get_pool(world).run(moe_scenarios.dispatch_matches_local_experts)
    for rank, worst in enumerate(results):
        assert max(worst.values()) < 1e-5, f"rank {rank}: {worst}"


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process_and_resume_across_degrees(
    tmp_path: Path, one_process: tuple[Path, dict]
) -> None:
    """qwen3_moe debug (8 experts), fp32, dropless, aux loss and bias update on: ep 2 (2
    ranks), ep 4, ep 2 x dp_shard 2 and ep 2 x tp 2 (4 ranks) against one process with the
    same global batch, 8 steps (relative loss and gradient-norm differences <= 1e-5, and the
    same expert load at the last step); an ep-2 checkpoint resumes on 1 process and a
    1-process one on ep 4. (ep 2 inside pp 2: the DeepSeek-V3 layouts, whose MoE layer and
    all-to-all are these.)"""
    one_dir, one = one_process
    base = losses(one)
    base_norm = {r["step"]: r["grad_norm"] for r in one["records"] if "grad_norm" in r}
    worst = {}
    tp2 = ("--parallelism.tensor_parallel_degree", "2")
    layouts = (("ep2", 2, 2, ()), ("ep4", 4, 4, ()), ("ep2_dp2", 4, 2, ()), ("ep2_tp2", 4, 2, tp2))
    for name, world, ep, extra in layouts:
        dp = world // (2 if extra else 1)
        run = train(
            world, tmp_path / name, 4 // dp, "--parallelism.expert_parallel_degree", str(ep), *extra
        )
        worst[name] = max(abs(losses(run)[s] - base[s]) / base[s] for s in base)
        # Adam hides a wrong gradient scale from the loss; the gradient norm does not.
        norms = {r["step"]: r["grad_norm"] for r in run["records"] if "grad_norm" in r}
        worst[f"{name}_grad_norm"] = max(abs(norms[s] - base_norm[s]) / base_norm[s] for s in base)
        load = run["records"][-1]["moe_load_max_mean_1"]
        worst[f"{name}_load"] = abs(load - one["records"][-1]["moe_load_max_mean_1"])
    print(f"expert parallelism, worst relative loss difference: {worst}")
    assert all(v <= 1e-5 for v in worst.values()), worst
    gaps = {}
    for name, source, world, ep in (("ep2->1", tmp_path / "ep2", 1, 1), ("1->ep4", one_dir, 4, 4)):
        folder = tmp_path / f"resume_{world}"
        shutil.copytree(source / "checkpoint" / "step-4", folder / "checkpoint" / "step-4")
        run = losses(
            train(world, folder, 4 // world, "--parallelism.expert_parallel_degree", str(ep))
        )
        assert sorted(run) == list(range(5, 9)), run
        gaps[name] = max(abs(run[s] - base[s]) / base[s] for s in range(5, 9))
    print(f"expert parallelism resume, worst relative difference: {gaps}")
    assert all(v <= 1e-5 for v in gaps.values()), gaps


def test_impossible_expert_parallel_layouts_are_one_line_errors() -> None:
    from titanlite.checks import check
    from titanlite.config import load_config
    from titanlite.errors import UserError

    cases = {
        ("qwen3_moe", "3", 6): "parallelism.expert_parallel_degree 3 does not divide "
        "model.num_experts 8",
        ("qwen3_moe", "4", 2): "parallelism.expert_parallel_degree 4 must divide "
        "data_parallel_shard_degree 2",
        ("llama3", "2", 2): "parallelism.expert_parallel_degree 2: llama3 has no experts",
    }
    for (name, ep, world), expected in cases.items():
        cfg = load_config(
            [
                "--model.name",
                name,
                "--parallelism.expert_parallel_degree",
                ep,
                "--model.n_layers",
                "2",
            ]
        )
        with pytest.raises(UserError) as info:
            check(cfg, world)
        assert expected in str(info.value), str(info.value)
