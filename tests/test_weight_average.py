"""The exponential moving average of the weights (training.ema_decay, docs/stability.md): its
values against a direct computation, sharded as the weights, saved in the checkpoint and
exported with ``convert_to_hf.py --ema`` to a model transformers loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from torch import nn

from titanlite.config import ConfigError, load_config
from titanlite.training.ema import WeightAverage


def test_the_average_follows_the_weights_update_by_update() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ema = WeightAverage([model], 0.9)
    expected: dict[str, torch.Tensor] = {}
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        for n, p in model.named_parameters():  # the first update starts the average
            w = p.detach().double()
            expected[n] = 0.9 * expected[n] + 0.1 * w if n in expected else w.clone()
    assert sorted(ema.average) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(ema.average[name].double(), value, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(ema.average["0.weight"], model[0].weight)  # it lags


def test_a_checkpoint_restores_the_average_and_one_without_starts_it_afresh() -> None:
    torch.manual_seed(0)
    trained, fresh = nn.Linear(3, 2), nn.Linear(3, 2)
    ema = WeightAverage([trained], 0.5)
    for _ in range(2):
        with torch.no_grad():
            trained.weight.add_(1.0)
        ema.update()
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in ema.state_dict().items()}
    assert saved["started"] is True
    resumed = WeightAverage([fresh], 0.5)
    resumed.load_state_dict(saved)
    assert resumed.started and torch.equal(resumed.average["weight"], saved["weight"])
    resumed.load_state_dict({})  # a checkpoint of a run without the average
    resumed.update()
    assert torch.equal(resumed.average["weight"], fresh.weight)


def test_ema_decay_outside_0_1_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"training.ema_decay: must be in \[0, 1\)"):
        load_config(["--training.ema_decay", "1"])
    assert WeightAverage.of([nn.Linear(2, 2)], 0.0, [{}]) is None


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")
def test_exporting_the_average_of_a_checkpoint_without_one_is_a_user_error(
    tmp_path: Path,
) -> None:
    import dataclasses
    import json

    import torch.distributed.checkpoint as dcp

    from titanlite import models
    from titanlite.errors import UserError
    from titanlite.interop.checkpoint_model import load_checkpoint_model

    spec = models.get("llama3")
    args = spec.args_from_dict({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 256})
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")  # values do not matter here, shapes do
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path))
    sidecar = {
        "format": 2,
        "step": 3,
        "model_name": "llama3",
        "model_args": dataclasses.asdict(args),
    }
    (tmp_path / "titanlite.json").write_text(json.dumps(sidecar))
    assert load_checkpoint_model(tmp_path).meta["step"] == 3
    with pytest.raises(UserError, match="holds no average of the weights"):
        load_checkpoint_model(tmp_path, ema=True)


def test_the_dry_run_counts_the_average_in_the_model_state() -> None:
    import re

    from titanlite.dry_run import dry_run

    config = str(REPO / "train_configs" / "llama3_8b.toml")
    cfg = load_config(["--job.config_file", config, "--training.ema_decay", "0.999"])
    out = dry_run(cfg, 8, 128256)
    line = re.search(
        r"model state\s+([\d.]+) GiB per rank \(params ([\d.]+) .* EMA ([\d.]+)\)", out
    )
    assert line, out
    total, params, ema = map(float, line.groups())
    assert ema == params and total == pytest.approx(5 * params, abs=0.02)  # 4+4+8+4 bytes


STEPS, DECAY = 4, 0.5


@pytest.mark.slow
def test_a_sharded_average_equals_the_direct_one_and_exports_to_transformers(
    tmp_path: Path,
) -> None:
    """dp_shard=2: the average kept sharded on both ranks equals one computed from the
    whole weights after every step; the checkpoint's, exported with --ema, loads in
    transformers and computes what titanlite's model of it does."""
    transformers = pytest.importorskip("transformers")
    import stability_scenarios
    from pool import get_pool

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    argv = [
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
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--validation.enable",
        "false",
        "--checkpoint.interval",
        str(STEPS),
        "--training.ema_decay",
        str(DECAY),
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    ranks = get_pool(2).run(stability_scenarios.train_with_weight_snapshots, argv=argv)
    assert all(r["sharded"] for r in ranks)
    run = ranks[0]
    direct = {n: w.double() for n, w in run["snapshots"][1].items()}  # after the first step
    for weights in run["snapshots"][2:]:
        for n, w in weights.items():
            direct[n] = DECAY * direct[n] + (1 - DECAY) * w.double()
    assert len(run["snapshots"]) == STEPS + 1
    for name, value in direct.items():
        torch.testing.assert_close(run["average"][name].double(), value, rtol=1e-6, atol=1e-7)

    step = Path(run["folder"]) / "checkpoint" / f"step-{STEPS}"
    averaged = load_checkpoint_model(step, ema=True).model
    weights = load_checkpoint_model(step).model
    for name, param in averaged.named_parameters():
        assert torch.equal(param, run["average"][name]), name
    assert not torch.equal(averaged.output.weight, weights.output.weight)

    sys.path.insert(0, str(REPO / "scripts"))
    import convert_to_hf

    out = tmp_path / "hf"
    assert convert_to_hf.main([str(step), str(out), "--ema"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = averaged(x), hf(x).logits.float()
    assert (ours - theirs).abs().max().item() < 1e-5 * max(ours.abs().max().item(), 1.0)


# --- scripts/average_checkpoints.py --------------------------------------------------------------


def write_step(folder: Path, *, seed: int, dim: int = 64) -> Path:
    """A training checkpoint of a tiny Llama (weights drawn from ``seed``), as the trainer
    writes one: DCP "model" (and an optimizer entry) + titanlite.json."""
    import dataclasses
    import json

    import torch.distributed.checkpoint as dcp

    from titanlite import models
    from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH

    spec = models.get("llama3")
    args = spec.args_from_dict({"dim": dim, "n_layers": 1, "n_heads": 4, "vocab_size": 4096})
    torch.manual_seed(seed)
    model = spec.build(args)
    with torch.no_grad():  # built on the CPU uninitialized
        for param in model.parameters():
            param.normal_()
    state = {"model": model.state_dict(), "optimizer": {"x": torch.ones(2)}}
    dcp.save(state, checkpoint_id=str(folder))
    sidecar = {
        "format": 2,
        "step": seed,
        "model_name": "llama3",
        "model_only": False,
        "model_args": dataclasses.asdict(args),
        "tokenizer": str(DEFAULT_TOKENIZER_PATH),
    }
    (folder / "titanlite.json").write_text(json.dumps(sidecar))
    return folder


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")
def test_average_checkpoints_writes_the_mean_model_that_the_tools_take(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import average_checkpoints
    import convert_to_hf

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    steps = [write_step(tmp_path / "checkpoint" / f"step-{s}", seed=s) for s in (1, 2, 3)]
    out = tmp_path / "averaged"
    assert average_checkpoints.main([*map(str, steps), "--out", str(out)]) == 0
    loaded = load_checkpoint_model(out)
    assert loaded.meta["model_only"] is True
    models = [load_checkpoint_model(s).model.state_dict() for s in steps]
    for name, value in loaded.model.state_dict().items():
        mean = sum(m[name].double() for m in models) / 3
        torch.testing.assert_close(value.double(), mean, rtol=1e-6, atol=1e-7)
    assert not torch.equal(models[0]["output.weight"], models[1]["output.weight"])
    assert convert_to_hf.main([str(out), str(tmp_path / "hf")]) == 0  # and initial_load_path


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")
def test_average_checkpoints_refuses_another_run_or_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import average_checkpoints

    run = tmp_path / "run" / "checkpoint"
    one, wider = write_step(run / "step-1", seed=1), write_step(run / "step-2", seed=2, dim=128)
    other = write_step(tmp_path / "other" / "checkpoint" / "step-3", seed=3)
    cases = [
        ([one, wider], "holds another model than"),
        ([one, other], "the checkpoints are not of one run"),
        ([one, one], "at least two different checkpoint folders"),
    ]
    for paths, message in cases:
        out = tmp_path / "out"
        assert average_checkpoints.main([*map(str, paths), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists() or not any(out.iterdir())
