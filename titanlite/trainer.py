"""The Trainer: the numbered set-up phases, then the loop. Reads top to bottom like a run.

This and ``train.py`` are the only modules that know every layer: config, data (one
builder), models and parallelisms (only through ``titanlite.assembly.assemble_model``, and
the spec it returns), optimizers (through their registry), checkpoints (only through the
Stateful registry), validation and metrics. What a component does lives in its own module.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.assembly import assemble_model
from titanlite.checkpoint.checkpointer import Checkpointer, ModelIdentity, will_load_weights
from titanlite.checkpoint.states import TrainState, build_states
from titanlite.checks import check
from titanlite.config import JobConfig, to_toml
from titanlite.config.batch_ramp import BatchRamp
from titanlite.config.layout import global_batch_size, gradient_accumulation_steps, resolve_degrees
from titanlite.data.batches import IGNORE_INDEX
from titanlite.data.build import build_training_data
from titanlite.data.documents import DocumentMask
from titanlite.downstream.evaluator import Evaluator
from titanlite.dtypes import DTYPES
from titanlite.ft import replicas as ft_replicas
from titanlite.ft.settings import data_share, group_folder
from titanlite.health.monitor import HealthMonitor
from titanlite.metrics import run_info
from titanlite.metrics.loggers import format_duration, model_state_bytes
from titanlite.metrics.moe_tracker import MoETracker
from titanlite.metrics.profiling import profiling
from titanlite.mup.parametrize import lr_scale as mup_lr_scale
from titanlite.optim import build_optimizers, clip_grad_norm_, step_metrics
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.pipeline import tied_copy
from titanlite.runtime import distributed, heartbeat, run_lock
from titanlite.runtime.stop_vote import StopVote
from titanlite.training.ema import WeightAverage
from titanlite.training.loss import StepLoss
from titanlite.training.stability import SpikeGuard, finite_or_guarded
from titanlite.training.validate import Validator

logger = logging.getLogger("titanlite.train")


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.startup = run_info.StartupClock()
        t, c = cfg.training, cfg.checkpoint
        self.lost = False  # a collective failed: a rank is gone, no collective may run
        self.model_state: dict[str, int] | None = None  # bytes, known after the first step
        # 1. Processes, devices and the layout. The stop vote's signal handlers go first: a
        # preemption during a long start-up must end with EXIT_PREEMPTED, not a kill.
        world_size = distributed.env_info()[1]
        cfg.job.dump_folder = group_folder(cfg.fault_tolerance, cfg.job.dump_folder)
        self.vote = StopVote(world_size, c.interval_minutes if c.enable else 0.0)
        self.tokenizer = check(cfg, world_size)
        self.dist = distributed.init(t.seed, cfg.comm.init_timeout_seconds)
        # One run per dump folder (titanlite.runtime.run_lock), before anything is written there.
        run_lock.take_for_run(cfg.job.dump_folder, self.dist, cfg.comm.init_timeout_seconds)
        # Who is alive, for naming a lost rank when a collective fails (runtime.heartbeat).
        self.heartbeat = heartbeat.Heartbeat(
            self.dist.rank, self.dist.world_size, cfg.comm.init_timeout_seconds
        )
        heartbeat.ACTIVE = self.heartbeat
        self.device = self.dist.device
        degrees = resolve_degrees(cfg, self.dist.world_size)
        self.accum_steps = gradient_accumulation_steps(cfg, degrees)
        self.global_batch = global_batch_size(cfg, degrees)
        self.ramp = BatchRamp.of(cfg, degrees)  # training.batch_size_schedule, seq_len_schedule
        self.dims = ParallelDims(degrees, self.device.type)
        self.cp = degrees.cp
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.startup.mark("distributed")

        # 2. Data: each rank reads its share of the same global batches.
        self.data = build_training_data(
            self.tokenizer,
            t,
            cfg.validation,
            **data_share(cfg.fault_tolerance, self.dims.batch_rank, self.dims.batch_size),
        )
        self.startup.mark("data")

        # 3. Model: meta device -> converters and parallelisms -> allocate and initialize the
        # local shards (not at all when a checkpoint is about to overwrite them).
        checkpoint_folder = Path(cfg.job.dump_folder) / c.folder
        documents = DocumentMask.of(t, self.tokenizer)  # (training.document_mask, or None)
        assembled = assemble_model(
            cfg,
            tokenizer_vocab=self.tokenizer.vocab_size,
            dims=self.dims,
            device=self.device,
            documents=documents,
            init_weights=not will_load_weights(c, checkpoint_folder),
        )
        self.spec, self.model_args, self.model = assembled.spec, assembled.args, assembled.model
        self.num_params = num_params = assembled.num_params
        self.active_params = assembled.active_params
        self.loss = self.model.loss_sum  # cross-entropy (+ z-loss, MTP): training/loss.py
        self.params = [p for part in self.model.parts for p in part.parameters() if p.requires_grad]
        # Under pipeline parallelism each rank holds some stages: norms add up over pp.
        self.stage_group = self.dims.group("pp") if degrees.pp > 1 else None
        # Mixture-of-experts layers: their balancing loss, routing-bias updates and metrics.
        self.moe = MoETracker.of(
            self.model.parts,
            self.dims.group("tokens"),
            global_batch=self.global_batch,
            grad_weight=self.dims.grad_average_size,
            stage_group=self.stage_group,
            n_layers=MoETracker.layer_count(self.model_args),
            seq_len=t.seq_len,
        )
        self.startup.mark("model")

        # 4. Optimization: one optimizer and schedule per model part (Muon: see optim/muon.py).
        replicated = degrees.dp_shard == 1 and degrees.dp_replicate * degrees.cp > 1
        self.optimizers, self.lr_schedulers, groups = build_optimizers(
            self.model.parts,
            cfg.optimizer,
            cfg.lr_scheduler,
            total_steps=t.steps,
            device=self.device,
            sections=cfg.components,
            roles=self.spec.param_roles,
            dims=self.dims,
            n_layers=self.model_args.n_layers,
            replica_group=self.dims.replica_group() if replicated else None,
            lr_scale=mup_lr_scale(assembled.mup),  # μP's AdamW factors ([mup])
        )
        for converter in assembled.converters:  # e.g. float8's FSDP scales after each step
            converter.attach(self.model.parts, self.optimizers)
        self.state = TrainState()
        self.startup.mark("optimizer")

        # 5. Outputs: run.json, metrics, validation.
        self.dump_folder = Path(cfg.job.dump_folder)
        throughput = run_info.Throughput.of(
            lambda n: self.spec.flops_per_token(self.model_args, n),
            t.seq_len,
            self.device,
            DTYPES[t.mixed_precision_param],
        )
        if self.dist.is_main:
            facts = run_info.RunFacts.of(
                cfg,
                self.spec.name,
                self.model_args,
                num_params=num_params,
                active_params=self.active_params,
                world_size=self.dist.world_size,
                degrees=degrees,
                global_batch_size=self.global_batch,
                gradient_accumulation_steps=self.accum_steps,
                throughput=throughput,
                tokenizer=self.tokenizer.path.as_posix(),
                init=self.model.materialize_stats,
                optimizer_groups=groups,
            )
            run_info.write_run_files(self.dump_folder, to_toml(cfg), facts)
        self.metrics = run_info.metrics_logger(cfg, self.dump_folder, self.dist.is_main)
        self.step_logger = run_info.StepLogger(throughput, self.metrics, t.steps)
        # Skips the update of a spiking or non-finite step; checkpointed inside train_state.
        self.guard = SpikeGuard.of(t, self.metrics.log, checkpointed=self.state.nested)
        self.validator = Validator.of(cfg, self.data.validation_sources, self.tokenizer, self.dims)
        self.evaluator = Evaluator.of(cfg, self.tokenizer, self.dims)
        # Stragglers, hangs and silent corruption ([health]: titanlite/health/).
        self.health = HealthMonitor.of(
            cfg.health,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            device=self.device,
            dump_folder=self.dump_folder,
            comm_timeout_s=cfg.comm.timeout_seconds,
            parts=self.model.parts,
            optimizers=self.optimizers,
            replica_group=self.dims.replica_group() if replicated else None,
        )
        self.startup.mark("outputs")

        # 6. Checkpoints: everything resumable, registered once; resume exactly where the
        # latest complete checkpoint left off.
        # Replica groups (fault_tolerance: titanlite/ft/): the quorum, the gradient average
        # across groups, the commit, and the state a group coming back heals from.
        self.replicas = ft_replicas.join(
            cfg.fault_tolerance,
            self.dist,
            model=self.model,
            optimizers=self.optimizers,
            schedulers=self.lr_schedulers,
            counters=self.state,
            log=self.metrics.log,
        )
        renames = [tied_copy(part, self.spec, self.model_args) for part in self.model.parts]
        self.ema = WeightAverage.of(self.model.parts, t.ema_decay, renames)  # training/ema.py
        states = (
            build_states(
                self.model.parts,
                self.optimizers,
                self.lr_schedulers,
                self.data.loader,
                train_state=self.state,
                renames=renames,
                ema=self.ema,
            )
            | self.replicas.checkpoint_states()
        )  # DiLoCo's outer state
        self.checkpointer = Checkpointer(
            states,
            c,
            checkpoint_folder,
            ModelIdentity(self.spec.name, asdict(self.model_args)),
            sidecar_fields={"tokenizer_source": cfg.model.tokenizer_path},
            is_main=self.dist.is_main,
            # The tokenizer travels inside: converting or generating from a checkpoint works
            # from any folder, wherever the original file was.
            write_files=lambda folder: {"tokenizer": self.tokenizer.copy_files(folder).name},
        )
        if self.checkpointer.load():
            self.metrics.log(
                {"step": self.state.step, "kind": "resume", "time": time.time()},
                f"resumed from checkpoint at step {self.state.step}",
            )
        self.train_iter = iter(self.data.loader)
        self.replicas.set_step(self.state.step)
        self.retry: list | None = None  # batches of a step the groups did not commit
        self.save_held = False  # a save due while DiLoCo could not take one
        self.startup.mark("checkpoint")

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        cfg, total = self.cfg, self.cfg.training.steps
        start = time.perf_counter()
        first_step = self.state.step + 1
        self.vote.stop_if_signalled_during_startup(first_step)
        self.step_logger.begin(first_step)
        try:
            with profiling(cfg.profiling, self.dump_folder, self.dist.rank, first_step) as prof:
                prof.watch(self.model.parts, self.optimizers)
                while self.state.step < total:
                    self.replicas.start_step()  # a group that was away heals here
                    if self.state.step >= total:
                        break
                    self.state.step += 1
                    step = self.state.step
                    self.heartbeat.beat(step)
                    self.health.step_started(step)
                    t0 = time.perf_counter()
                    batches = self.retry or self.ramp.take(step, self.train_iter, self.data.loader)
                    self.step_logger.waited_for_data(time.perf_counter() - t0)
                    self.health.data_ready()
                    log = step == first_step or step % cfg.metrics.log_freq == 0 or step == total
                    with self.step_logger.sync_check():
                        losses, grad_norm, extra = self.train_step(batches, log)
                    self.retry = None if self.committed else batches
                    if self.retry:  # a replica group failed during the step: run it again
                        self.state.step -= 1
                        continue
                    health = self.health.step_finished(step, log)  # stragglers, when logged
                    if step == first_step:
                        self.step_logger.startup_done(self.startup)
                        heartbeat.set_timeouts(cfg.comm.timeout_seconds)
                        self.heartbeat.set_timeout(cfg.comm.timeout_seconds)
                    # This rank's tokens (under context parallelism its share of each sequence).
                    self.step_logger.trained(batches, self.cp)
                    self.state.add_tokens(losses.n_tokens)
                    if log:  # only a logged step reduces its loss and reads values on the host
                        means = self.replicas.mean_over_groups(losses.mean())  # (all groups)
                        terms = dict(zip(self.loss.names, means.tolist(), strict=True))
                        loss, norm = terms.pop("loss"), float(grad_norm)
                        terms.update(finite_or_guarded(self.guard, loss, norm, step))
                        self.step_logger.log(
                            run_info.StepStats(
                                step,
                                loss,
                                norm,
                                self.last_lr,
                                self.state.tokens_seen,
                                sum(self.model_state.values()),
                                {**terms, **(extra or {}), **(health or {})},
                            )
                        )
                    with self.step_logger.paused():  # validation and saves are not training
                        self._after_step(step, last=step == total)
                    prof.step()
        except RuntimeError as e:
            if heartbeat.is_comm_failure(e) and self.dist.world_size > 1:
                self.lost = True  # no collective may run any more: not even the vote's
                raise heartbeat.CommFailure(heartbeat.failure_message(e)) from None
            raise
        finally:
            if not self.lost:
                self.vote.settle()  # no all-reduce left in flight, whatever ends the loop
        logger.info("data: %s", self.data.loader.describe())
        logger.info(
            "training finished: %d steps in %s", total, format_duration(time.perf_counter() - start)
        )

    def _after_step(self, step: int, last: bool) -> None:
        """Validation, downstream tasks, the stop vote and checkpoint saves, in that order."""
        self.health.after_step(step)  # replicas compare fingerprints at their interval
        for scorer in (self.validator, self.evaluator):  # validation loss, downstream tasks
            if scorer is not None and scorer.due(step, last):
                scorer.validate(self.model, step, self.metrics)
        stop, timed_save = self.vote.read()
        due = self.checkpointer.should_save(step, last=last) or timed_save or self.save_held
        # DiLoCo: no checkpoint while a fragment is in flight; a save or a stop waits for it.
        self.save_held = not self.replicas.can_save()
        if stop and not self.save_held:  # a preemption or Ctrl-C: save, then exit 75 or 130
            if self.cfg.checkpoint.enable:
                self.health.before_save(step)  # nothing from a corrupt rank is saved
                self.checkpointer.save(step, force_sync=True)
            raise self.vote.stopped(step, saved=self.cfg.checkpoint.enable)
        if due and not self.save_held:
            if timed_save:
                logger.info("saving at step %d: checkpoint.interval_minutes passed", step)
            self.health.before_save(step)
            self.checkpointer.save(step, last=last)
            self.vote.saved()
        self.save_held = due and self.save_held
        self.vote.start()
        self.checkpointer.poll()

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], log: bool = True
    ) -> tuple[StepLoss, torch.Tensor, dict[str, float] | None]:
        """One optimizer step over the micro-batches (no update if the spike guard skips it):
        loss terms (reduced when read), grad norm (unread) and, at ``log`` steps, MoE/QK-clip
        metrics."""
        # Every rank needs the global count of target tokens before backward: the loss is a
        # sum divided by it, so accumulation, parallelism and padding never change it. It
        # stays a device tensor (no host synchronization; NCCL reduces it asynchronously).
        local_tokens = sum((self.model.local_labels(y) != IGNORE_INDEX).sum() for _, y in batches)
        loss_group = self.dims.group("loss")
        if self.moe is not None:  # its losses are means over this step's global batch
            self.moe.set_global_batch(len(batches) * self.ramp.micro, batches[0][1].shape[1])
        # non_blocking: a blocking copy from the host waits for the stream (seen on an H100).
        tokens = torch.as_tensor(local_tokens).to(self.device, non_blocking=True)
        n_tokens = distributed.all_reduce(tokens, dist.ReduceOp.SUM, loss_group)
        # Data-parallel engines average gradients over the batch (x cp) ranks; undo that.
        scale = self.dims.grad_average_size / n_tokens
        loss_sums = torch.zeros(len(self.loss.names), device=self.device)
        for i, (inputs, labels) in enumerate(batches):
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self.model.grad_sync(i == len(batches) - 1):
                loss_sums += self.model.forward_backward(inputs, labels, scale)
        self.model.finish_gradients()
        self.replicas.average_gradients(self.params)
        self.health.optimizer_started()
        grad_norm = clip_grad_norm_(
            self.params, self.cfg.training.max_norm, self.stage_group, self.model.norm_skip
        )
        self.committed = self.replicas.should_commit()  # every group got through the step
        if not self.committed:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            return StepLoss(loss_sums, n_tokens, loss_group), grad_norm, None
        losses, step = StepLoss(loss_sums, n_tokens, loss_group), self.state.step
        update = self.guard is None or self.guard.accept(losses.mean()[0], grad_norm, step)
        self.last_lr = self.lr_schedulers[0].get_last_lr()[0]  # the rate this step uses
        for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers, strict=True):
            if update:
                optimizer.step()
            scheduler.step()  # a skipped step still counts
        if update and self.ema is not None:
            self.ema.update()
        # Routing biases move (when on) after an update; metrics only at log steps.
        extra = self.moe.after_step(log=log, update=update) if self.moe else None
        extra = (
            {**(extra or {}), **step_metrics(self.optimizers), **self.replicas.metrics()}
            if log
            else None
        )
        if self.model_state is None or not self.model_state["optimizer"]:  # after an update
            self.model_state = model_state_bytes(self.model.parts, self.optimizers)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return losses, grad_norm, extra

    def close(self, abandon: bool = False) -> None:
        """Finish a save in flight and close the loggers; ``abandon`` (a rank was lost):
        leave the save in flight unfinished, as it would wait for the lost rank."""
        self.heartbeat.close()
        self.health.close()
        self.replicas.close()
        if heartbeat.ACTIVE is self.heartbeat:
            heartbeat.ACTIVE = None
        self.checkpointer.close(abandon=abandon or self.lost)
        self.metrics.close()
        run_lock.release_held()  # rank 0's, once everything is written
