"""What a run reports about itself: run.json, the start-up breakdown, and each logged step
(loss, throughput, MFU, memory) for the console, metrics.jsonl and wandb."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from titanlite import IMPORT_STARTED
from titanlite.config import to_toml
from titanlite.config.layout import MESH_DIMS
from titanlite.metrics import (
    cuda_memory_stats,
    device_name,
    forget_peak_flops,
    format_duration,
    memory_peak_gib,
    peak_cache_file,
    peak_flops,
)

if TYPE_CHECKING:
    from titanlite.trainer import Trainer

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


def write_run_files(trainer: Trainer) -> None:
    """config.toml (the resolved config) and run.json (what this run is) in the dump folder."""
    cfg = trainer.cfg
    trainer.dump_folder.mkdir(parents=True, exist_ok=True)
    (trainer.dump_folder / "config.toml").write_text(to_toml(cfg))
    degrees = trainer.dims.degrees
    info = {
        "model_name": trainer.spec.name,
        "num_params": trainer.num_params,
        "active_params": trainer.active_params,
        "flops_per_token": trainer.flops_per_token,
        "world_size": trainer.dist.world_size,
        "parallel_degrees": {dim: degrees.of(dim) for dim in MESH_DIMS},
        "global_batch_size": trainer.global_batch,
        "gradient_accumulation_steps": trainer.accum_steps,
        "device": str(trainer.device),
        "device_name": device_name(trainer.device),
        "train_dtype": str(trainer.train_dtype).removeprefix("torch."),
        "peak_flops_per_device": trainer.peak_flops,
        "peak_flops_source": trainer.peak_source,
        "vocab_size": trainer.model_args.vocab_size,
        "tokenizer": trainer.tokenizer.path.as_posix(),
        "model_args": asdict(trainer.model_args),
        "init": trainer.model.materialize_stats,
        "torch_version": torch.__version__,
    }
    (trainer.dump_folder / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    logger.info(
        "model %s/%s: %s parameters%s, %.3g FLOPs per token; global batch %d x %d tokens "
        "(%d micro-batches per step)",
        cfg.model.name, cfg.model.flavor, f"{trainer.num_params:,}",
        f" ({trainer.active_params:,} active)" if trainer.active_params != trainer.num_params
        else "", trainer.flops_per_token,
        trainer.global_batch, cfg.training.seq_len, trainer.accum_steps,
    )  # fmt: skip


class StepLogger:
    """Turns a logged step into a record (metrics.jsonl, wandb) and a console line."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.warned_peak = False
        self.startup_fields: dict[str, object] = {}
        # TITANLITE_CUDA_SYNC_CHECK=1: report every device-to-host synchronization inside a
        # step (there should be none; values are read only at log steps). CUDA only.
        self.check_syncs = (
            torch.cuda.is_available() and os.environ.get("TITANLITE_CUDA_SYNC_CHECK") == "1"
        )

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

    def _checked_mfu(self, tps: float) -> float:
        """This step's MFU. Above 100%, the measured matmul peak must have been taken while
        other work shared the cores: it is measured again there and then (once per run; a
        second or a few, outside the tokens/s window), the cache gets the new figure, and the
        rest of the run uses it."""
        t = self.trainer
        mfu = 100 * tps * t.flops_per_token / t.peak_flops
        if mfu <= 100 or self.warned_peak or not t.peak_source.startswith("measured"):
            return mfu
        self.warned_peak = True
        stale = t.peak_flops
        forget_peak_flops(t.device, t.train_dtype)
        t.peak_flops, t.peak_source = peak_flops(t.device, t.train_dtype)
        again = 100 * tps * t.flops_per_token / t.peak_flops
        logger.warning(
            "MFU %.0f%% is above 100%%: the cached peak of %.3g FLOP/s must have been measured "
            "while the machine was busy; measured again: %.3g FLOP/s, MFU %.0f%% (saved in %s)",
            mfu, stale, t.peak_flops, again, peak_cache_file(),
        )  # fmt: skip
        return again

    def log(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, seconds: float, tokens: int,
        data_s: float, eta: float, extra: dict[str, float] | None = None,
    ) -> None:  # fmt: skip
        t = self.trainer
        loss_value = float(loss)
        tps = tokens / seconds
        mfu = self._checked_mfu(tps)
        record = {
            "step": t.state.step,
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "lr": t.last_lr,
            "tps": tps,
            "mfu_pct": mfu,
            "mem_peak_gib": memory_peak_gib(t.device),
            **cuda_memory_stats(t.device),
            # Exact local bytes of params + grads + optimizer state: FSDP's saving shows here.
            "model_state_gib": sum(t.model_state.values()) / 2**30,
            "tokens_seen": t.state.tokens_seen,
            "data_wait_pct": 100 * data_s / seconds,
            "time": time.time(),
            **self.startup_fields,
            **(extra or {}),  # mixture of experts: load balance, dropped tokens, aux loss
        }
        self.startup_fields = {}
        total = t.cfg.training.steps
        console = (
            f"step {t.state.step:>{len(str(total))}}/{total} | loss {loss_value:7.4f} | "
            f"grad_norm {record['grad_norm']:6.3f} | lr {record['lr']:.2e} | "
            f"tps {tps:,.0f} | mfu {mfu:5.2f}% | mem {record['mem_peak_gib']:.2f}GiB | "
            f"eta {format_duration(eta)}"
        )
        if extra and "moe_load_max_mean" in extra:  # the busiest expert against the mean
            console += f" | moe load {extra['moe_load_max_mean']:.2f}"
        t.metrics.log(record, console)
