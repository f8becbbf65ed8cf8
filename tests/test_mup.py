"""μP ([mup], titanlite/mup/): the roles of every family's parameters, the standard model at
the base width, flat activations across widths (the coordinate check), the same steps under
fsdp 2 x tp 2 as in one process, and the groups run.json reports."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from conftest import REPO, run_train

CONFIG = str(REPO / "train_configs" / "debug_model.toml")
SMALL = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]


def test_every_family_gets_its_roles_and_factors_from_its_own_shapes() -> None:
    from titanlite import models
    from titanlite.mup.parametrize import plan

    shapes = {
        "llama3": {},
        "qwen3_moe": {"num_experts": 4, "top_k": 2, "moe_hidden_dim": 32, "head_dim": 16},
        "deepseek_v3": {
            "num_experts": 4,
            "top_k": 2,
            "moe_hidden_dim": 32,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "dense_hidden_dim": 128,
            "first_k_dense": 1,
            "n_groups": 1,
            "topk_groups": 1,
        },
        "qwen3_5": {
            "head_dim": 16,
            "hidden_dim": 128,
            "linear_k_heads": 2,
            "linear_v_heads": 4,
            "linear_k_dim": 16,
            "linear_v_dim": 16,
        },
    }
    for family, extra in shapes.items():
        spec = models.get(family)
        args = spec.args_from_dict(
            {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, **extra}
        )
        p = plan(spec, args, base_dim=32)
        roles = p.roles
        assert p.width_mult == 2 and p.output_multiplier == 0.5, family
        assert roles["tok_embeddings.weight"] == "input-like"
        assert roles["output.weight"] == "readout" and p.init_scale["output.weight"] == 2
        assert all(r == "input-like" for n, r in roles.items() if n.endswith("norm.weight"))
        hidden = [n for n, r in roles.items() if r == "hidden"]
        assert "layers.1.feed_forward.w2.weight" in hidden or any("experts" in n for n in hidden)
        for name in hidden:
            assert p.init_scale[name] == pytest.approx(2**-0.5) and p.lr_scale[name] == 0.5
        out_like = {n for n, r in roles.items() if r == "output-like"}
        # Routers (dim -> experts) and MLA's rope key (dim -> rope size): only the input grows.
        assert out_like == {n for n in roles if n.endswith(("router.weight", "wk_rope.weight"))}
        assert Counter(roles.values())["hidden"] >= 4, family
        # At the base width every factor is one: the standard model.
        base = plan(spec, args, base_dim=64)
        assert set(base.init_scale.values()) <= {1.0} and set(base.lr_scale.values()) <= {1.0}
        assert base.output_multiplier == 1.0 and base.attention_scale == 1.0


def test_muon_matrices_keep_the_spectral_step_of_the_base_width() -> None:
    """Muon's step has the spectral norm of lr x its shape's scale: μP's factor for a Muon
    matrix keeps sqrt(fan_out / fan_in) / scale as at the base width (m = 2 here)."""
    from functools import partial

    from titanlite import models
    from titanlite.config import load_config
    from titanlite.mup.parametrize import lr_scale, plan
    from titanlite.optim.groups import resolve_groups
    from titanlite.optim.muon import spectral_lr

    spec = models.get("qwen3_moe")
    extra = {"num_experts": 4, "top_k": 2, "moe_hidden_dim": 32, "head_dim": 16}
    args = spec.args_from_dict({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 256, **extra})
    factor = lr_scale(plan(spec, args, base_dim=32))
    expected = {  # (hidden, router: [4 experts, dim]) per lr_adjustment
        "match_rms_adamw": (2**-0.5, 0.5),  # the step grows with sqrt(fan): 1/sqrt(m) more
        "original": (1.0, 2**-0.5),  # square-ish: as is; the router's target falls 1/sqrt(m)
        "none": (1.0, 2**-0.5),
    }
    for adjustment, (hidden, router) in expected.items():
        step = partial(spectral_lr, adjustment=adjustment)
        assert factor("layers.0.attention.wq.weight", step) == pytest.approx(hidden)
        assert factor("layers.0.feed_forward.experts.w1", step) == pytest.approx(hidden)
        assert factor("layers.0.feed_forward.router.weight", step) == pytest.approx(router), (
            adjustment
        )
        assert factor("tok_embeddings.weight", step) == 1.0  # not a growing matrix
    assert factor("layers.0.attention.wq.weight") == 0.5  # AdamW's: the table's 1/m
    cfg = load_config(["--optimizer.name", "Muon"])
    with torch.device("meta"):
        model = spec.build(args)
    groups = {g.name: g for g in resolve_groups(model, cfg.optimizer, lr_scale=factor)}
    scaled = groups["muon (mup x0.7071)"]
    assert "layers.0.attention.wq.weight" in scaled.names
    assert scaled.lr == pytest.approx(cfg.optimizer.lr * 2**-0.5)
    # Muon's default rules give the router to AdamW: the table's 1/m.
    assert "layers.0.feed_forward.router.weight" in groups["adamw (mup x0.5)"].names


@pytest.mark.slow
def test_at_the_base_width_mup_trains_the_standard_model_and_wider_it_does_not(tmp_path) -> None:
    import train_scenarios
    from pool import get_pool

    def losses(name: str, *extra: str) -> list[float]:
        argv = [
            *SMALL,
            "--training.steps",
            "3",
            *extra,
            "--job.dump_folder",
            str(tmp_path / name),
        ]
        run = get_pool(1).run(train_scenarios.train, argv=argv)[0]
        return [r["loss"] for r in run["records"] if "loss" in r]

    standard = losses("standard")
    assert losses("base", "--mup.enable", "true", "--mup.base_dim", "64") == standard
    assert losses("wider", "--mup.enable", "true", "--mup.base_dim", "32") != standard


@pytest.mark.slow
def test_coordinate_check_is_flat_with_mup_and_grows_without() -> None:
    """Widths 32 -> 128, 5 steps at a learning rate of 1e-2: with μP every layer's activation
    RMS at step 5 stays within 2x across widths; without it the deepest blocks grow."""
    import mup_scenarios
    from pool import get_pool

    sys.path.insert(0, str(REPO / "scripts"))
    import coord_check

    spreads = {}
    for mup in (True, False):
        res = get_pool(1).run(
            mup_scenarios.coord,
            widths=[32, 64, 128],
            steps=5,
            mup=mup,
            base_dim=32,
            head_dim=16,
            lr=1e-2,
        )[0]
        spreads[mup] = coord_check.spread(res, 5)
    print(
        f"\nRMS ratio over widths 32-128 at step 5: muP {spreads[True]}, standard {spreads[False]}"
    )
    assert max(spreads[True].values()) < 2.0, spreads[True]
    assert max(spreads[False].values()) > 2.0, spreads[False]


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "factor"), [("AdamW", "0.5"), ("Muon", "0.7071")])
def test_fsdp_2_x_tp_2_takes_the_steps_of_one_process(tmp_path, optimizer, factor) -> None:
    """AdamW's hidden matrices at 1/m, Muon's at 1/sqrt(m) (match_rms_adamw), m = 2."""
    import train_scenarios
    from pool import get_pool

    mup = ["--mup.enable", "true", "--mup.base_dim", "32", "--training.steps", "8"]
    argv = [*SMALL, *mup, "--optimizer.name", optimizer]
    same_batch = ["--training.local_batch_size", "4"]  # the global batch of dp_shard 2 x 2
    one = get_pool(1).run(
        train_scenarios.train, argv=[*argv, *same_batch, "--job.dump_folder", str(tmp_path / "one")]
    )[0]
    layout = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    four = get_pool(4).run(
        train_scenarios.train, argv=[*argv, *layout, "--job.dump_folder", str(tmp_path / "four")]
    )[0]
    a = [r for r in one["records"] if "loss" in r]
    b = [r for r in four["records"] if "loss" in r]
    assert len(a) == len(b) == 8
    worst = max(
        abs(x[k] - y[k]) / max(abs(x[k]), 1e-30)
        for x, y in zip(a, b, strict=True)
        for k in ("loss", "grad_norm")
    )
    print(f"\nmuP ({optimizer}), fsdp 2 x tp 2 vs one process over 8 steps: {worst:.2e} at most")
    assert worst <= 1e-6
    # The groups run.json reports carry μP's learning rates.
    groups = {g["name"]: g for g in one["info"]["optimizer_groups"]}
    from titanlite.config import load_config

    lr = load_config(["--job.config_file", CONFIG]).optimizer.lr
    hidden = "muon" if optimizer == "Muon" else "decay"  # the group of the hidden matrices
    scaled = groups[f"{hidden} (mup x{factor})"]
    assert scaled["lr"] == pytest.approx(float(factor) * lr, rel=1e-3)


def test_bad_mup_settings_are_one_line_and_exit_2(tmp_path) -> None:
    result = run_train(
        tmp_path,
        CONFIG,
        *SMALL,
        "--mup.enable",
        "true",
        "--mup.base_dim",
        "0",
        "--job.dump_folder",
        str(tmp_path / "out"),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("titanlite: error:")]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: mup.base_dim"), result.stderr
    assert not (tmp_path / "out").exists()
