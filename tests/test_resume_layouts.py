"""Layouts meet checkpoints: every layout starts from bit-identical weights, a checkpoint
saved under one layout resumes under another (every family), RNG state is per rank, and a
resume skips initializing the weights it is about to overwrite.

All runs use titanlite's Trainer on a reused worker pool (tests/pool.py); the launcher paths
(signals, kills, exit statuses) are covered by test_checkpoint.py through real processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import train_scenarios
from pool import get_pool

from titanlite.checkpoint.safe_reader import SafeFileSystemReader

pytestmark = pytest.mark.slow

STEPS = 12
SMALL = [
    "--training.steps",
    str(STEPS),
    "--checkpoint.interval",
    "4",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--training.seq_len",
    "64",
    "--model.n_layers",
    "2",
]
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
# Global batch 4 sequences in every layout.
LAYOUTS = {
    "1proc": (1, ["--training.local_batch_size", "4"]),
    "dp_shard2": (2, ["--training.local_batch_size", "2"]),
    "dp_shard2_tp2": (
        4,
        ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"],
    ),
    "dp_replicate4": (
        4,
        [
            "--training.local_batch_size",
            "1",
            "--parallelism.data_parallel_replicate_degree",
            "4",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
    "dp_replicate2_tp2": (
        4,
        [
            "--training.local_batch_size",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    ),
    # Context parallelism: each sequence split over 2 ranks (alone: DDP over them; with
    # dp_shard: FSDP over dp_shard x cp).
    "cp2": (2, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2"]),
    "cp2_dp_shard2": (
        4,
        ["--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2"],
    ),
    "ep2": (2, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]),
    "tp2": (2, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (
        2,
        [
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
    ),
}
RTOL = 1e-5


def train(out: Path, layout: str, *args: str) -> tuple[dict[int, float], list[str], list[dict]]:
    """(loss of the last record of each step, rank 0's log lines, every record)."""
    world, layout_args = LAYOUTS[layout]
    pool = get_pool(world)
    run = pool.run(
        train_scenarios.train, argv=[*SMALL, "--job.dump_folder", str(out), *layout_args, *args]
    )[0]
    losses = {r["step"]: r["loss"] for r in run["records"] if "loss" in r}
    return losses, pool.last_logs[0], run["records"]


def steps_after_resume(records: list[dict]) -> list[int]:
    starts = [i for i, r in enumerate(records) if r.get("kind") == "resume"]
    return [r["step"] for r in records[starts[-1] + 1 :] if "loss" in r]


def assert_close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        a, b = want[step], got[step]
        assert abs(a - b) <= RTOL * abs(a), f"step {step}: {a!r} vs {b!r} (rtol {RTOL})"


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Per family: 12 uninterrupted steps in one process, checkpoints every 4."""
    result = {}
    for family, extra in (("llama3", []), ("qwen3", QWEN3)):
        out = tmp_path_factory.mktemp(f"baseline_{family}") / "run"
        losses, _, _ = train(out, "1proc", *extra)
        assert sorted(losses) == list(range(1, STEPS + 1))
        result[family] = (out, losses)
    return result


@pytest.fixture(scope="module")
def one_process_weights() -> dict[str, dict[str, torch.Tensor]]:
    """Per family, the initial weights of one process (gathered once, on first use)."""
    return {}


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize(
    "layout", ["dp_shard2", "dp_shard2_tp2", "dp_replicate2_tp2", "cp2_dp_shard2"]
)
def test_every_layout_starts_from_the_same_weights(
    family: str, layout: str, one_process_weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    extra = QWEN3 if family == "qwen3" else []
    world, layout_args = LAYOUTS[layout]
    if family not in one_process_weights:
        one_process_weights[family] = get_pool(1).run(
            train_scenarios.initial_weights, argv=[*SMALL, *extra]
        )[0]
    one = one_process_weights[family]
    many = get_pool(world).run(
        train_scenarios.initial_weights, argv=[*SMALL, *extra, *layout_args]
    )[0]
    assert one.keys() == many.keys()
    for name, value in one.items():
        assert torch.equal(value, many[name]), f"{family} {layout}: {name} differs"


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("llama3", "dp_shard2_tp2"),
        ("llama3", "dp_replicate4"),
        ("qwen3", "dp_shard2_tp2"),
        ("llama3", "cp2_dp_shard2"),
    ],
)
def test_one_process_checkpoint_resumes_on_4_ranks(
    tmp_path: Path, baselines: dict, family: str, layout: str
) -> None:
    base_run, base = baselines[family]
    out = tmp_path / "run"
    shutil.copytree(base_run / "checkpoint" / "step-8", out / "checkpoint" / "step-8")
    extra = QWEN3 if family == "qwen3" else []
    losses, logs, records = train(out, layout, *extra)
    assert any("resumed from" in line and "step 8" in line for line in logs), logs
    # The weights come from the checkpoint: initializing them first would be wasted work.
    assert any("weights left to the checkpoint" in line for line in logs), logs
    assert steps_after_resume(records) == list(range(9, STEPS + 1))
    assert_close(losses, base, range(9, STEPS + 1))


@pytest.mark.parametrize(
    ("family", "layout"), [("llama3", "dp_shard2"), ("qwen3", "dp_shard2"), ("qwen3", "cp2")]
)
def test_two_rank_checkpoint_resumes_in_one_process(
    tmp_path: Path, baselines: dict, family: str, layout: str
) -> None:
    _, base = baselines[family]
    extra = QWEN3 if family == "qwen3" else []
    two = tmp_path / "two"
    losses_two, _, _ = train(two, layout, *extra)
    assert_close(losses_two, base, range(1, STEPS + 1))
    # Each rank saved its own RNG state under its own key.
    saved = SafeFileSystemReader(str(two / "checkpoint" / "step-8")).read_metadata()
    rng_keys = sorted(k for k in saved.state_dict_metadata if k.startswith("rng."))
    assert rng_keys == ["rng.rank0.cpu", "rng.rank1.cpu"]
    out = tmp_path / "one"
    shutil.copytree(two / "checkpoint" / "step-8", out / "checkpoint" / "step-8")
    losses, _, records = train(out, "1proc", *extra)
    assert steps_after_resume(records) == list(range(9, STEPS + 1))
    assert_close(losses, losses_two, range(9, STEPS + 1))
    assert_close(losses, base, range(9, STEPS + 1))


def test_resume_restores_each_ranks_rng_state(tmp_path: Path) -> None:
    """Each rank gets its own generator state back: after a resume, every rank draws what it
    would have drawn next in the run that saved."""
    argv = [*SMALL, "--job.dump_folder", str(tmp_path / "run"), *LAYOUTS["dp_shard2"][1]]
    pool = get_pool(2)
    expected = pool.run(
        train_scenarios.train_with_rank_seeds, argv=[*argv, "--training.steps", "4"]
    )
    assert expected[0] != expected[1]
    resumed = pool.run(train_scenarios.rng_after_resume, argv=[*argv, "--training.steps", "4"])
    assert resumed == expected


# The newest families on the shapes of their parity tests (tests/test_gpt_oss.py,
# tests/test_qwen3_5.py), 8 steps of 32 tokens: gpt-oss's windowed and full layers with sinks,
# YaRN and 4 biased experts (top-2, the balancing loss on); Qwen3.5's three Gated DeltaNet
# layers and one gated full-attention layer (tied embeddings).
NEW_FAMILIES = {
    "gpt_oss": [
        "--model.name",
        "gpt_oss",
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
        "--model.num_experts",
        "4",
        "--model.top_k",
        "2",
        "--model.moe_hidden_dim",
        "32",
        "--model.sliding_window",
        "8",
        "--model.aux_loss_coef",
        "0.01",
    ],
    "qwen3_5": [
        "--model.name",
        "qwen3_5",
        "--model.dim",
        "64",
        "--model.n_layers",
        "4",
        "--model.n_heads",
        "4",
        "--model.n_kv_heads",
        "2",
        "--model.head_dim",
        "16",
        "--model.hidden_dim",
        "96",
        "--model.linear_k_heads",
        "2",
        "--model.linear_v_heads",
        "4",
        "--model.linear_k_dim",
        "8",
        "--model.linear_v_dim",
        "8",
        "--model.chunk_size",
        "16",
    ],
}
SHORT = ["--training.steps", "8", "--training.seq_len", "32"]
STOP_AT = 4
DEGREES = {"ep2": {"dp_shard": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}}


def degrees_above_1(folder: Path) -> dict[str, int]:
    """The mesh degrees of the run that last wrote ``folder``'s run.json, 1s left out."""
    degrees = train_scenarios.read_run(folder)["info"]["parallel_degrees"]
    return {name: size for name, size in degrees.items() if size > 1}


def data_position(logs: list[str]) -> str:
    """The loader's last words: how many windows the run consumed, in which epoch."""
    return [line.split("data: ", 1)[1] for line in logs if "windows consumed" in line][-1]


@pytest.mark.parametrize(
    ("family", "saved_on", "resumed_on"),
    [("gpt_oss", "ep2", "pp2"), ("qwen3_5", "pp2", "tp2")],
)
def test_run_stopped_on_one_layout_resumes_on_another(
    tmp_path: Path, family: str, saved_on: str, resumed_on: str
) -> None:
    """Preempted at step 4 on one layout (the checkpoint sharded that way), resumed on
    another: every step as the uninterrupted one-process run (loss within RTOL, the same
    tokens seen) and the same data position at the end. gpt-oss: saved with ep 2 (experts and
    their biases split by expert over dp_shard 2), resumed on two pipeline stages (a layer's
    whole experts on each). Qwen3.5: saved on two pipeline stages, resumed with tp 2 (both
    layer kinds split by heads, the DeltaNet convolution taps and decays by channel). Two
    ranks each: on 2 CPU cores a four-rank save took about twice as long."""
    model = [*NEW_FAMILIES[family], *SHORT]
    one = tmp_path / "one"
    base, base_logs, base_records = train(one, "1proc", *model, "--checkpoint.enable", "false")
    assert len(set(base.values())) == 8  # every step a new batch: a repeated one would pass
    out = tmp_path / "run"
    world, layout_args = LAYOUTS[saved_on]
    argv = [*SMALL, "--job.dump_folder", str(out), *layout_args, *model]
    pool = get_pool(world)
    stopped = pool.run(train_scenarios.train_until_preempted, argv=argv, stop_at=STOP_AT)
    assert stopped[0] == f"stopped at step {STOP_AT} on signal 15; checkpoint saved"
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [f"step-{STOP_AT}"]
    saved_logs, saved_degrees = pool.last_logs[0], degrees_above_1(out)
    losses, logs, records = train(out, resumed_on, *model)
    assert [saved_degrees, degrees_above_1(out)] == [DEGREES[saved_on], DEGREES[resumed_on]]
    if saved_on == "ep2":  # not a mesh degree: ep is a view of dp_shard
        assert any("split over ep=2 ranks" in line for line in saved_logs), saved_logs
    assert any(f"step-{STOP_AT} (step {STOP_AT})" in line for line in logs), logs
    assert any("weights left to the checkpoint" in line for line in logs), logs
    assert steps_after_resume(records) == list(range(STOP_AT + 1, 9))
    assert_close(losses, base, range(1, 9))  # steps 1-4 stopped, 5-8 resumed: one metrics file
    tokens = {r["step"]: r["tokens_seen"] for r in records if "loss" in r}
    assert tokens == {r["step"]: r["tokens_seen"] for r in base_records if "loss" in r}
    assert data_position(logs) == data_position(base_logs)
    worst = max(abs(losses[s] - base[s]) / abs(base[s]) for s in range(1, 9))
    print(f"{family} {saved_on} -> {resumed_on}: loss within {worst:.1e} of one process")
