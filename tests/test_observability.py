"""What a user sees of a run besides the loss: profiler traces, TensorBoard scalars, the
start-up breakdown, the benchmark scripts, and how fast the launcher's checks start."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, run_train, subprocess_env
from torch import nn

from titanlite.config import ConfigError, load_config
from titanlite.metrics import memory_timeline
from titanlite.metrics.profiling import Profiler


def _profile(tmp_path: Path, first_step: int, last_step: int, *args: str) -> list[str]:
    """Drive a Profiler as the training loop does; the trace folders it wrote."""
    cfg = load_config(["--profiling.enable_profiling", *args])
    profiler = Profiler(cfg.profiling, tmp_path, rank=0, first_step=first_step)
    a = torch.randn(64, 64)
    for _ in range(first_step, last_step + 1):
        a = torch.tanh(a @ a)
        profiler.step()
    profiler.close()
    folder = tmp_path / "profile_traces"
    names = [p.name for p in folder.iterdir()] if folder.exists() else []
    return sorted(names, key=lambda name: int(name.removeprefix("iteration_")))


def test_profiler_traces_every_freq_steps(tmp_path: Path) -> None:
    written = _profile(tmp_path, 1, 9, "--profiling.profile_freq", "4")
    assert written == ["iteration_4", "iteration_8"]
    trace = json.loads((tmp_path / "profile_traces/iteration_8/rank0_trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names


def test_resumed_profiler_traces_the_same_global_steps(tmp_path: Path) -> None:
    """A run resumed at step 7 profiles 8 and 12, as the uninterrupted run would; step 7
    alone is the warm-up of step 8."""
    written = _profile(tmp_path, 7, 13, "--profiling.profile_freq", "4")
    assert written == ["iteration_8", "iteration_12"]


class Widening(nn.Module):
    """A stand-in model whose forward keeps two activations of 64 MiB each for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(16 * 2**20).clone() * self.w  # the clone and the output: 128 MiB


def test_memory_timeline_gives_each_phase_its_own_peak(tmp_path: Path) -> None:
    """On a CPU, enable_memory_snapshot records the peak resident memory of each phase of
    every profile_freq-th step: the forward's activations show in the forward and not in
    the optimizer's step, the loss's temporary in the loss phase."""
    if torch.cuda.is_available() or not memory_timeline.available():
        pytest.skip("the CPU timeline needs Linux's /proc")
    cfg = load_config(["--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"])
    model = Widening()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = Profiler(cfg.profiling, tmp_path, rank=0, first_step=1)
    profiler.watch([model], [optimizer])
    # The phases' sizes are differences of this process's resident memory: the garbage of
    # earlier tests in this pytest worker, collected in the middle of a phase, once took
    # 64 MiB off one (2 of 7 runs of the fast subset on two workers). Collected first, and
    # the collector kept out of the steps.
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            out = model(torch.ones(1))
            loss = (out.exp() - 1).sum()  # the loss's own 64 MiB temporary (and its gradient)
            del out
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                model(torch.ones(1))  # validation: outside the phases, after the step
            profiler.step()
    finally:
        gc.enable()
    profiler.close()
    folder = tmp_path / "memory_snapshot"
    assert sorted(p.name for p in folder.iterdir()) == ["iteration_2", "iteration_4"]
    record = json.loads((folder / "iteration_4/rank0_memory_timeline.json").read_text())
    phases = {e["phase"]: e for e in record["phases"]}
    assert [e["phase"] for e in record["phases"]] == list(memory_timeline.PHASES)
    mib = 2**20
    forward, loss = phases["forward"], phases["loss"]
    assert forward["rss_end_bytes"] - forward["rss_start_bytes"] >= 120 * mib, forward
    assert loss["peak_bytes"] - loss["rss_start_bytes"] >= 60 * mib, loss
    assert phases["optimizer"]["peak_bytes"] <= forward["rss_end_bytes"] - 120 * mib, phases
    # the validation forward (no gradients) counts in after_step, not as a forward
    assert phases["after_step"]["peak_bytes"] - phases["after_step"]["rss_start_bytes"] >= 120 * mib
    assert record["peak_bytes"]["loss"] == loss["peak_bytes"] >= forward["rss_end_bytes"]
    # the resets leave the process's own peak (the logged mem_peak_gib) intact
    assert memory_timeline.process_peak() >= max(e["peak_bytes"] for e in record["phases"])


def test_profile_freq_below_two_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"profiling.profile_freq: must be at least 2"):
        load_config(["--profiling.profile_freq", "1"])


def test_tensorboard_without_the_package_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ConfigError, match=r"metrics.enable_tensorboard.*pip install"):
        load_config(["--metrics.enable_tensorboard"])


def test_preflight_checks_without_importing_torch(tmp_path: Path) -> None:
    """The launcher's checks run before every launch: they must not pay for import torch."""
    code = (
        "import sys\n"
        "from titanlite import preflight\n"
        "status = preflight.main(['--job.config_file', 'train_configs/debug_model.toml'])\n"
        "print(status, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: scripts/gpu_check.sh would run the benchmark")
    result = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh")],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); "
        "run it on a GPU machine"
    ]


@pytest.mark.slow
def test_run_writes_traces_tensorboard_and_startup(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = run_train(
        tmp_path,
        "--job.dump_folder",
        str(out),
        "--training.steps",
        "6",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "false",
        "--validation.freq",
        "3",
        "--validation.steps",
        "1",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "3",
        "--profiling.enable_memory_snapshot",
        "--metrics.enable_tensorboard",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    train, val = read_metrics(out)

    traces = sorted(p.relative_to(out).as_posix() for p in out.glob("profile_traces/*/*"))
    assert traces == [
        "profile_traces/iteration_3/rank0_trace.json",
        "profile_traces/iteration_6/rank0_trace.json",
    ]
    events = json.loads((out / traces[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    if not torch.cuda.is_available() and memory_timeline.available():  # the memory per phase
        for step in (3, 6):
            timeline = out / f"memory_snapshot/iteration_{step}/rank0_memory_timeline.json"
            phases = [e["phase"] for e in json.loads(timeline.read_text())["phases"]]
            assert phases == list(memory_timeline.PHASES), phases
        assert "memory of step 6 (rank 0): peak" in result.stderr + result.stdout

    # TensorBoard holds the same numbers as metrics.jsonl.
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in loss] == [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for (_, logged), record in zip(loss, train, strict=True):
        assert math.isclose(logged, record["loss"], rel_tol=1e-6)
    val_loss = [(e.step, e.value) for e in acc.Scalars("validation/val_loss")]
    assert [s for s, _ in val_loss] == [r["step"] for r in val] == [3, 6]

    # The first step's record says where the start-up time went, from the launch on.
    first = train[0]
    phases = first["startup_phases_s"]
    assert {"launcher", "imports", "data", "model", "optimizer", "first_step"} <= phases.keys()
    assert all(v >= 0 for v in phases.values())
    assert math.isclose(sum(phases.values()), first["startup_s"], abs_tol=0.01)
    assert all("startup_s" not in r for r in train[1:])
    assert "startup: first step done" in result.stderr + result.stdout


@pytest.mark.slow
def test_bench_script_compares_with_the_reference(tmp_path: Path) -> None:
    """scripts/bench.py end to end at toy size: both sides ran and the numbers are sane. On
    one core (--cores 1: one intra-op thread in each of its processes), as every process the
    suite starts: with two threads each, the same run took 24.6 s of CPU instead of 17.4 s
    (alone; more beside the other tests' processes)."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench.py"),
            "--flavors",
            "debugmodel",
            "--cases",
            "1p-eager-fp32",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--seq-len",
            "32",
            "--bf16-flavors",
            "--sections",
            "throughput",
            "data",
            "--data-seconds",
            "0.5",
            "--cores",
            "1",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["peaks"]["float32"] > 1e8
    (row,) = report["throughput"]
    assert row["titanlite_tps"] > 0 and row["reference_tps"] > 0
    assert math.isclose(row["ratio"], row["titanlite_tps"] / row["reference_tps"])
    assert row["steps_measured"] == 2
    (data,) = report["data"]
    assert data["supply"] > data["demand"] > 0
    assert "| debugmodel | 1p-eager-fp32 |" in result.stdout
