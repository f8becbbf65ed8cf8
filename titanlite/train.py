"""The trainer: reads top to bottom like a run does.

    python -m titanlite.train --job.config_file CONFIG.toml [--section.key value ...]

Normally started by ./run_train.sh through torchrun; a plain single process works too.
Exit status: 0 done, 2 bad input (one line on stderr), 3 the loss became non-finite,
75 stopped by SIGTERM/SIGUSR1 after saving a checkpoint (run the same command to resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite import IMPORT_STARTED, distributed
from titanlite.checkpoint import EXIT_PREEMPTED, Checkpointer, TrainState
from titanlite.config import (
    JobConfig,
    global_batch_size,
    gradient_accumulation_steps,
    help_text,
    load_config,
    parse_cli,
    resolve_degrees,
    to_toml,
)
from titanlite.data import IGNORE_INDEX, DataSpec, build_dataloader
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.metrics import (
    MetricsLogger,
    cuda_memory_stats,
    device_name,
    forget_peak_flops,
    format_duration,
    memory_peak_gib,
    model_state_bytes,
    peak_cache_file,
    peak_flops,
)
from titanlite.models.llama import Transformer, count_params, flops_per_token
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import DTYPES, parallelize, uses_loss_parallel
from titanlite.preflight import build_model_args, check, resolve_path
from titanlite.profiling import profiling

logger = logging.getLogger("titanlite.train")

EXIT_DIVERGED = 3


class TrainingDiverged(RuntimeError):
    pass


class Preempted(RuntimeError):
    """Stopped on a signal after saving; the same command resumes."""


def data_spec(cfg: JobConfig) -> DataSpec:
    t = cfg.training
    return DataSpec(
        dataset=t.dataset,
        dataset_path=resolve_path(t.dataset_path),
        dataset_config=t.dataset_config,
        text_field=t.text_field,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        seed=t.seed,
        validation_fraction=cfg.validation.holdout_fraction,
    )


class StartupClock:
    """Wall-clock seconds of each start-up phase, from the launch of ./run_train.sh (its
    TITANLITE_LAUNCH_TIME) to the end of the first step: where a slow start goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = IMPORT_STARTED
        launched = os.environ.get("TITANLITE_LAUNCH_TIME")
        if launched:
            try:
                self.seconds["launcher"] = max(IMPORT_STARTED - float(launched), 0.0)
            except ValueError:
                pass
        self.mark("imports")

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        return f"startup: first step done {sum(self.seconds.values()):.1f} s after launch ({parts})"


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.startup = StartupClock()
        self.check_syncs = (
            torch.cuda.is_available() and os.environ.get("TITANLITE_CUDA_SYNC_CHECK") == "1"
        )
        self.startup_fields: dict[str, object] = {}
        t = cfg.training
        # From the start: a preemption signal during a long start-up (model build, loading a
        # checkpoint) must not kill the process before it can exit with EXIT_PREEMPTED.
        self.preempt_signal: int | None = None
        self._install_signal_handlers()
        # 1. Processes, devices and the layout.
        self.tokenizer = check(cfg, distributed.env_info()[1])
        self.dist = distributed.init(t.seed)
        self.device = self.dist.device
        degrees = resolve_degrees(cfg, self.dist.world_size)
        self.accum_steps = gradient_accumulation_steps(cfg, degrees)
        self.global_batch = global_batch_size(cfg, degrees)
        self.dims = ParallelDims(degrees, self.device.type)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.startup.mark("distributed")

        # 2. Data (the tokenizer came with the checks): each rank reads its share of the same
        # global batches.
        self.spec = data_spec(cfg)
        self.train_loader = build_dataloader(
            self.tokenizer, self.spec, self.dims.dp_rank, self.dims.dp_size, "train"
        )
        self.startup.mark("data")

        # 3. Model: meta device -> parallelize -> materialize and initialize.
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size)
        with torch.device("meta"):
            model = Transformer(self.model_args)
        self.num_params = count_params(model)
        self.flops_per_token = flops_per_token(self.model_args, t.seq_len)
        self.model = model  # the unwrapped module (checkpoints, init)
        self.train_model = parallelize(
            model, self.dims, cfg, lambda m: m.materialize(self.device, t.seed)
        )
        self.loss_parallel = uses_loss_parallel(self.dims, cfg)
        uses_fsdp = degrees.dp_shard > 1
        self.autocast_dtype = (
            None if uses_fsdp or t.mixed_precision_param == "float32" else torch.bfloat16
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.startup.mark("model")

        # 4. Optimization.
        self.optimizer = build_optimizer(self.model, cfg, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.state = TrainState()
        self.model_state: dict[str, int] | None = None
        self.startup.mark("optimizer")

        # 5. Outputs.
        self.dump_folder = Path(cfg.job.dump_folder)
        self.train_dtype = DTYPES[t.mixed_precision_param]
        self.peak_flops, self.peak_source = peak_flops(self.device, self.train_dtype)
        self.warned_peak = False
        if self.dist.is_main:
            self._write_run_files()
        wandb_settings = None
        if cfg.metrics.enable_wandb:
            wandb_settings = {
                "project": cfg.metrics.wandb_project,
                "name": cfg.metrics.wandb_run_name or cfg.job.description,
                "config": {s: asdict(getattr(cfg, s)) for s in asdict(cfg)},
            }
        tensorboard = None
        if cfg.metrics.enable_tensorboard:
            tensorboard = self.dump_folder / cfg.metrics.tensorboard_folder
        self.metrics = MetricsLogger(
            self.dump_folder, self.dist.is_main, wandb_settings, tensorboard
        )
        self.startup.mark("outputs")

        # 6. Checkpoints: resume exactly where the latest complete one left off.
        self.checkpointer = Checkpointer(
            cfg, self.model, self.optimizer, self.lr_scheduler, self.train_loader, self.state,
            self.model_args, self.dist.is_main,
        )  # fmt: skip
        if self.checkpointer.load():
            self.metrics.log(
                {"step": self.state.step, "kind": "resume", "time": time.time()},
                f"resumed from checkpoint at step {self.state.step}",
            )
        self.train_iter = iter(self.train_loader)
        self.startup.mark("checkpoint")

    def _write_run_files(self) -> None:
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        (self.dump_folder / "config.toml").write_text(to_toml(self.cfg))
        d = self.dims.degrees
        info = {
            "num_params": self.num_params,
            "flops_per_token": self.flops_per_token,
            "world_size": self.dist.world_size,
            "parallel_degrees": {
                "dp_replicate": d.dp_replicate,
                "dp_shard": d.dp_shard,
                "tp": d.tp,
            },
            "global_batch_size": self.global_batch,
            "gradient_accumulation_steps": self.accum_steps,
            "device": str(self.device),
            "device_name": device_name(self.device),
            "train_dtype": str(self.train_dtype).removeprefix("torch."),
            "peak_flops_per_device": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "vocab_size": self.model_args.vocab_size,
            "tokenizer": self.tokenizer.path.as_posix(),
            "model_args": asdict(self.model_args),
            "torch_version": torch.__version__,
        }
        (self.dump_folder / "run.json").write_text(json.dumps(info, indent=2) + "\n")
        logger.info(
            "model %s/%s: %s parameters, %.3g FLOPs per token; global batch %d x %d tokens "
            "(%d micro-batches per step)",
            self.cfg.model.name, self.cfg.model.flavor, f"{self.num_params:,}",
            self.flops_per_token, self.global_batch, self.cfg.training.seq_len, self.accum_steps,
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        cfg = self.cfg
        total = cfg.training.steps
        start = time.perf_counter()
        window_start, window_tokens, window_data_s = start, 0, 0.0
        first_step = self.state.step + 1
        with profiling(cfg, self.dump_folder, self.dist.rank, first_step) as profiler:
            while self.state.step < total:
                self.state.step += 1
                t0 = time.perf_counter()
                batches = [next(self.train_iter) for _ in range(self.accum_steps)]
                window_data_s += time.perf_counter() - t0
                with self._sync_check():
                    loss, n_tokens, grad_norm = self.train_step(batches)
                if self.state.step == first_step:
                    self._log_startup()
                window_tokens += sum(x.numel() for x, _ in batches)
                self.state.tokens_seen += n_tokens

                if (
                    self.state.step == first_step
                    or self.state.step % cfg.metrics.log_freq == 0
                    or self.state.step == total
                ):
                    now = time.perf_counter()
                    self._log_step(loss, grad_norm, now - window_start, window_tokens, window_data_s,
                                   eta=(now - start) / (self.state.step - first_step + 1) * (total - self.state.step))  # fmt: skip
                    window_start, window_tokens, window_data_s = time.perf_counter(), 0, 0.0
                # Validation and checkpoint saves are not training: their time is left out
                # of the tokens/s window.
                paused = time.perf_counter()
                if cfg.validation.enable and (
                    self.state.step % cfg.validation.freq == 0 or self.state.step == total
                ):
                    self.validate()
                if self._preemption_requested():
                    if cfg.checkpoint.enable:
                        self.checkpointer.save(self.state.step, force_sync=True)
                    raise Preempted(
                        f"stopped at step {self.state.step} on signal {self.preempt_signal}"
                        + ("; checkpoint saved" if cfg.checkpoint.enable else "")
                    )
                if self.checkpointer.should_save(self.state.step, last=self.state.step == total):
                    self.checkpointer.save(self.state.step, last=self.state.step == total)
                self.checkpointer.poll()
                window_start += time.perf_counter() - paused
                profiler.step()
        logger.info(
            "training finished: %d steps in %s", total, format_duration(time.perf_counter() - start)
        )

    def _log_startup(self) -> None:
        """Once, after the first step (data wait, compilation and all); the numbers go into
        that step's record as startup_s and startup_phases_s."""
        self.startup.mark("first_step")
        seconds = self.startup.seconds
        self.startup_fields = {
            "startup_s": round(sum(seconds.values()), 3),
            "startup_phases_s": {k: round(v, 3) for k, v in seconds.items()},
        }
        logger.info("%s", self.startup.summary())

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGUSR1 (cluster preemption, SLURM's warning signal) finish the current
        step, save, and exit with EXIT_PREEMPTED."""

        def request_stop(signum: int, frame: object) -> None:
            self.preempt_signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, request_stop)

    def _preemption_requested(self) -> bool:
        """Whether any rank got a stop signal: all ranks must stop at the same step."""
        if self.dist.world_size == 1:
            return self.preempt_signal is not None
        flag = torch.tensor(int(self.preempt_signal is not None))
        stop = int(distributed.all_reduce(flag, dist.ReduceOp.MAX))
        if stop and self.preempt_signal is None:
            self.preempt_signal = -1  # another rank's signal
        return bool(stop)

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global mean loss, global target
        tokens, gradient norm before clipping)."""
        dp_group = self.dims.group("dp")
        # Every rank needs the global count of target tokens before backward: the loss is
        # a sum divided by it, so accumulation, parallelism and padding never change it.
        local_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        n_tokens = distributed.all_reduce(
            torch.as_tensor(local_tokens), dist.ReduceOp.SUM, dp_group
        )
        n_tokens_int = int(n_tokens)
        # Data-parallel engines average gradients over the dp ranks; undo that average.
        scale = self.dims.dp_size / n_tokens_int
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(batches):
            last = i == len(batches) - 1
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self._maybe_no_sync(last), self._loss_context():
                with self._autocast():
                    logits = self.train_model(inputs)
                ce = cross_entropy_sum(logits, labels)
                (ce * scale).backward()
            loss_sum += full(ce.detach())
        grad_norm = clip_grad_norm_(self.params, self.cfg.training.max_norm)
        self.last_lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step uses
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.model_state is None:  # sizes are fixed after the first step creates them
            self.model_state = model_state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        loss = distributed.all_reduce(loss_sum, dist.ReduceOp.SUM, dp_group) / n_tokens_int
        return loss, n_tokens_int, grad_norm

    def _sync_check(self) -> contextlib.AbstractContextManager:
        """TITANLITE_CUDA_SYNC_CHECK=1: report every device-to-host synchronization inside the
        step (there should be none; values are read only at log steps). CUDA only."""
        if not self.check_syncs:
            return contextlib.nullcontext()
        return _cuda_sync_warnings()

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Loss parallel: cross-entropy straight from vocab-sharded logits (TP)."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 compute for layouts without FSDP (FSDP casts parameters itself)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _maybe_no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Skip gradient communication on all but the last micro-batch of a step."""
        model = self.train_model
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if not sync and hasattr(model, "no_sync"):  # DDP
            return model.no_sync()
        return contextlib.nullcontext()

    def _log_step(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, seconds: float, tokens: int,
        data_s: float, eta: float,
    ) -> None:  # fmt: skip
        loss_value = float(loss)
        if not torch.isfinite(loss).item() or not torch.isfinite(grad_norm).item():
            raise TrainingDiverged(
                f"loss became non-finite at step {self.state.step} (loss {loss_value}, grad norm "
                f"{float(grad_norm)}); try a lower optimizer.lr or a longer warmup"
            )
        tps = tokens / seconds
        mfu = 100 * tps * self.flops_per_token / self.peak_flops
        if mfu > 100 and not self.warned_peak and self.peak_source.startswith("measured"):
            # The matmul peak was measured while other work shared the cores. Forget it, so
            # the next run measures again (hopefully on a quieter machine).
            self.warned_peak = True
            forget_peak_flops(self.device, self.train_dtype)
            logger.warning(
                "MFU %.0f%% is above 100%%: the peak FLOP/s (%s) must have been measured while "
                "the machine was busy; dropped from %s, the next run measures it again",
                mfu, self.peak_source, peak_cache_file(),
            )  # fmt: skip
        record = {
            "step": self.state.step,
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "lr": self.last_lr,
            "tps": tps,
            "mfu_pct": mfu,
            "mem_peak_gib": memory_peak_gib(self.device),
            **cuda_memory_stats(self.device),
            # Exact local bytes of params + grads + optimizer state: FSDP's saving shows here.
            "model_state_gib": sum(self.model_state.values()) / 2**30,
            "tokens_seen": self.state.tokens_seen,
            "data_wait_pct": 100 * data_s / seconds,
            "time": time.time(),
            **self.startup_fields,
        }
        self.startup_fields = {}
        total = self.cfg.training.steps
        console = (
            f"step {self.state.step:>{len(str(total))}}/{total} | loss {loss_value:7.4f} | "
            f"grad_norm {record['grad_norm']:6.3f} | lr {record['lr']:.2e} | "
            f"tps {tps:,.0f} | mfu {mfu:5.2f}% | mem {record['mem_peak_gib']:.2f}GiB | "
            f"eta {format_duration(eta)}"
        )
        self.metrics.log(record, console)

    @torch.no_grad()
    def validate(self) -> None:
        """Mean loss over the held-out documents (the same batches every time)."""
        cfg = self.cfg
        dp_group = self.dims.group("dp")
        loader = build_dataloader(
            self.tokenizer, self.spec, self.dims.dp_rank, self.dims.dp_size, "validation"
        )
        self.train_model.eval()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        batches = 0
        it = iter(loader)
        while cfg.validation.steps == -1 or batches < cfg.validation.steps:
            batch = next(it, None)
            # Every rank must run the same number of forwards (FSDP gathers inside them).
            have = distributed.all_reduce(
                torch.tensor(int(batch is not None)), dist.ReduceOp.MIN, dp_group
            )
            if not int(have):
                break
            inputs, labels = (t.to(self.device) for t in batch)
            with self._loss_context():
                with self._autocast():
                    logits = self.train_model(inputs)
                loss_sum += full(cross_entropy_sum(logits, labels)).double()
            count += (labels != IGNORE_INDEX).sum()
            batches += 1
        self.train_model.train()
        loss_sum = distributed.all_reduce(loss_sum, dist.ReduceOp.SUM, dp_group)
        count = distributed.all_reduce(count, dist.ReduceOp.SUM, dp_group)
        if int(count) == 0:
            logger.warning("validation split is empty; no validation loss")
            return
        val_loss = float(loss_sum / count)
        self.metrics.log(
            {
                "step": self.state.step,
                "kind": "validation",
                "val_loss": val_loss,
                "val_tokens": int(count),
            },
            f"validation at step {self.state.step} | val_loss {val_loss:7.4f} | {int(count):,} tokens",
        )

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


@contextlib.contextmanager
def _cuda_sync_warnings() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (the caller divides by the global target count)."""
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def full(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one (a loss under loss parallel)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def report_error(message: str, status: int) -> int:
    """One line on stderr; also "STATUS<TAB>line" to TITANLITE_ERROR_FILE so the launcher
    can repeat it after torchrun's report and exit with the same status."""
    line = f"titanlite: error: {message}".replace("\n", " ")
    sys.stderr.write(line + "\n")
    return record_status(line, status)


def record_status(line: str, status: int) -> int:
    """Append "STATUS<TAB>line" to TITANLITE_ERROR_FILE: torchrun only says that a rank failed,
    so this is how ./run_train.sh (and through it a SLURM job) learns the trainer's status."""
    path = os.environ.get("TITANLITE_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(f"{status}\t{line}\n")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    distributed.setup_logging()
    trainer = None
    try:
        want_help, _ = parse_cli(argv)
        if want_help:
            sys.stdout.write(help_text() + "\n")
            return 0
        cfg = load_config(argv)
        trainer = Trainer(cfg)
        trainer.train()
        return 0
    except UserError as e:
        return report_error(str(e), EXIT_USER_ERROR)
    except TrainingDiverged as e:
        return report_error(str(e), EXIT_DIVERGED)
    except Preempted as e:
        logger.warning("%s; exiting with status %d so the job can be requeued", e, EXIT_PREEMPTED)
        # Not an error, but the launcher must see 75 (torchrun itself exits 1).
        return record_status(f"titanlite: {e}; run the same command to resume", EXIT_PREEMPTED)
    finally:
        if trainer is not None:
            trainer.close()
        distributed.shutdown()
        # Done (or failed): SIGTERM means "exit now" again, as torchrun means it when it stops
        # the other ranks after a failure; the save-and-stop handler would only make it wait
        # for its SIGKILL (about 30 s).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
