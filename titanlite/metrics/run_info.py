"""What a run reports about itself: run.json, the start-up breakdown, and each logged step
(loss, throughput, MFU, memory) for the console, metrics.jsonl and wandb."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from titanlite import IMPORT_STARTED
from titanlite.config.job_config import JobConfig
from titanlite.config.layout import MESH_DIMS, Degrees
from titanlite.config.schema import sections
from titanlite.metrics.loggers import (
    MetricsLogger,
    cuda_memory_stats,
    device_name,
    forget_peak_flops,
    format_duration,
    memory_peak_gib,
    peak_cache_file,
    peak_flops,
)
from titanlite.optim.groups import ParamGroup

logger = logging.getLogger("titanlite.train")


class StartupClock:
    """Wall-clock seconds of each start-up phase, from the launch of ./run_train.sh (its
    TITANLITE_LAUNCH_TIME) to the end of the first step: where a slow start goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = IMPORT_STARTED
        launched = os.environ.get("TITANLITE_LAUNCH_TIME")
        if launched:
            with contextlib.suppress(ValueError):
                self.seconds["launcher"] = max(IMPORT_STARTED - float(launched), 0.0)
        self.mark("imports")

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        return f"startup: first step done {sum(self.seconds.values()):.1f} s after launch ({parts})"


@dataclass
class Throughput:
    """What MFU needs: FLOPs per token and the device's peak FLOP/s (which the step logger
    may measure again, see ``StepLogger._checked_mfu``)."""

    flops_per_token: float
    """At training.seq_len."""
    device: torch.device
    train_dtype: torch.dtype
    peak_flops: float
    peak_source: str
    flops_at: Callable[[int], float] | None = None
    """FLOPs per token of sequences of a given length (attention grows with it): a
    sequence-length warmup's shorter steps cost less per token."""

    @classmethod
    def of(
        cls,
        flops_at: Callable[[int], float],
        seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Throughput:
        """With the device's peak from the table of known GPUs, else measured (cached)."""
        return cls(flops_at(seq_len), device, dtype, *peak_flops(device, dtype), flops_at)


@dataclass
class RunFacts:
    """What run.json says a run is (gathered by the trainer at start-up)."""

    model_name: str
    flavor: str
    num_params: int
    active_params: int
    world_size: int
    degrees: Degrees
    global_batch_size: int
    gradient_accumulation_steps: int
    seq_len: int
    throughput: Throughput
    model_args: dict[str, Any]
    tokenizer: str
    init: dict[str, float]
    optimizer_groups: list[ParamGroup] = field(default_factory=list)
    converters: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: Any, model_name: str, model_args: Any, **facts: Any) -> RunFacts:
        """The facts the config and the model's arguments give, and ``facts``."""
        return cls(
            model_name=model_name,
            flavor=cfg.model.flavor,
            seq_len=cfg.training.seq_len,
            model_args=asdict(model_args),
            converters=list(cfg.model.converters),
            **facts,
        )

    def as_json(self) -> dict[str, Any]:
        t = self.throughput
        return {
            "model_name": self.model_name,
            "num_params": self.num_params,
            "active_params": self.active_params,
            "flops_per_token": t.flops_per_token,
            "world_size": self.world_size,
            "parallel_degrees": {dim: self.degrees.of(dim) for dim in MESH_DIMS},
            "global_batch_size": self.global_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "device": str(t.device),
            "device_name": device_name(t.device),
            "train_dtype": str(t.train_dtype).removeprefix("torch."),
            "peak_flops_per_device": t.peak_flops,
            "peak_flops_source": t.peak_source,
            "vocab_size": self.model_args["vocab_size"],
            "tokenizer": self.tokenizer,
            "model_args": self.model_args,
            "init": self.init,
            "optimizer_groups": [g.describe() for g in self.optimizer_groups],
            "converters": self.converters,
            "torch_version": torch.__version__,
        }


def write_run_files(dump_folder: Path, config_toml: str, facts: RunFacts) -> None:
    """config.toml (the resolved config) and run.json (what this run is) in the dump folder."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    (dump_folder / "config.toml").write_text(config_toml)
    (dump_folder / "run.json").write_text(json.dumps(facts.as_json(), indent=2) + "\n")
    active = facts.active_params
    logger.info(
        "model %s/%s: %s parameters%s, %.3g FLOPs per token; global batch %d x %d tokens "
        "(%d micro-batches per step)",
        facts.model_name,
        facts.flavor,
        f"{facts.num_params:,}",
        f" ({active:,} active)" if active != facts.num_params else "",
        facts.throughput.flops_per_token,
        facts.global_batch_size,
        facts.seq_len,
        facts.gradient_accumulation_steps,
    )


def metrics_logger(cfg: JobConfig, dump_folder: Path, is_main: bool) -> MetricsLogger:
    """The run's metrics logger ([metrics]: wandb and TensorBoard when enabled; wandb gets
    the whole resolved config)."""
    m = cfg.metrics
    wandb = None
    if m.enable_wandb:
        wandb = {
            "project": m.wandb_project,
            "name": m.wandb_run_name or cfg.job.description,
            "config": {s: asdict(getattr(cfg, s)) for s in sections()},
        }
    tensorboard = dump_folder / m.tensorboard_folder if m.enable_tensorboard else None
    return MetricsLogger(dump_folder, is_main, wandb, tensorboard)


@dataclass
class StepStats:
    """One logged step's values, read on the host."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_seen: int
    model_state_bytes: int
    extra: dict[str, float] | None = None
    """More fields for the record (a mixture of experts' routing metrics)."""


class StepLogger:
    """Turns a logged step into a record (metrics.jsonl, wandb) and a console line, with the
    throughput of the window since the last logged step: training time only (``paused``
    leaves validation and saves out), this rank's tokens, the share spent waiting for data."""

    def __init__(self, throughput: Throughput, metrics: MetricsLogger, total_steps: int):
        self.throughput = throughput
        self.metrics = metrics
        self.total_steps = total_steps
        self.warned_peak = False
        self._start = self._window_start = time.perf_counter()
        self._first_step = 1
        self._window_tokens, self._window_data_s, self._window_flops = 0, 0.0, 0.0
        self.startup_fields: dict[str, object] = {}
        # TITANLITE_CUDA_SYNC_CHECK=1: report every device-to-host synchronization inside a
        # step (there should be none; values are read only at log steps). CUDA only.
        self.check_syncs = (
            torch.cuda.is_available() and os.environ.get("TITANLITE_CUDA_SYNC_CHECK") == "1"
        )

    def begin(self, first_step: int) -> None:
        """The loop starts at ``first_step`` (after a resume, not 1): the ETA counts from it."""
        self._first_step = first_step
        self._start = self._window_start = time.perf_counter()

    def waited_for_data(self, seconds: float) -> None:
        self._window_data_s += seconds

    def trained(self, batches: list[tuple[torch.Tensor, torch.Tensor]], cp: int = 1) -> None:
        """A step trained on this rank's ``batches`` (under context parallelism on 1/cp of
        each sequence), at the FLOPs per token of their length."""
        tokens = sum(labels.numel() for _, labels in batches) // cp
        t = self.throughput
        per_token = t.flops_at(batches[0][1].shape[1]) if t.flops_at else t.flops_per_token
        self._window_tokens += tokens
        self._window_flops += tokens * per_token

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Around what is not training (validation, saves): left out of the window."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - paused

    @contextlib.contextmanager
    def sync_check(self) -> Iterator[None]:
        if not self.check_syncs:
            yield
            return
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def startup_done(self, clock: StartupClock) -> None:
        """Once, after the first step (data wait, compilation and all); the numbers go into
        that step's record as startup_s and startup_phases_s."""
        clock.mark("first_step")
        self.startup_fields = {
            "startup_s": round(sum(clock.seconds.values()), 3),
            "startup_phases_s": {k: round(v, 3) for k, v in clock.seconds.items()},
        }
        logger.info("%s", clock.summary())

    def _checked_mfu(self, tps: float, flops_per_token: float | None = None) -> float:
        """This step's MFU. Above 100%, the measured matmul peak must have been taken while
        other work shared the cores: it is measured again there and then (once per run; a
        second or a few, outside the tokens/s window), the cache gets the new figure, and the
        rest of the run uses it."""
        t = self.throughput
        flops_per_token = flops_per_token or t.flops_per_token
        mfu = 100 * tps * flops_per_token / t.peak_flops
        if mfu <= 100 or self.warned_peak or not t.peak_source.startswith("measured"):
            return mfu
        self.warned_peak = True
        stale = t.peak_flops
        forget_peak_flops(t.device, t.train_dtype)
        t.peak_flops, t.peak_source = peak_flops(t.device, t.train_dtype)
        again = 100 * tps * flops_per_token / t.peak_flops
        logger.warning(
            "MFU %.0f%% is above 100%%: the cached peak of %.3g FLOP/s must have been measured "
            "while the machine was busy; measured again: %.3g FLOP/s, MFU %.0f%% (saved in %s)",
            mfu,
            stale,
            t.peak_flops,
            again,
            peak_cache_file(),
        )
        return again

    def log(self, stats: StepStats) -> None:
        now = time.perf_counter()
        seconds = now - self._window_start
        tps = self._window_tokens / seconds
        done = stats.step - self._first_step + 1
        eta = (now - self._start) / done * (self.total_steps - stats.step)
        mfu = self._checked_mfu(tps, self._window_flops / max(self._window_tokens, 1))
        device = self.throughput.device
        record = {
            "step": stats.step,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "tps": tps,
            "mfu_pct": mfu,
            "mem_peak_gib": memory_peak_gib(device),
            **cuda_memory_stats(device),
            # Exact local bytes of params + grads + optimizer state: FSDP's saving shows here.
            "model_state_gib": stats.model_state_bytes / 2**30,
            "tokens_seen": stats.tokens_seen,
            "data_wait_pct": 100 * self._window_data_s / seconds,
            "time": time.time(),
            **self.startup_fields,
            # Mixture of experts: load balance, dropped tokens, aux loss; QK-clip: max logits.
            **(stats.extra or {}),
        }
        self.startup_fields = {}
        total = self.total_steps
        console = (
            f"step {stats.step:>{len(str(total))}}/{total} | loss {stats.loss:7.4f} | "
            f"grad_norm {stats.grad_norm:6.3f} | lr {stats.lr:.2e} | "
            f"tps {tps:,.0f} | mfu {mfu:5.2f}% | mem {record['mem_peak_gib']:.2f}GiB | "
            f"eta {format_duration(eta)}"
        )
        if stats.extra and "moe_load_max_mean" in stats.extra:  # the busiest expert vs the mean
            console += f" | moe load {stats.extra['moe_load_max_mean']:.2f}"
        if stats.extra and "qk_max_logit" in stats.extra:  # QK-clip's view of attention
            qk = stats.extra
            console += f" | max logit {qk['qk_max_logit']:.1f} ({qk['qk_clipped_heads']} clipped)"
        self.metrics.log(record, console)
        self._window_start, self._window_tokens, self._window_data_s = time.perf_counter(), 0, 0.0
        self._window_flops = 0.0
