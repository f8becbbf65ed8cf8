"""The Trainer: the numbered set-up phases, then the loop. Reads top to bottom like a run.

This and ``train.py`` are the only modules that know every layer: config, data, models (only
through their spec), parallelisms (only through ``parallelize``), checkpoints (only through
the Stateful registry) and metrics.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titanlite import distributed, heartbeat
from titanlite.checkpoint.checkpointer import Checkpointer, ModelIdentity, will_load_weights
from titanlite.checkpoint.states import TrainState, build_states
from titanlite.checks import build_model_args, check, resolve_path
from titanlite.config import (
    JobConfig,
    global_batch_size,
    gradient_accumulation_steps,
    resolve_degrees,
)
from titanlite.config.parse import dataset_name
from titanlite.data import IGNORE_INDEX, DataSpec, build_dataloader, held_out
from titanlite.data.mixture import MixtureLoader, Part
from titanlite.data.tokens import is_token_folder
from titanlite.dtypes import DTYPES
from titanlite.metrics import MetricsLogger, format_duration, model_state_bytes, peak_flops
from titanlite.models.layers import count_params
from titanlite.models.moe import MoETracker
from titanlite.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import DocumentMask, parallelize
from titanlite.parallel.pipeline import tied_copy
from titanlite.profiling import profiling
from titanlite.run_info import StartupClock, StepLogger, write_run_files

logger = logging.getLogger("titanlite.train")


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
        split_by_rank=t.split_by_rank,
    )


VALIDATION_CACHE_BYTES = 512 << 20
"""Validation batches a rank keeps in memory between passes (beyond it: read again)."""


def mixture_parts(cfg: JobConfig, base: DataSpec) -> list[Part]:
    """training.datasets as mixture parts: each folder with the run's seq_len, batch, seed."""
    from dataclasses import replace

    total = sum(e.weight for e in cfg.training.datasets)
    return [
        Part(dataset_name(e), e.weight / total,
             replace(base, dataset_path=resolve_path(e.path)))
        for e in cfg.training.datasets
    ]  # fmt: skip


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.startup = StartupClock()
        t = cfg.training
        # From the start: a preemption signal during a long start-up (model build, loading a
        # checkpoint) must not kill the process before it can exit with EXIT_PREEMPTED.
        self.preempt_signal: int | None = None
        self._vote: tuple[Any, torch.Tensor] | None = None  # the vote in flight (_read_vote)
        self._lost = False  # a collective failed: a rank is gone
        self._logging = True  # whether the step in progress is logged
        self._last_save = time.monotonic()  # for checkpoint.interval_minutes
        self._install_signal_handlers()

        # 1. Processes, devices and the layout.
        self.tokenizer = check(cfg, distributed.env_info()[1])
        self.dist = distributed.init(t.seed, cfg.comm.init_timeout_seconds)
        # Who is alive, for naming a lost rank when a collective fails (titanlite.heartbeat).
        self.heartbeat = heartbeat.Heartbeat(
            self.dist.rank, self.dist.world_size, cfg.comm.init_timeout_seconds
        )
        heartbeat.ACTIVE = self.heartbeat
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
        self.data = data_spec(cfg)
        self.mixture = mixture_parts(cfg, self.data)
        # Every validation pass reads the same batches: the first pass's are kept (within
        # VALIDATION_CACHE_BYTES per rank), so later ones neither rescan the corpus for the
        # held-out documents nor tokenize them again; a text stream's also on disk, for a
        # restart in the same dump folder (titanlite.data.held_out).
        self._validation_cache: dict[DataSpec, list] = {}
        self._validation_uncached: set[DataSpec] = set()
        if self.mixture:
            self.train_loader = MixtureLoader(
                self.tokenizer, self.mixture, self.dims.batch_rank, self.dims.batch_size
            )
        else:
            self.train_loader = build_dataloader(
                self.tokenizer, self.data, self.dims.batch_rank, self.dims.batch_size, "train"
            )
        self.startup.mark("data")

        # 3. Model: meta device -> parallelize -> allocate and initialize the local shards
        # (not at all when a checkpoint is about to overwrite them).
        self.spec, self.model_args = build_model_args(cfg, self.tokenizer.vocab_size)
        with torch.device("meta"):
            model = self.spec.build(self.model_args)
        self.num_params = count_params(model)
        active = self.spec.active_params
        self.active_params = active(self.model_args, self.num_params) if active else self.num_params
        self.flops_per_token = self.spec.flops_per_token(self.model_args, t.seq_len)
        checkpoint_folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
        self.model = parallelize(
            model, self.spec, self.model_args, self.dims, cfg, self.device,
            init_weights=not will_load_weights(cfg.checkpoint, checkpoint_folder),
            loss_sum=cross_entropy_sum,
        )  # fmt: skip
        if t.document_mask:
            self.model.documents = DocumentMask(
                self.tokenizer.bos_id, self.tokenizer.eos_id, t.document_positions
            )
        self.params = [p for part in self.model.parts for p in part.parameters() if p.requires_grad]
        # Under pipeline parallelism each rank holds some stages: norms add up over pp.
        self.stage_group = self.dims.group("pp") if degrees.pp > 1 else None
        # Mixture-of-experts layers: their balancing loss, routing-bias updates and metrics.
        experts = MoETracker.find(self.model.parts)
        self.moe = None
        if experts:
            self.moe = MoETracker(
                experts, self.dims.group("tokens"), self.global_batch,
                grad_weight=self.dims.grad_average_size, stage_group=self.stage_group,
                n_layers=self.model_args.n_layers,
            )  # fmt: skip
            if self.model.pipeline is not None:  # its shape inference must not count
                self.model.pipeline.warm_up(t.local_batch_size, t.seq_len, self.device)
                self.moe.discard()
        self._moe_metrics: dict[str, float] | None = None
        self.startup.mark("model")

        # 4. Optimization: one optimizer and schedule per model part.
        self.optimizers = [build_optimizer(part, cfg, self.device) for part in self.model.parts]
        self.lr_schedulers = [build_lr_scheduler(o, cfg) for o in self.optimizers]
        self.state = TrainState()
        self.model_state: dict[str, int] | None = None
        self.startup.mark("optimizer")

        # 5. Outputs.
        self.dump_folder = Path(cfg.job.dump_folder)
        self.train_dtype = DTYPES[t.mixed_precision_param]
        self.peak_flops, self.peak_source = peak_flops(self.device, self.train_dtype)
        if self.dist.is_main:
            write_run_files(self)
        self.metrics = MetricsLogger(
            self.dump_folder,
            self.dist.is_main,
            _wandb_settings(cfg),
            self.dump_folder / cfg.metrics.tensorboard_folder
            if cfg.metrics.enable_tensorboard
            else None,
        )
        self.step_logger = StepLogger(self)
        self.startup.mark("outputs")

        # 6. Checkpoints: everything resumable, registered once; resume exactly where the
        # latest complete checkpoint left off.
        states = build_states(
            self.model.parts, self.optimizers, self.lr_schedulers, self.train_loader, self.state,
            [tied_copy(part, self.spec, self.model_args) for part in self.model.parts],
        )  # fmt: skip
        self.checkpointer = Checkpointer(
            states, cfg.checkpoint, checkpoint_folder,
            ModelIdentity(self.spec.name, asdict(self.model_args)),
            {"tokenizer_source": cfg.model.tokenizer_path}, self.dist.is_main,
            # The tokenizer travels inside: converting or generating from a checkpoint works
            # from any folder, wherever the original file was.
            write_files=lambda folder: {"tokenizer": self.tokenizer.copy_files(folder).name},
        )  # fmt: skip
        if self.checkpointer.load():
            self.metrics.log(
                {"step": self.state.step, "kind": "resume", "time": time.time()},
                f"resumed from checkpoint at step {self.state.step}",
            )
        self.train_iter = iter(self.train_loader)
        self.startup.mark("checkpoint")

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        cfg = self.cfg
        total = cfg.training.steps
        start = time.perf_counter()
        window_start, window_tokens, window_data_s = start, 0, 0.0
        first_step = self.state.step + 1
        self._stop_if_signalled_during_startup()
        try:
            with profiling(cfg, self.dump_folder, self.dist.rank, first_step) as profiler:
                while self.state.step < total:
                    self.state.step += 1
                    self.heartbeat.beat(self.state.step)
                    t0 = time.perf_counter()
                    # What this rank uses: under context parallelism its chunks of the labels.
                    batches = [
                        self.model.local_batch(*next(self.train_iter))
                        for _ in range(self.accum_steps)
                    ]
                    window_data_s += time.perf_counter() - t0
                    step = self.state.step
                    self._logging = (
                        step == first_step or step % cfg.metrics.log_freq == 0 or step == total
                    )
                    with self.step_logger.sync_check():
                        loss_sum, n_tokens, grad_norm = self.train_step(batches)
                    if self.state.step == first_step:
                        self.step_logger.startup_done(self.startup)
                        heartbeat.set_timeouts(cfg.comm.timeout_seconds)
                        self.heartbeat.set_timeout(cfg.comm.timeout_seconds)
                    window_tokens += sum(y.numel() for _, y in batches)  # this rank's tokens
                    self.state.add_tokens(n_tokens)

                    if self._logging:
                        # Only a logged step reduces its loss and reads values on the host.
                        loss = self.global_loss(loss_sum, n_tokens)
                        now = time.perf_counter()
                        eta = (now - start) / (step - first_step + 1) * (total - step)
                        self._check_finite(loss, grad_norm)
                        self.step_logger.log(
                            loss,
                            grad_norm,
                            now - window_start,
                            window_tokens,
                            window_data_s,
                            eta,
                            self._moe_metrics,
                        )
                        window_start, window_tokens, window_data_s = time.perf_counter(), 0, 0.0
                    # Validation and checkpoint saves are not training: their time is left out
                    # of the tokens/s window.
                    paused = time.perf_counter()
                    if cfg.validation.enable and (step % cfg.validation.freq == 0 or step == total):
                        self.validate()
                    stop, timed_save = self._read_vote()
                    if stop:
                        if cfg.checkpoint.enable:
                            self.checkpointer.save(step, force_sync=True)
                        raise Preempted(
                            f"stopped at step {step} on signal {self.preempt_signal}"
                            + ("; checkpoint saved" if cfg.checkpoint.enable else "")
                        )
                    if self.checkpointer.should_save(step, last=step == total) or timed_save:
                        if timed_save:
                            logger.info(
                                "saving at step %d: checkpoint.interval_minutes passed", step
                            )
                        self.checkpointer.save(step, last=step == total)
                        self._last_save = time.monotonic()
                    self._start_vote()
                    self.checkpointer.poll()
                    window_start += time.perf_counter() - paused
                    profiler.step()
        except RuntimeError as e:
            if heartbeat.is_comm_failure(e) and self.dist.world_size > 1:
                self._lost = True  # no collective may run any more: not even the vote's
                raise heartbeat.CommFailure(heartbeat.failure_message(e)) from None
            raise
        finally:
            if not self._lost:
                self._settle_vote()  # no all-reduce left in flight, whatever ends the loop
        if self.mixture:
            self._log_mixture()
        logger.info(
            "training finished: %d steps in %s", total, format_duration(time.perf_counter() - start)
        )

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (this rank's loss sum, global
        target tokens, gradient norm before clipping), all on the device and unread: the
        mean loss is ``global_loss`` of the first two."""
        loss_group = self.dims.group("loss")
        # Every rank needs the global count of target tokens before backward: the loss is
        # a sum divided by it, so accumulation, parallelism and padding never change it. It
        # stays a device tensor (no host synchronization; NCCL reduces it asynchronously).
        local_tokens = sum((y != IGNORE_INDEX).sum() for _, y in batches)
        n_tokens = distributed.all_reduce(
            torch.as_tensor(local_tokens).to(self.device), dist.ReduceOp.SUM, loss_group
        )
        # Data-parallel engines average gradients over the batch (x cp) ranks; undo that.
        scale = self.dims.grad_average_size / n_tokens
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(batches):
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.model.grad_sync(i == len(batches) - 1), self.model.train_context():
                if self.model.pipeline is not None:  # forward and backward in every stage
                    ce = self.model.pipeline.forward_backward(inputs, labels, scale)
                else:
                    ce = cross_entropy_sum(self.model(inputs), labels)
                    (ce * scale).backward()  # MoE layers add their balancing loss's gradient
            loss_sum += full(ce.detach())
        self.model.finish_gradients()
        grad_norm = clip_grad_norm_(
            self.params, self.cfg.training.max_norm, self.stage_group, self.model.norm_skip
        )
        self.last_lr = self.lr_schedulers[0].get_last_lr()[0]  # the rate this step uses
        for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers, strict=True):
            optimizer.step()
            scheduler.step()
        if self.moe is not None:  # routing biases move (when on) after the step, metrics later
            self._moe_metrics = self.moe.after_step(log=self._logging)
        if self.model_state is None:  # sizes are fixed after the first step creates them
            self.model_state = model_state_bytes(self.model.parts, self.optimizers)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return loss_sum, n_tokens, grad_norm

    def global_loss(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        """The step's mean loss over every target token of the global batch (a collective
        over the loss group: every rank of it calls this at the same steps)."""
        loss_group = self.dims.group("loss")
        return distributed.all_reduce(loss_sum, dist.ReduceOp.SUM, loss_group) / n_tokens

    def _check_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if not torch.isfinite(loss).item() or not torch.isfinite(grad_norm).item():
            raise TrainingDiverged(
                f"loss became non-finite at step {self.state.step} (loss {float(loss)}, grad "
                f"norm {float(grad_norm)}); try a lower optimizer.lr or a longer warmup"
            )

    # ------------------------------------------------------------------ preemption
    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGUSR1 (cluster preemption, SLURM's warning signal) finish the current
        step, save, and exit with EXIT_PREEMPTED."""

        def request_stop(signum: int, frame: object) -> None:
            self.preempt_signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, request_stop)

    def _stop_if_signalled_during_startup(self) -> None:
        """A stop signal that came during start-up (model build, checkpoint load): exit
        before the first step, with nothing new to save (one blocking vote, once)."""
        signalled = self.preempt_signal is not None
        if self.dist.world_size > 1:
            flag = torch.tensor(int(signalled))
            signalled = bool(int(distributed.all_reduce(flag, dist.ReduceOp.MAX)))
        if signalled:
            if self.preempt_signal is None:
                self.preempt_signal = -1  # another rank's signal
            raise Preempted(
                f"stopped during start-up on signal {self.preempt_signal}, before step "
                f"{self.state.step + 1}; nothing new to save"
            )

    def _save_due(self) -> bool:
        """Whether checkpoint.interval_minutes have passed since the last save, by this
        rank's clock."""
        c = self.cfg.checkpoint
        minutes = c.interval_minutes
        return c.enable and minutes > 0 and time.monotonic() - self._last_save >= 60 * minutes

    def _read_vote(self) -> tuple[bool, bool]:
        """(whether any rank got a stop signal, whether any rank's clock says a timed save is
        due): every rank must stop, or save, at the same step.

        With several ranks this is the vote started at the end of the previous step (an
        asynchronous all-reduce, ``_start_vote``), so no step waits for the slowest rank's
        vote: every rank acts one step after the first rank saw the signal or the time.
        """
        if self.dist.world_size == 1:
            return self.preempt_signal is not None, self._save_due()
        votes = self._settle_vote()
        stop = bool(votes & 1)
        if stop and self.preempt_signal is None:
            self.preempt_signal = -1  # another rank's signal
        return stop, bool(votes & 2)

    def _start_vote(self) -> None:
        if self.dist.world_size == 1:
            return
        votes = int(self.preempt_signal is not None) | (int(self._save_due()) << 1)
        flag = torch.tensor(votes)  # CPU: over gloo
        self._vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def _settle_vote(self) -> int:
        """Wait for the vote in flight (started a step ago); its result (0 when none)."""
        if self._vote is None:
            return 0
        work, flag = self._vote
        self._vote = None
        work.wait()
        return int(flag)

    # ------------------------------------------------------------------ validation
    def _log_mixture(self) -> None:
        loader = self.train_loader
        k = loader._windows_consumed
        shares = ", ".join(
            f"{name} {share:.2%} (weight {part.weight:.2%})"
            for (name, share), part in zip(loader.realized().items(), self.mixture, strict=True)
        )
        # Host arithmetic on the window count alone (no device sync): the deviation now, and
        # the worst over every prefix of the run (exact, from the rule's period).
        logger.info(
            "data mixture after %d windows: %s; deviation from the weights %.2f windows now, "
            "at most %.2f over the run",
            k, shares, loader.interleave.worst_deviation(k),
            loader.interleave.worst_deviation_upto(k),
        )  # fmt: skip

    @torch.no_grad()
    def validate(self) -> None:
        """Mean loss over the held-out documents (the same batches every time); with a
        mixture, also each dataset's own (val_loss_NAME), val_loss over all of them."""
        specs = [(p.name, p.spec) for p in self.mixture] or [("", self.data)]
        sums = [self._validation_sums(spec) for _, spec in specs]
        total = sum(c for _, c in sums)
        if total == 0:
            logger.warning("validation split is empty; no validation loss")
            return
        val_loss = sum(loss for loss, _ in sums) / total
        record = {"step": self.state.step, "kind": "validation", "val_loss": val_loss,
                  "val_tokens": total}  # fmt: skip
        parts = ""
        if self.mixture:
            for (name, _), (loss, count) in zip(specs, sums, strict=True):
                if count:
                    record[f"val_loss_{name}"] = loss / count
            parts = " | " + ", ".join(
                f"{name} {record[f'val_loss_{name}']:.4f}"
                for name, _ in specs
                if f"val_loss_{name}" in record
            )
        self.metrics.log(
            record,
            f"validation at step {self.state.step} | val_loss {val_loss:7.4f}{parts} | "
            f"{total:,} tokens",
        )

    def _validation_sums(self, spec: DataSpec) -> tuple[float, int]:
        """(summed loss, label count) over the validation split of ``spec``, all ranks."""
        cfg = self.cfg
        loss_group = self.dims.group("loss")
        cached = self._validation_cache.get(spec)
        recorded_bytes = sum(_nbytes(kept) for kept in self._validation_cache.values())
        disk = None  # a text stream's file of batches, for a restart: (path, key)
        text = not is_token_folder(spec.dataset_path)  # a folder's windows are cheap to read
        if cached is None and text and spec not in self._validation_uncached:
            b = self.dims
            key = held_out.batches_key(
                spec, self.tokenizer.fingerprint, b.batch_rank, b.batch_size, cfg.validation.steps
            )
            disk = (self.dump_folder / "validation" / f"dp{b.batch_rank}-of-{b.batch_size}.pt", key)
            cached = held_out.load(*disk)
            # The same batches a scan would give, so ranks may differ in which read them; one
            # kept under a larger cache is read as a first pass would be.
            if cached is not None and recorded_bytes + _nbytes(cached) <= VALIDATION_CACHE_BYTES:
                self._validation_cache[spec] = cached
                logger.info("validation: %d batches read from %s", len(cached), disk[0])
            else:
                cached = None
        if cached is None:
            loader = build_dataloader(
                self.tokenizer, spec, self.dims.batch_rank, self.dims.batch_size, "validation"
            )
            # Record the pass for later ones unless an earlier pass found it too big.
            it, recorded = iter(loader), None if spec in self._validation_uncached else []
        else:
            loader, it, recorded = None, iter(cached), None
        self.model.train(False)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        batches = 0
        while cfg.validation.steps == -1 or batches < cfg.validation.steps:
            batch = next(it, None)
            if recorded is not None and batch is not None:
                recorded.append(batch)
                recorded_bytes += _nbytes([batch])
                if recorded_bytes > VALIDATION_CACHE_BYTES:  # the same on every rank
                    logger.info(
                        "validation: the batches are over the %d MiB cache; every pass reads "
                        "them again", VALIDATION_CACHE_BYTES >> 20,
                    )  # fmt: skip
                    self._validation_uncached.add(spec)
                    recorded = None
            # Every rank must run the same number of forwards (FSDP gathers inside them).
            have = distributed.all_reduce(
                torch.tensor(int(batch is not None)), dist.ReduceOp.MIN, loss_group
            )
            if not int(have):
                break
            inputs, labels = (t.to(self.device) for t in self.model.local_batch(*batch))
            with self.model.train_context():
                if self.model.pipeline is not None:
                    ce = self.model.pipeline.evaluate(inputs, labels)
                else:
                    ce = cross_entropy_sum(self.model(inputs), labels)
                loss_sum += full(ce).double()
            count += (labels != IGNORE_INDEX).sum()
            batches += 1
        self.model.train(True)
        if loader is not None:
            loader.close()
        if recorded is not None:
            self._validation_cache[spec] = recorded
            logger.info(
                "validation: %d batches kept for later passes (%.1f MiB in all)",
                len(recorded), recorded_bytes / 2**20,
            )  # fmt: skip
            if disk is not None:
                held_out.save(*disk, recorded)
        loss_sum = distributed.all_reduce(loss_sum, dist.ReduceOp.SUM, loss_group)
        count = distributed.all_reduce(count, dist.ReduceOp.SUM, loss_group)
        return float(loss_sum), int(count)

    def close(self, abandon: bool = False) -> None:
        """Finish a save in flight and close the loggers; ``abandon`` (a rank was lost):
        leave the save in flight unfinished, as it would wait for the lost rank."""
        self.heartbeat.close()
        if heartbeat.ACTIVE is self.heartbeat:
            heartbeat.ACTIVE = None
        self.checkpointer.close(abandon=abandon or self._lost)
        self.metrics.close()


def _wandb_settings(cfg: JobConfig) -> dict | None:
    if not cfg.metrics.enable_wandb:
        return None
    return {
        "project": cfg.metrics.wandb_project,
        "name": cfg.metrics.wandb_run_name or cfg.job.description,
        "config": {s: asdict(getattr(cfg, s)) for s in asdict(cfg)},
    }


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (the caller divides by the global target count)."""
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def _nbytes(batches: list) -> int:
    """Bytes held by a list of (inputs, labels) batches."""
    return sum(t.numel() * t.element_size() for batch in batches for t in batch)


def full(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one (a loss under loss parallel)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
