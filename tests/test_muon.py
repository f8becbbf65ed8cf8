"""Muon: its step against the published algorithm written out here, its groups and config, and
its distributed orthogonalization (whole matrices, each once) trained under the layouts against
one process."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import muon_scenarios
import pytest
import torch
import train_scenarios
from pool import get_pool
from torch import nn

from titanlite import models
from titanlite.config import ConfigError, load_config
from titanlite.errors import UserError
from titanlite.metrics.compare import relative_difference
from titanlite.optim import build_optimizer, resolve_groups
from titanlite.optim.muon import Muon, NewtonSchulz
from titanlite.optim.orthogonalize import Orthogonalizer

# --- the step against the published algorithm -----------------------------------------------


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration (github.com/KellerJordan/Muon), on one [out, in]
    matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (torch.sqrt((x * x).sum()) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def reference_step(w, g, buf, *, lr, decay, momentum, adjustment):  # noqa: ANN001, ANN202
    """One Muon step of an [out, in] matrix (Moonlight's form: Nesterov momentum, decoupled
    weight decay, the lr scaled to the matrix's shape)."""
    buf = momentum * buf + g
    update = reference_newton_schulz(g + momentum * buf)
    out, inp = w.shape
    scale = 0.2 * math.sqrt(max(out, inp)) if adjustment == "match_rms_adamw" else None
    if adjustment == "original":
        scale = math.sqrt(max(1.0, out / inp))
    return w * (1 - lr * decay) - lr * scale * update, buf


@pytest.mark.parametrize("adjustment", ["match_rms_adamw", "original"])
def test_step_equals_the_published_algorithm_in_float64(adjustment: str) -> None:
    """Three steps on a wide, a tall and a square matrix and a stack of 3 experts
    ([experts, in, out]: each expert's [out, in] matrix is its transpose), in float64:
    within 1e-10 of the plain reference, expert by expert."""
    torch.manual_seed(0)
    shapes = [(6, 10), (12, 5), (7, 7), (3, 8, 4)]
    weights = [torch.randn(s, dtype=torch.float64) for s in shapes]
    params = [nn.Parameter(w.clone()) for w in weights]
    lr, decay, momentum = 0.02, 0.1, 0.95
    optimizer = Muon(
        [{"params": params, "lr": lr, "weight_decay": decay, "optimizer": "muon"}],
        momentum=momentum,
        nesterov=True,
        lr_adjustment=adjustment,
        orthogonalize=Orthogonalizer(NewtonSchulz(dtype=torch.float64)),
        adamw={"lr": lr, "foreach": False},
    )
    # The reference works on [out, in] matrices: an expert stack's are its transposes.
    ref = [w.clone() if w.ndim == 2 else w.transpose(1, 2).clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in ref]
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            kw = dict(lr=lr, decay=decay, momentum=momentum, adjustment=adjustment)
            if g.ndim == 2:
                ref[i], bufs[i] = reference_step(ref[i], g, bufs[i], **kw)
                continue
            stepped = [reference_step(ref[i][e], g[e].T, bufs[i][e], **kw) for e in range(3)]
            ref[i] = torch.stack([w for w, _ in stepped])
            bufs[i] = torch.stack([b for _, b in stepped])
    for p, r in zip(params, ref, strict=True):
        want = r if p.ndim == 2 else r.transpose(1, 2)
        assert (p.detach() - want).abs().max().item() <= 1e-10
    assert all(not torch.equal(p.detach(), w) for p, w in zip(params, weights, strict=True))


def test_newton_schulz_approximates_the_orthogonal_factor() -> None:
    """O = NS(G) shares G's singular vectors (O G^T is symmetric positive semi-definite) and
    its singular values are near 1 (Keller Jordan's coefficients aim at about 0.7 to 1.2)."""
    torch.manual_seed(1)
    for shape in [(32, 64), (64, 16), (40, 40)]:
        g = torch.randn(shape, dtype=torch.float64)
        o = NewtonSchulz(dtype=torch.float64)(g)
        cross = o @ g.T if shape[0] <= shape[1] else o.T @ g
        assert (cross - cross.T).abs().max().item() < 1e-10 * cross.abs().max().item()
        assert torch.linalg.eigvalsh(cross).min().item() > -1e-10
        sv = torch.linalg.svdvals(o)
        assert 0.6 < sv.min().item() and sv.max().item() < 1.25, sv


def test_adamw_groups_step_exactly_as_torch_adamw() -> None:
    """In a Muon optimizer, the AdamW groups are torch's AdamW (fused on the CPU) bit for bit,
    and the Muon group moves its matrix."""
    torch.manual_seed(2)
    vector, matrix, muon_matrix = torch.randn(8), torch.randn(4, 8), torch.randn(8, 8)
    ours = [nn.Parameter(t.clone()) for t in (vector, matrix, muon_matrix)]
    theirs = [nn.Parameter(t.clone()) for t in (vector, matrix)]
    adamw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "fused": True}
    optimizer = Muon(
        [
            {"params": ours[:1], "lr": 1e-2, "weight_decay": 0.0, "optimizer": "adamw"},
            {"params": ours[1:2], "lr": 1e-2, "weight_decay": 0.1, "optimizer": "adamw"},
            {"params": ours[2:], "lr": 1e-2, "weight_decay": 0.1, "optimizer": "muon"},
        ],
        momentum=0.95,
        nesterov=True,
        lr_adjustment="match_rms_adamw",
        orthogonalize=Orthogonalizer(NewtonSchulz()),
        adamw=adamw,
    )
    reference = torch.optim.AdamW(
        [{"params": theirs[:1], "weight_decay": 0.0}, {"params": theirs[1:], "weight_decay": 0.1}],
        **adamw,
    )
    for _ in range(3):
        grads = [torch.randn_like(t) for t in (vector, matrix, muon_matrix)]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(theirs, grads[:2], strict=True):
            p.grad = g.clone()
        optimizer.step()
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(ours[:2], theirs, strict=True))
    assert set(optimizer.state[ours[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(optimizer.state[ours[2]]) == {"momentum_buffer"}
    assert not torch.equal(ours[2].detach(), muon_matrix)


# --- groups and config ------------------------------------------------------------------------


def debug_llama() -> nn.Module:
    spec = models.get("llama3")
    with torch.device("meta"):
        return spec.build(spec.make_args("debugmodel", 128, 32, {"n_layers": 1}))


def test_default_rules_give_hidden_matrices_to_muon_and_the_rest_to_adamw() -> None:
    cfg = load_config(["--optimizer.name", "Muon", "--optimizer.lr", "0.01"])
    groups = resolve_groups(debug_llama(), cfg.optimizer)
    named = {(g.name, g.optimizer, g.lr, g.weight_decay): g.names for g in groups}
    assert named == {
        ("adamw", "adamw", 0.01, 0.1): ["tok_embeddings.weight", "output.weight"],
        ("adamw_no_decay", "adamw", 0.01, 0.0): [
            "layers.0.attention_norm.weight",
            "layers.0.ffn_norm.weight",
            "norm.weight",
        ],
        ("muon", "muon", 0.01, 0.1): [
            f"layers.0.{m}.weight"
            for m in (
                "attention.wq",
                "attention.wk",
                "attention.wv",
                "attention.wo",
                "feed_forward.w1",
                "feed_forward.w2",
                "feed_forward.w3",
            )
        ],
    }
    moe = models.get("qwen3_moe")
    with torch.device("meta"):
        model = moe.build(moe.make_args("debugmodel", 128, 32, {"n_layers": 1}))
    by_name = {g.name: g.names for g in resolve_groups(model, cfg.optimizer)}
    assert "layers.0.feed_forward.router.weight" in by_name["adamw"]
    assert "layers.0.feed_forward.experts.w1" in by_name["muon"]


def test_muon_on_a_vector_is_a_one_line_error_naming_rule_and_parameter() -> None:
    rules = '[{params = "*norm*", optimizer = "muon", name = "norms"}, {params = "*"}]'
    cfg = load_config(["--optimizer.param_groups", rules])
    with pytest.raises(UserError) as e:
        resolve_groups(debug_llama(), cfg.optimizer)
    assert str(e.value) == (
        "optimizer.param_groups: rule 'norms' gives layers.0.attention_norm.weight (shape "
        '(256,)) to muon, which takes matrices only; add dims = "matrix" to the rule or give '
        "it to adamw"
    )


def test_an_adamw_run_with_a_muon_rule_builds_one_optimizer_for_both(tmp_path: Path) -> None:
    config = tmp_path / "muon.toml"
    config.write_text(
        '[optimizer]\nname = "AdamW"\nlr = 0.01\n'
        '[[optimizer.param_groups]]\nparams = "proj.*"\ndims = "matrix"\noptimizer = "muon"\n'
        '[[optimizer.param_groups]]\nparams = "*"\n'
        '[muon]\nmomentum = 0.9\nns_steps = 3\nlr_adjustment = "original"\n'
    )
    cfg = load_config(["--job.config_file", str(config), "--muon.ns_dtype", "bfloat16"])
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(4, 8))
    model.add_module("head", nn.Linear(8, 2))
    optimizer, groups = build_optimizer(
        model, cfg.optimizer, torch.device("cpu"), sections=cfg.components
    )
    assert isinstance(optimizer, Muon) and [g.optimizer for g in groups] == ["muon", "adamw"]
    assert (optimizer.momentum, optimizer.lr_adjustment) == (0.9, "original")
    ns = optimizer.orthogonalize.newton_schulz
    assert (ns.steps, ns.dtype) == (3, torch.bfloat16)
    with pytest.raises(ConfigError) as info:
        load_config(["--muon.momentum", "1.0", "--muon.ns_steps", "0"])
    assert str(info.value).splitlines() == [
        "muon.momentum: must be in [0, 1), got 1.0",
        "muon.ns_steps: must be at least 1, got 0",
    ]


def test_rules_naming_optimizers_none_hosts_are_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from titanlite import optim

    toy = optim.OptimizerEntry(module="titanlite.optim.adamw", default_rules=())
    monkeypatch.setitem(optim.REGISTRY, "toy", toy)
    cfg = load_config(["--optimizer.param_groups", '[{params = "*norm*", optimizer = "toy"}, {}]'])
    with pytest.raises(UserError) as e:
        build_optimizer(debug_llama(), cfg.optimizer, torch.device("cpu"))
    assert str(e.value) == (
        "optimizer.param_groups: the rules name adamw, toy, which no optimizer steps "
        "together; a part may mix only muon (with adamw)"
    )


def test_a_torchtitan_toml_with_another_optimizer_still_blocks_naming_both() -> None:
    from titanlite.config import torchtitan

    conversion = torchtitan.convert({"optimizer": {"name": "Adam"}})
    assert (
        'blocking: optimizer.name = "Adam": not a value of optimizer.name: titanlite\'s '
        "optimizers are adamw, muon" in conversion.report_lines()
    )


# --- distributed ------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_layout_orthogonalizes_whole_matrices_once_per_holder() -> None:
    results = get_pool(4).run(muon_scenarios.orthogonalizes_whole_matrices_once)
    assert results[0]["plans"] == {
        "fsdp rows": "sharded",
        "fsdp uneven rows": "sharded",
        "tp columns": "sharded",
        "hsdp": "sharded",
        "fsdp x tp": "gathered",
        "two splits of rows": "gathered",
        "fsdp x tp, strided rows": "gathered",
        "experts by expert": "local",
        "experts by rows": "sharded",
    }
    # Largest first, each to the least loaded holder (lowest on a tie), per set of ranks: the
    # row-split experts (7488 FLOPs an iteration) to rank 0 of each row of the 2 x 2 mesh and
    # hsdp (1872) to rank 1 of each; over all 4 ranks (sharded and gathered share them) tp
    # columns (6144) rank 0, fsdp rows (4096) 1, fsdp x tp (4096) 2, then uneven (1850),
    # strided (1584) and two splits (1152) all to rank 3; every rank its own experts.
    assert [r["owned"] for r in results] == [3, 3, 3, 5]
    assert [r["replicas_owned"] for r in results] == [1, 1, 1, 1]


STEPS = 8
LLAMA = (
    "--model.name",
    "llama3",
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--model.multiple_of",
    "32",
)
MOE = (
    "--model.name",
    "qwen3_moe",
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.head_dim",
    "16",
    "--model.moe_hidden_dim",
    "32",
)
COMMON = (
    "--training.seq_len",
    "32",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--optimizer.name",
    "muon",
    "--optimizer.lr",
    "0.01",
    "--lr_scheduler.warmup_steps",
    "2",
)
FSDP4 = ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"]
LAYOUTS = {
    "dp_shard2_tp2": (
        4,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "ddp2": (
        2,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "hsdp2x2": (
        4,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.local_batch_size",
            "2",
        ],
    ),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "pp2_dp_shard2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
}
# Muon normalizes each update, so the loss is less forgiving of a wrong gradient than Adam's;
# the gradient norm (before clipping) catches a wrong scale directly.
RTOL = 1e-5
CURVES = ("loss", "grad_norm", "qk_max_logit", "qk_clipped_heads")  # those a run logs


def train(
    folder: Path, world: int, *args: str, model: tuple[str, ...] = LLAMA
) -> tuple[dict[str, list[float]], list[str]]:
    pool = get_pool(world)
    argv = [*model, *COMMON, "--job.dump_folder", str(folder), *args]
    run = pool.run(train_scenarios.train, argv=argv)[0]
    records = [r for r in run["records"] if "loss" in r]
    curves = {m: [float(r[m]) for r in records] for m in CURVES if m in records[0]}
    curves["step"] = [r["step"] for r in records]
    groups = {g["name"]: g["optimizer"] for g in run["info"]["optimizer_groups"]}
    assert groups == {"adamw": "adamw", "adamw_no_decay": "adamw", "muon": "muon"}
    return curves, pool.last_logs[0]


def worst(base: dict, other: dict, steps: list[int]) -> dict[str, float]:
    index = {s: i for i, s in enumerate(base["step"])}
    return {
        m: max(
            relative_difference(base[m][index[s]], other[m][i])
            for i, s in enumerate(other["step"])
            if s in steps
        )
        for m in CURVES
        if m in base and m != "qk_clipped_heads"
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    curves, log = train(
        tmp_path_factory.mktemp("muon") / "one", 1, "--training.local_batch_size", "8"
    )
    assert curves["step"] == list(range(1, STEPS + 1))
    print(f"muon one process: losses {curves['loss']}")
    assert curves["loss"][-1] < curves["loss"][0] - 0.1  # it learns (8 steps of a tiny model)
    assert any("muon: 14 matrices (14 local); this rank orthogonalizes 14" in line for line in log)
    return curves


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout: str, one_process: dict, tmp_path: Path) -> None:
    world, args = LAYOUTS[layout]
    curves, log = train(tmp_path / "run", world, *args)
    measured = worst(one_process, curves, list(range(1, STEPS + 1)))
    print(f"muon {layout}: worst relative difference {measured}")
    assert all(v <= RTOL for v in measured.values()), measured
    # Rank 0's share of the 14 matrices (2 blocks x 7; the 6 MLP ones cost 2.3x an attention
    # one and are placed first, each on the least loaded rank): over 2 ranks (DDP, the cp
    # ranks DDP averages over, an HSDP row, TP) 3 MLP + 4 attention; over the 4 of FSDP x TP
    # 2 MLP + 1 attention; its stage's 7 under pp; of its stage's 7 over 2 FSDP ranks
    # (pp x FSDP) 2 MLP + 1 attention.
    owned = {
        "dp_shard2_tp2": "14 matrices (14 gathered); this rank orthogonalizes 3",
        "ddp2": "14 matrices (14 replicated); this rank orthogonalizes 7",
        "pp2": "7 matrices (7 local); this rank orthogonalizes 7",
        "hsdp2x2": "14 matrices (14 sharded); this rank orthogonalizes 7",
        "tp2": "14 matrices (14 sharded); this rank orthogonalizes 7",
        "cp2": "14 matrices (14 replicated); this rank orthogonalizes 7",
        "pp2_dp_shard2": "7 matrices (7 sharded); this rank orthogonalizes 3",
    }[layout]
    assert any(owned in line for line in log), [line for line in log if "muon:" in line]


@pytest.mark.slow
def test_fsdp4_matches_one_process_and_its_checkpoint_resumes_in_one(
    one_process: dict, tmp_path: Path
) -> None:
    """FSDP over 4 ranks: each matrix gathered to one owner, 3 of the 14 on rank 0. The
    momentum buffers are in the checkpoint at their global shapes: its step-4 checkpoint
    resumes in one process and steps 5-8 match the uninterrupted run."""
    saving = ("--checkpoint.enable", "true", "--checkpoint.interval", "4")
    curves, log = train(tmp_path / "fsdp4", 4, *FSDP4, *saving)
    measured = worst(one_process, curves, list(range(1, STEPS + 1)))
    print(f"muon fsdp4: worst relative difference {measured}")
    assert all(v <= RTOL for v in measured.values()), measured
    owned = "14 matrices (14 sharded); this rank orthogonalizes 3"
    assert any(owned in line for line in log), [line for line in log if "muon:" in line]
    resumed = {}
    for name, extra in (
        ("all", ()),
        ("no optimizer", ("--checkpoint.exclude_from_loading", "optimizer")),
    ):
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(
            tmp_path / "fsdp4" / "checkpoint" / "step-4", folder / "checkpoint" / "step-4"
        )
        curves, _ = train(folder, 1, "--training.local_batch_size", "8", *saving, *extra)
        assert curves["step"] == [5, 6, 7, 8]
        resumed[name] = worst(one_process, curves, [5, 6, 7, 8])
    print(f"muon resume fsdp4 -> 1 process: worst relative difference {resumed}")
    assert all(v <= RTOL for v in resumed["all"].values()), resumed
    # Without the momentum buffers (and Adam's moments) the steps differ: they were restored.
    assert resumed["no optimizer"]["loss"] > 1e-4, resumed


@pytest.mark.slow
def test_experts_split_over_ep2_x_dp_shard2_match_one_process(tmp_path: Path) -> None:
    """qwen3_moe (8 experts, 2 blocks), ep 2 inside dp_shard 4 (2 x 2): each rank holds 2 whole
    experts of each stack and orthogonalizes them itself (expert by expert); attention
    matrices go to the 4 FSDP ranks (2 on rank 0: a 64 x 64 and a 32 x 64 one); the router
    stays with AdamW."""
    one, _ = train(tmp_path / "one", 1, "--training.local_batch_size", "8", model=MOE)
    curves, log = train(
        tmp_path / "ep2",
        4,
        "--training.local_batch_size",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        model=MOE,
    )
    measured = worst(one, curves, list(range(1, STEPS + 1)))
    print(f"muon ep2 x dp_shard2 (qwen3_moe): worst relative difference {measured}")
    assert all(v <= RTOL for v in measured.values()), measured
    owned = "14 matrices (6 local, 8 sharded); this rank orthogonalizes 8"
    assert any(owned in line for line in log), [line for line in log if "muon:" in line]
