"""Numerics parity: every parallel layout trains like one process, for every model family.

Each test trains a tiny model (Llama 3 and Qwen3) for a few steps with titanlite's Trainer on
the ranks of a reused worker pool (tests/pool.py: real gloo processes) and compares its loss
and gradient norm at every step with a 1-process fp32 run on the same global batch of 8
sequences. Data parallelism, tensor parallelism, gradient accumulation, activation
checkpointing and torch.compile change how the work is split or scheduled, never the
mathematics, so they must agree to float32 round-off (RTOL). bf16 mixed precision changes the
arithmetic itself and gets its own, documented tolerance (BF16_RTOL).

The largest relative differences measured are written to parity_summary.json in pytest's base
temporary folder (e.g. `pytest tests/test_parity.py --basetemp=/tmp/parity`); a failing test
prints them with a step-by-step table. docs/parity.md shows a recent table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import train_scenarios
from pool import get_pool

from titanlite.metrics.compare import relative_difference

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("eight_rank_pool_stops_with_the_module")]


STEPS = 10
GLOBAL_BATCH = 8
METRICS = ("loss", "grad_norm")
# fp32 layouts differ from one process only in the order of floating-point sums: a few float32
# units in the last place (1.2e-7 relative near a loss of 8.3), well inside 1e-6.
RTOL = 1e-6
# bf16 parameters and activations (FSDP MixedPrecisionPolicy, fp32 gradient reduction) against
# the fp32 baseline. Measured over the 10 steps (2026-12-02, CPU): 2.9e-4 on the loss, 2.9e-3
# on the grad norm; the bounds leave a margin of ~17x for other seeds and platforms and still
# catch real bugs (a wrong loss scale or a dropped micro-batch is off by > 1e-2).
BF16_RTOL = {"loss": 5e-3, "grad_norm": 5e-2}
COMMON = (
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
)
# Heads divisible by 4 so that the same model (and baseline) serves tp=4.
FAMILIES = {
    "llama3": (
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
    ),
    # Its own head size (4 x 24 != dim 64), q/k norms and tied embeddings.
    "qwen3": (
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel",
        "--model.dim",
        "64",
        "--model.n_layers",
        "2",
        "--model.n_heads",
        "4",
        "--model.n_kv_heads",
        "4",
        "--model.head_dim",
        "24",
        "--model.hidden_dim",
        "96",
    ),
}

Curves = dict[str, list[float]]

# Largest relative difference to the baseline per run and metric, for parity_summary.json.
MEASURED: dict[str, dict[str, float]] = {}


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one run; the global batch is always GLOBAL_BATCH sequences."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def ngpu(self) -> int:
        return self.replicate * self.shard * self.cp * self.tp

    @property
    def name(self) -> str:
        degrees = {
            "dp_replicate": self.replicate,
            "dp_shard": self.shard,
            "cp": self.cp,
            "tp": self.tp,
        }
        parts = [f"{dim}={degree}" for dim, degree in degrees.items() if degree > 1]
        return " x ".join(parts) or "1 process"

    def args(self) -> list[str]:
        local_batch = GLOBAL_BATCH // (self.replicate * self.shard)
        return [
            "--parallelism.data_parallel_replicate_degree",
            str(self.replicate),
            "--parallelism.data_parallel_shard_degree",
            str(self.shard),
            "--parallelism.tensor_parallel_degree",
            str(self.tp),
            "--parallelism.context_parallel_degree",
            str(self.cp),
            "--training.local_batch_size",
            str(local_batch),
        ]


LAYOUTS = [
    Layout(replicate=4),
    Layout(shard=4),
    Layout(replicate=2, shard=2),
    Layout(tp=2),
    Layout(tp=4),
    Layout(replicate=2, tp=2),
    Layout(shard=2, tp=2),
    Layout(replicate=2, shard=2, tp=2),
]
# Context parallelism (each of the 8 sequences split over the cp ranks), alone and composed
# with sequence-parallel TP, FSDP (over dp_shard x cp) and titanlite's DDP (over
# dp_replicate x cp); Qwen3 (q/k norms, rotate-half RoPE) under FSDP over dp_shard x cp.
CP_LAYOUTS = [
    ("llama3", Layout(cp=2)),
    ("llama3", Layout(cp=4)),
    ("llama3", Layout(cp=2, tp=2)),
    ("llama3", Layout(shard=2, cp=2)),
    ("llama3", Layout(replicate=2, cp=2)),
    ("qwen3", Layout(shard=2, cp=2)),
]


@dataclass(frozen=True)
class Run:
    curves: Curves
    info: dict
    output: str


def train(
    tmp_path_factory: pytest.TempPathFactory, name: str, family: str, *args: str, ngpu: int = 1
) -> Run:
    """A tiny training run on ``ngpu`` pool ranks; fails the test unless it logs every step."""
    folder = tmp_path_factory.mktemp(name.replace(" ", "").replace("=", ""))
    argv = [*FAMILIES[family], *COMMON, "--job.dump_folder", str(folder / "run"), *args]
    pool = get_pool(ngpu)
    run = pool.run(train_scenarios.train, argv=argv)[0]
    records = run["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
    curves = {m: [float(r[m]) for r in records] for m in METRICS}
    assert run["info"]["model_name"] == family
    return Run(curves, run["info"], "\n".join(pool.last_logs[0]))


def max_relative_differences(name: str, base: Curves, other: Curves) -> dict[str, float]:
    """Largest relative difference per metric over all steps; also recorded in MEASURED."""
    worst = {
        m: max(relative_difference(a, b) for a, b in zip(base[m], other[m], strict=True))
        for m in METRICS
    }
    MEASURED[name] = worst
    return worst


def assert_parity(name: str, base: Curves, other: Curves, rtol: float = RTOL) -> None:
    worst = max_relative_differences(name, base, other)
    table = "\n".join(
        f"  step {i + 1:2d}  loss {base['loss'][i]:.8g} vs {other['loss'][i]:.8g}  "
        f"grad_norm {base['grad_norm'][i]:.8g} vs {other['grad_norm'][i]:.8g}"
        for i in range(STEPS)
    )
    assert all(d <= rtol for d in worst.values()), (
        f"{name} differs from 1 process: max relative difference {worst} > {rtol}\n{table}"
    )


@pytest.fixture(scope="module", autouse=True)
def parity_summary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Writes what the module measured to <pytest base temp>/parity_summary.json."""
    path = tmp_path_factory.getbasetemp() / "parity_summary.json"
    yield path
    if MEASURED:
        summary = {
            "steps": STEPS,
            "global_batch": GLOBAL_BATCH,
            "rtol": RTOL,
            "bf16_rtol": BF16_RTOL,
            "max_rel_diff": MEASURED,
        }
        path.write_text(json.dumps(summary, indent=2) + "\n")


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Curves]:
    """Per family: one process, fp32, eager, global batch GLOBAL_BATCH in one micro-batch."""
    curves = {}
    for family in FAMILIES:
        run = train(tmp_path_factory, f"baseline {family}", family, *Layout().args())
        assert run.info["world_size"] == 1 and run.info["gradient_accumulation_steps"] == 1
        # A run that repeated one batch or logged a constant would make every comparison easy.
        assert len(set(run.curves["loss"])) == STEPS
        curves[family] = run.curves
    # The two families really are different models.
    assert curves["llama3"]["loss"] != curves["qwen3"]["loss"]
    return curves


@pytest.fixture(scope="module")
def baseline(baselines: dict[str, Curves]) -> Curves:
    return baselines["llama3"]


# Every layout for Llama; for Qwen3 the three that between them meet each mesh dimension:
# its own pieces (q/k norms, tied embeddings, its head size) under FSDP with replicas, under
# the deepest tensor split and under FSDP x TP. The other layouts only recombine those
# dimensions, which Llama's runs check.
QWEN3_LAYOUTS = {Layout(replicate=2, shard=2), Layout(tp=4), Layout(shard=2, tp=2)}
FAMILY_LAYOUTS = [
    (layout, family)
    for layout in LAYOUTS
    for family in FAMILIES
    if family == "llama3" or layout in QWEN3_LAYOUTS
]


@pytest.mark.parametrize(
    ("layout", "family"),
    FAMILY_LAYOUTS,
    ids=[f"{lay.name.replace(' ', '')}-{fam}" for lay, fam in FAMILY_LAYOUTS],
)
def test_layout_matches_one_process(
    layout: Layout,
    family: str,
    baselines: dict[str, Curves],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    check_layout(layout, family, baselines, tmp_path_factory)


@pytest.mark.parametrize(
    ("family", "layout"),
    CP_LAYOUTS,
    ids=[f"{f}-{lay.name.replace(' ', '')}" for f, lay in CP_LAYOUTS],
)
def test_context_parallel_layout_matches_one_process(
    family: str,
    layout: Layout,
    baselines: dict[str, Curves],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    output = check_layout(layout, family, baselines, tmp_path_factory)
    assert f"keys and values all-gathered over cp={layout.cp}" in output


def check_layout(
    layout: Layout,
    family: str,
    baselines: dict[str, Curves],
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """Train ``layout`` and assert its degrees, global batch and parity; rank 0's log."""
    name = f"{family} {layout.name}"
    run = train(tmp_path_factory, name, family, *layout.args(), ngpu=layout.ngpu)
    expected = {
        "pp": 1,
        "dp_replicate": layout.replicate,
        "dp_shard": layout.shard,
        "cp": layout.cp,
        "tp": layout.tp,
    }
    assert run.info["parallel_degrees"] == expected
    assert run.info["global_batch_size"] == GLOBAL_BATCH
    assert_parity(name, baselines[family], run.curves)
    return run.output


@pytest.mark.parametrize(
    "layout", [Layout(), Layout(replicate=2), Layout(shard=2)], ids=["1proc", "ddp2", "fsdp2"]
)
def test_gradient_accumulation_matches_one_batch(
    layout: Layout, baseline: Curves, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two micro-batches per rank (global batch = 2 x local x dp) make the same step as one
    batch of 8: no_sync (DDP) and deferred reduce-scatter (FSDP) skip the first one's
    communication without changing the sum."""
    name = f"accumulation 2 x micro-batches, {layout.name}"
    dp = layout.replicate * layout.shard
    local = GLOBAL_BATCH // (2 * dp)
    run = train(
        tmp_path_factory,
        name,
        "llama3",
        *layout.args(),
        "--training.local_batch_size",
        str(local),
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
        ngpu=layout.ngpu,
    )
    assert run.info["gradient_accumulation_steps"] == 2
    assert_parity(name, baseline, run.curves)


@pytest.mark.parametrize(
    ("mode", "option", "applied"),
    [
        ("full", "2", "applied full activation checkpointing"),
        ("selective", "op", "applied selective (op) activation checkpointing"),
    ],
    ids=["full", "selective_op"],
)
def test_activation_checkpointing_matches_no_checkpointing(
    mode: str,
    option: str,
    applied: str,
    baseline: Curves,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    name = f"activation checkpointing {mode}" + (f" ({option})" if mode == "selective" else "")
    run = train(
        tmp_path_factory,
        name,
        "llama3",
        "--activation_checkpoint.mode",
        mode,
        "--activation_checkpoint.selective_ac_option",
        option,
    )
    assert applied in run.output  # otherwise this compares the baseline with itself
    assert_parity(name, baseline, run.curves)


def test_compile_matches_eager(baseline: Curves, tmp_path_factory: pytest.TempPathFactory) -> None:
    name = "torch.compile"
    run = train(tmp_path_factory, name, "llama3", "--compile.enable")
    assert "with torch.compile" in run.output
    assert_parity(name, baseline, run.curves)


def test_bf16_fsdp_stays_close_to_fp32(
    baseline: Curves, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """bf16 changes the arithmetic: close to fp32, measurably not equal to it."""
    name = "bf16 dp_shard=2"
    layout = Layout(shard=2)
    run = train(
        tmp_path_factory,
        name,
        "llama3",
        *layout.args(),
        "--training.mixed_precision_param",
        "bfloat16",
        ngpu=layout.ngpu,
    )
    assert run.info["train_dtype"] == "bfloat16"
    worst = max_relative_differences(name, baseline, run.curves)
    assert all(worst[m] <= BF16_RTOL[m] for m in METRICS), (worst, BF16_RTOL)
    # If bf16 matched fp32 to RTOL, it would not be running in bf16 (and RTOL would be too
    # loose to tell the two apart).
    assert worst["grad_norm"] > RTOL, worst


# Sliding window (every other layer local, 24 of the 64 tokens: across the 16-token chunks of
# cp 2) with sinks (split with the heads under TP) and document masking, against its own
# one-process baseline.
ATTENTION_VARIANTS = (
    "--model.sliding_window",
    "24",
    "--model.window_pattern",
    "LG",
    "--model.attention_sinks",
    "true",
    "--training.document_mask",
    "true",
)


@pytest.fixture(scope="module")
def variants_baseline(tmp_path_factory: pytest.TempPathFactory) -> Curves:
    run = train(
        tmp_path_factory,
        "baseline llama3 window+sinks",
        "llama3",
        *ATTENTION_VARIANTS,
        *Layout().args(),
    )
    assert "2 of 2 layers (1 with a sliding window of 24, 1 full, with sinks) run" in run.output
    assert len(set(run.curves["loss"])) == STEPS
    return run.curves


# cp 2 only: the same variants under dp_shard 2 x tp 2 (sinks split with the heads) are
# gpt-oss's own parity layout (tests/test_gpt_oss.py), which has windows and sinks too.
@pytest.mark.parametrize("layout", [Layout(cp=2)], ids=["cp2"])
def test_window_and_sinks_match_one_process(
    layout: Layout, variants_baseline: Curves, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"llama3 window+sinks {layout.name}"
    run = train(
        tmp_path_factory, name, "llama3", *ATTENTION_VARIANTS, *layout.args(), ngpu=layout.ngpu
    )
    # The windowed layer's keys travel by the window exchange, not the whole gather: 24 - 1
    # keys before a 16-token chunk reach two chunks back (context.WindowExchange).
    assert (
        "1 layer(s) with a window of 24 receive only the keys and values their windows reach: "
        "at most 23 tokens per rank and layer instead of 32" in run.output
    ), run.output
    assert_parity(name, variants_baseline, run.curves)
