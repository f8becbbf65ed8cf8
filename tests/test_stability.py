"""Training that survives its own numerics (docs/stability.md): the z-loss (its value against
a direct computation on the logits, its gradient, parity under loss parallelism and
pipeline parallelism) and skipping the update of a spiking or non-finite step (the decision
rule, the settings' errors, every rank skipping while parameters and optimizer state stay
put, and an exact resume across skipped steps)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from titanlite.config import ConfigError, load_config
from titanlite.config.job_config import Training
from titanlite.data.batches import IGNORE_INDEX
from titanlite.errors import TrainingDiverged
from titanlite.training.loss import TrainingLoss, cross_entropy_sum
from titanlite.training.stability import SpikeGuard

# --- z-loss: the function (no processes) ---------------------------------------------------------


def logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, :2] = labels[1, 4] = IGNORE_INDEX
    return logits, labels


def test_z_loss_and_its_gradient_equal_a_direct_computation() -> None:
    logits, labels = logits_and_labels()
    weight = 0.03
    objective, terms = TrainingLoss(weight)(logits, labels)
    objective.backward()

    wide = logits.detach().double().requires_grad_()
    targets = labels != IGNORE_INDEX
    log_z = torch.log(torch.exp(wide).sum(-1))  # written out, not torch.logsumexp
    z_direct = weight * log_z[targets].square().sum()
    ce_direct = -torch.log_softmax(wide, -1)[targets].gather(-1, labels[targets, None]).sum()
    (ce_direct + z_direct).backward()

    assert terms.shape == (2,) and not terms.requires_grad
    assert torch.allclose(terms.double(), torch.stack([ce_direct, z_direct]), rtol=1e-6)
    assert z_direct > 0.05 * ce_direct  # large enough here for the gradient check to see it
    assert torch.allclose(logits.grad.double(), wide.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(logits.grad[0, :2], torch.zeros(2, 11))  # ignored positions: no pull


def test_without_z_loss_the_objective_is_the_cross_entropy_sum_bit_for_bit() -> None:
    logits, labels = logits_and_labels()
    loss = TrainingLoss(0.0)
    objective, terms = loss(logits, labels)
    assert loss.names == ("loss",) and TrainingLoss(1e-4).names == ("loss", "z_loss")
    assert torch.equal(objective, cross_entropy_sum(logits, labels))
    assert torch.equal(terms, objective.detach().reshape(1))


# --- the spike guard (no processes) --------------------------------------------------------------


def guard(**settings: object) -> tuple[SpikeGuard, list[dict]]:
    training = Training(**{"skip_spikes": ["loss", "grad_norm"], "max_skipped": 2, **settings})
    logged: list[dict] = []
    return SpikeGuard(training, lambda record, line: logged.append(record)), logged


def accept(g: SpikeGuard, loss: float, norm: float, step: int = 1) -> bool:
    return g.accept(torch.tensor(loss), torch.tensor(norm), step)


def test_a_value_above_mean_plus_k_sigma_of_a_full_window_is_skipped() -> None:
    g, logged = guard(spike_window=4, spike_sigmas=3.0)
    window = [4.0, 4.25, 3.75, 4.0]  # exact in float32, as the guard reads them
    for loss in window:
        assert accept(g, loss, 1.0)  # the window fills: nothing can be a spike yet
    bound = 4.0 + 3 * math.sqrt(sum((v - 4.0) ** 2 for v in window) / 4)  # 4.53
    assert accept(g, 4.5, 1.0) and 4.5 < bound < 4.55
    assert not accept(g, 100.0, 1.0, step=6)  # a loss spike
    assert not accept(g, 4.0, 1.5, step=7)  # a gradient-norm spike (its window: all 1.0)
    assert accept(g, 4.125, 1.0)  # the skipped values did not enter the windows
    assert list(g.windows["loss"]) == [3.75, 4.0, 4.5, 4.125] and g.skipped == 2
    assert list(g.windows["grad_norm"]) == [1.0] * 4
    assert [(r["step"], r["kind"]) for r in logged] == [(6, "skip"), (7, "skip")]
    assert "loss 100 > mean" in logged[0]["reason"] and logged[1]["grad_norm"] == 1.5
    assert logged[1]["skipped_steps"] == 2


def test_non_finite_steps_are_skipped_up_to_max_skipped_in_a_row_then_the_run_stops() -> None:
    g, _ = guard(skip_spikes=[], max_skipped=2)
    assert not accept(g, float("nan"), 1.0)  # even before any window could fill
    assert not accept(g, 3.0, float("inf"))
    assert accept(g, 3.0, 1.0)  # resets the count in a row
    assert not accept(g, float("nan"), 1.0) and not accept(g, float("nan"), 1.0)
    with pytest.raises(TrainingDiverged, match="3 steps in a row skipped, more than"):
        accept(g, float("nan"), 1.0, step=9)
    assert g.metrics() == {"skipped_steps": 5}


def test_the_window_resumes_exactly_through_json() -> None:
    g, _ = guard(spike_window=3)
    for loss, norm in ((2.0 / 3, 0.1), (0.7000000000000001, 0.3), (0.69, 0.2)):
        accept(g, loss, norm)
    assert not accept(g, float("nan"), 1.0)
    saved = json.loads(json.dumps(g.state_dict()))  # as the checkpoint's sidecar keeps it
    again, _ = guard(spike_window=3)
    again.load_state_dict(saved)
    assert again.state_dict() == g.state_dict() and again.in_a_row == 1
    for values in ((0.695, 0.25), (0.9, 0.2), (0.69, 0.9)):
        assert accept(again, *values) == accept(g, *values)
    shorter, _ = guard(spike_window=2)  # a resume with a smaller window keeps the latest
    shorter.load_state_dict(saved)
    assert list(shorter.windows["loss"]) == saved["windows"]["loss"][-2:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--training.skip_spikes", "loss,gradnorm", "--training.max_skipped", "1"],
            "training.skip_spikes: must name only loss, grad_norm",
        ),
        (["--training.skip_spikes", "loss"], "training.max_skipped: must be at least 1 with"),
        (["--training.z_loss_weight", "-1e-4"], "training.z_loss_weight: must be >= 0"),
        (["--training.spike_window", "1", "--training.max_skipped", "1"], "spike_window"),
    ],
)
def test_bad_settings_are_one_line_config_errors(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_config(args)
    assert len(str(error.value).splitlines()) == 1


def test_defaults_keep_every_tool_off() -> None:
    t = load_config([]).training
    assert (t.z_loss_weight, t.skip_spikes, t.max_skipped) == (0.0, [], 0)
    assert SpikeGuard.of(t) is None


# --- z-loss in training: direct value and parity (worker pool) -----------------------------------

STEPS = 6
Z_WEIGHT = "0.01"
TINY = (
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
    "--training.seq_len",
    "64",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--training.z_loss_weight",
    Z_WEIGHT,
)
RTOL = 1e-5
METRICS = ("loss", "grad_norm", "z_loss")


def curves(records: list[dict]) -> dict[str, list[float]]:
    train = [r for r in records if "kind" not in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    return {m: [r[m] for r in train] for m in METRICS}


@pytest.fixture(scope="module")
def z_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, global batch 8: the run's curves and the z-loss of step 1 by hand."""
    import stability_scenarios
    from pool import get_pool

    out = tmp_path_factory.mktemp("z_one") / "run"
    argv = [*TINY, "--training.local_batch_size", "8", "--job.dump_folder", str(out)]
    return get_pool(1).run(stability_scenarios.z_loss_by_hand, argv=argv)[0]


@pytest.mark.slow
def test_the_logged_z_loss_is_the_one_computed_from_the_logits(z_baseline: dict) -> None:
    z = curves(z_baseline["records"])["z_loss"]
    assert z[0] == pytest.approx(z_baseline["direct"], rel=1e-6)
    assert 0.1 < z[0] < 10 and len(set(z)) == STEPS  # a real, moving term
    assert z_baseline["info"]["world_size"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (
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
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "8",
                "--parallelism.pipeline_parallel_microbatch_size",
                "4",
            ],
        ),
    ],
    ids=["dp_shard=2xtp=2", "pp=2"],
)
def test_z_loss_matches_one_process(
    world: int, layout: list[str], z_baseline: dict, tmp_path: Path
) -> None:
    import train_scenarios
    from pool import get_pool

    from titanlite.metrics.compare import relative_difference

    argv = [*TINY, *layout, "--job.dump_folder", str(tmp_path / "run")]
    pool = get_pool(world)
    run = pool.run(train_scenarios.train, argv=argv)[0]
    if "--parallelism.tensor_parallel_degree" in layout:
        assert "loss parallel" in "\n".join(pool.last_logs[0]).lower()
    base, other = curves(z_baseline["records"]), curves(run["records"])
    worst = {
        m: max(relative_difference(a, b) for a, b in zip(base[m], other[m], strict=True))
        for m in METRICS
    }
    print(f"z-loss parity {layout}: max relative differences {worst}")
    assert all(d <= RTOL for d in worst.values()), worst


ROUTER_Z = (
    "--model.name",
    "qwen3_moe",
    "--model.n_layers",
    "2",
    "--model.dim",
    "64",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.head_dim",
    "16",
    "--model.moe_hidden_dim",
    "64",
    "--model.router_z_loss_coef",
    "0.01",
    "--training.seq_len",
    "32",
    "--training.steps",
    "4",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
)


@pytest.mark.slow
def test_router_z_loss_matches_one_process_on_sequence_shards(tmp_path: Path) -> None:
    """qwen3_moe with the router z-loss: tp=2 (each rank routes its shard of each sequence)
    against one process, 4 steps."""
    import train_scenarios
    from pool import get_pool

    from titanlite.metrics.compare import relative_difference

    runs = {}
    for world, extra in ((1, ()), (2, ("--parallelism.tensor_parallel_degree", "2"))):
        argv = [*ROUTER_Z, *extra, "--job.dump_folder", str(tmp_path / str(world))]
        runs[world] = train_records(
            get_pool(world).run(train_scenarios.train, argv=argv)[0]["records"]
        )
    keys = ("loss", "grad_norm", "moe_router_z_loss")
    worst = {
        k: max(relative_difference(runs[1][s][k], runs[2][s][k]) for s in runs[1]) for k in keys
    }
    print(f"router z-loss parity tp=2: max relative differences {worst}")
    assert sorted(runs[2]) == [1, 2, 3, 4] and runs[1][1]["moe_router_z_loss"] > 0
    assert all(d <= RTOL for d in worst.values()), worst


# --- skipped steps in training (worker pool) -----------------------------------------------------

SKIP_STEPS = 8
SPIKES = {4: "scale", 6: "scale", 7: "nan"}  # 6 and 7: two skips in a row, max_skipped 2
SKIP_ARGS = (
    *TINY,
    "--training.steps",
    str(SKIP_STEPS),
    "--training.local_batch_size",
    "4",
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--training.skip_spikes",
    "loss,grad_norm",
    "--training.spike_window",
    "3",
    "--training.max_skipped",
    "2",
    "--training.ema_decay",
    "0.9",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "4",
    "--checkpoint.keep_latest_k",
    "0",
)


def train_records(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "kind" not in r}


@pytest.fixture(scope="module")
def spiked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """8 steps on 2 ranks (FSDP) with gradient spikes injected at steps 4 and 6 and a NaN in
    rank 0's gradients at step 7; saves at steps 4 (a skipped step) and 8."""
    import stability_scenarios
    from pool import get_pool

    out = tmp_path_factory.mktemp("spiked") / "run"
    argv = [*SKIP_ARGS, "--job.dump_folder", str(out)]
    ranks = get_pool(2).run(
        stability_scenarios.train_with_spikes, argv=argv, spikes=SPIKES, watch=[3, 4, 5, 6, 7]
    )
    return out, ranks


@pytest.mark.slow
def test_a_spike_skips_the_update_on_every_rank_and_the_run_goes_on(spiked) -> None:
    _, ranks = spiked
    for rank in ranks:
        # Skipped steps leave parameters, optimizer state and the average of the weights
        # bit-identical; the others do not.
        assert rank["unchanged"] == {3: False, 4: True, 5: False, 6: True, 7: True}
        assert rank["schedule_steps"] == SKIP_STEPS  # the learning-rate schedule went on
        assert rank["optimizer_steps"] == [SKIP_STEPS - len(SPIKES)]  # AdamW's own count
    records = ranks[0]["records"]
    skips = [r for r in records if r.get("kind") == "skip"]
    assert [r["step"] for r in skips] == sorted(SPIKES)  # and no natural step was skipped
    assert "grad_norm" in skips[0]["reason"] and "sigma" in skips[0]["reason"]
    assert skips[2]["reason"] == "grad_norm is nan"  # rank 0's NaN, seen by both ranks
    train = train_records(records)
    assert sorted(train) == list(range(1, SKIP_STEPS + 1))
    assert [train[s]["skipped_steps"] for s in (3, 4, 8)] == [0, 1, 3]
    assert math.isfinite(train[8]["loss"]) and train[8]["loss"] < train[1]["loss"]


@pytest.mark.slow
def test_resume_across_skipped_steps_is_exact(spiked, tmp_path: Path) -> None:
    """Resumed from the save at step 4 (itself skipped), the run skips 6 (a spike only a full
    window, restored from the checkpoint, can tell) and 7 again, logs the same values and
    ends with the same average of the weights."""
    import stability_scenarios
    from pool import get_pool

    out, ranks = spiked
    again = tmp_path / "run"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("step-8"))
    argv = [*SKIP_ARGS, "--job.dump_folder", str(again)]
    resumed = get_pool(2).run(
        stability_scenarios.train_with_spikes, argv=argv, spikes=SPIKES, watch=[]
    )[0]
    lines = resumed["records"]
    after = lines[max(i for i, r in enumerate(lines) if r.get("kind") == "resume") + 1 :]
    assert [r["step"] for r in after if r.get("kind") == "skip"] == [6, 7]
    base = train_records(ranks[0]["records"])
    for step, record in train_records(after).items():
        for key in ("loss", "grad_norm", "z_loss", "lr", "skipped_steps", "tokens_seen"):
            assert repr(record[key]) == repr(base[step][key]), (step, key)  # bits; nan too
    assert sorted(train_records(after)) == [5, 6, 7, 8]
    averages = resumed["average"], ranks[0]["average"]  # training.ema_decay resumed too
    assert all(torch.equal(a, averages[1][name]) for name, a in averages[0].items())


@pytest.mark.slow
def test_more_skips_in_a_row_than_max_skipped_stop_the_run_with_status_3(tmp_path: Path) -> None:
    """A learning rate of 1e30 ruins the weights at the first update: from then on every
    loss is non-finite, each step is skipped, and the third in a row stops the run."""
    import train_scenarios
    from pool import get_pool

    from titanlite.metrics.jsonl import find_metrics_file, read_metrics

    out = tmp_path / "run"
    argv = [
        *TINY,
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.max_norm",
        "0",
        "--training.steps",
        "20",
        "--training.max_skipped",
        "2",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(out),
    ]
    pool = get_pool(1)
    assert pool.run(train_scenarios.main, argv=argv)[0] == 3
    last = pool.last_output[0].strip().splitlines()[-1]
    assert "3 steps in a row skipped, more than training.max_skipped 2" in last, last
    skips = read_metrics(find_metrics_file(out)).kind("skip")
    assert len(skips) == 2 and all(
        "is nan" in r["reason"] or "is inf" in r["reason"] for r in skips.values()
    )
