"""Evaluator: downstream multiple-choice tasks scored in the training loop.

Each question becomes one row per choice: the context's tokens (with BOS) then the choice's,
labelled only on the choice's tokens, so a row's summed loss is minus the choice's
log-likelihood. The questions are split over the data-parallel ranks (every tensor- and
context-parallel rank of a data-parallel rank scores the same rows), sorted by length and
batched; each rank's row sums are added up over the ranks that hold different rows or
different chunks of them (the loss group), so the result is the same under every layout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config.job_config import JobConfig
from titanlite.data.batches import IGNORE_INDEX
from titanlite.data.tokenizer import Tokenizer
from titanlite.downstream import builtin
from titanlite.downstream.settings import EvalSettings
from titanlite.downstream.tasks import Task, encode_pair, read_task
from titanlite.errors import UserError
from titanlite.metrics.loggers import MetricsLogger
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallel_model import ParallelModel
from titanlite.paths import resolve_path
from titanlite.runtime import distributed

logger = logging.getLogger("titanlite.train")


@dataclass(frozen=True)
class Row:
    index: int  # in the task's flat list of (question, choice) rows
    tokens: list[int]  # context then choice, the context cut from the left to fit
    choice_tokens: int


def load_tasks(config: EvalSettings, holdout_fraction: float) -> list[Task]:
    """The tasks ``config.tasks`` names (built-in names or JSONL files), ``limit`` each."""
    tasks = []
    for name in config.tasks:
        if name in builtin.NAMES:
            tasks.append(builtin.build(name, holdout_fraction, config.limit))
        else:
            task = read_task(Path(resolve_path(name)))
            questions = task.questions[: config.limit] if config.limit else task.questions
            tasks.append(Task(task.name, questions))
    return tasks


class Evaluator:
    """The downstream tasks of a run, for one rank."""

    def __init__(
        self,
        config: EvalSettings,
        tasks: list[Task],
        *,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_rank: int,
        batch_ranks: int,
        loss_group: dist.ProcessGroup,
        length_multiple: int = 1,
    ) -> None:
        """``batch_rank`` of ``batch_ranks`` scores its share of the questions; the sums add
        up over ``loss_group``; a batch's length is a multiple of ``length_multiple`` (what
        sequence and context parallelism split) and at most ``seq_len``."""
        self.config, self.tasks = config, tasks
        self.seq_len, self.multiple = seq_len, length_multiple
        self.batch_rank, self.batch_ranks = batch_rank, batch_ranks
        self.loss_group = loss_group
        self.pad = max(tokenizer.pad_id, 0)
        self.rows = [self._rows(task, tokenizer) for task in tasks]

    @classmethod
    def of(cls, cfg: JobConfig, tokenizer: Tokenizer, dims: ParallelDims) -> Evaluator | None:
        """The run's evaluator (None without ``eval.enable``); its tasks read and checked."""
        if not cfg.eval.enable:
            return None
        d = dims.degrees
        return cls(
            cfg.eval,
            load_tasks(cfg.eval, cfg.validation.holdout_fraction),
            tokenizer=tokenizer,
            seq_len=cfg.training.seq_len,
            batch_rank=dims.batch_rank,
            batch_ranks=dims.batch_size,
            loss_group=dims.group("loss"),
            length_multiple=2 * d.cp * d.tp if d.cp > 1 else d.tp,
        )

    def due(self, step: int, last: bool) -> bool:
        return self.config.enable and (step % self.config.freq == 0 or last)

    def _rows(self, task: Task, tokenizer: Tokenizer) -> list[Row]:
        """This rank's rows of ``task``, longest first; truncations are counted and logged."""
        rows, cut, index = [], 0, 0
        for q, question in enumerate(task.questions):
            for choice in question.choices:
                context, ids = encode_pair(tokenizer, question.context, choice)
                if not ids:
                    raise UserError(
                        f"eval.tasks: {task.name}, question {q + 1}: "
                        f"the choice {choice!r} encodes to no tokens"
                    )
                room = self.seq_len + 1 - len(ids)  # a row of n tokens is n - 1 inputs
                if room < 2:
                    raise UserError(
                        f"eval.tasks: {task.name}, question {q + 1}: a choice of {len(ids)} "
                        f"tokens does not fit training.seq_len {self.seq_len} with any context"
                    )
                if len(context) > room:
                    cut += 1
                if q % self.batch_ranks == self.batch_rank:
                    rows.append(Row(index, (context[-room:] + ids), len(ids)))
                index += 1
        if cut and self.batch_rank == 0:
            logger.warning(
                "eval: %s: %d of %d rows cut from the left to fit training.seq_len %d",
                task.name,
                cut,
                index,
                self.seq_len,
            )
        return sorted(rows, key=lambda r: -len(r.tokens))

    @torch.no_grad()
    def validate(self, model: ParallelModel, step: int, metrics: MetricsLogger) -> None:
        """Score every task; accuracies go to ``metrics`` (rank 0 writes). (Named as the
        Validator's pass: the trainer runs both the same way.)"""
        started = time.perf_counter()
        record: dict = {"step": step, "kind": "eval"}
        shown = []
        model.train(False)
        for task, rows in zip(self.tasks, self.rows, strict=True):
            sums, misses = self._row_scores(
                model, rows, sum(len(q.choices) for q in task.questions)
            )
            log_likelihoods = [-s for s in sums]
            name = f"eval_{task.name}"
            record[f"{name}_ll"] = right_log_likelihood(task, log_likelihoods)
            if task.completion:
                record[f"{name}_exact_match"] = sum(m == 0 for m in misses) / len(misses)
                shown.append(f"{task.name} exact_match {record[f'{name}_exact_match']:.3f}")
                continue
            acc, acc_norm = accuracies(task, log_likelihoods)
            record[f"{name}_acc"], record[f"{name}_acc_norm"] = acc, acc_norm
            shown.append(f"{task.name} acc {acc:.3f} acc_norm {acc_norm:.3f}")
        model.train(True)
        seconds = time.perf_counter() - started
        record["eval_seconds"] = seconds
        metrics.log(record, f"eval at step {step} | {' | '.join(shown)} | {seconds:.1f} s")

    def _row_scores(
        self, model: ParallelModel, rows: list[Row], total: int
    ) -> tuple[list[float], list[int]]:
        """Every row's summed loss and count of targets greedy decoding misses (all ranks'
        rows; each rank computes its own)."""
        device = next(model.parts[0].parameters()).device
        size = self.config.batch_size
        batches = [rows[i : i + size] for i in range(0, len(rows), size)]
        # Every rank runs the same number of forwards (FSDP gathers inside them).
        count = distributed.all_reduce(
            torch.tensor(len(batches)), dist.ReduceOp.MAX, self.loss_group
        )
        scores = torch.zeros(2, total, dtype=torch.float64, device=device)
        for i in range(int(count)):
            batch = batches[i] if i < len(batches) else []
            inputs, labels = self._tensors(batch, device)
            if batch:
                where = torch.tensor([row.index for row in batch], device=device)
                scores[:, where] = model.row_scores(inputs, labels).double()
            else:  # the padding row: the forward runs, its scores go nowhere
                model.row_scores(inputs, labels)
        scores = distributed.all_reduce(scores, dist.ReduceOp.SUM, self.loss_group)
        return scores[0].tolist(), [int(m) for m in scores[1].tolist()]

    def _tensors(self, batch: list[Row], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(inputs, labels) of a batch, padded to a length the layout splits; an empty batch
        (this rank has no rows left) is one padding row with no labels."""
        longest = max((len(r.tokens) - 1 for r in batch), default=1)
        length = min(-(-longest // self.multiple) * self.multiple, self.seq_len)
        n = max(len(batch), 1)
        inputs = torch.full((n, length), self.pad, dtype=torch.long)
        labels = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
        for i, row in enumerate(batch):
            tokens = torch.tensor(row.tokens)
            inputs[i, : len(tokens) - 1] = tokens[:-1]
            start = len(tokens) - 1 - row.choice_tokens
            labels[i, start : len(tokens) - 1] = tokens[-row.choice_tokens :]
        return inputs.to(device), labels.to(device)


def accuracies(task: Task, log_likelihoods: list[float]) -> tuple[float, float]:
    """(acc, acc_norm) of ``task`` from each row's log-likelihood (rows in question order):
    the choice with the largest log-likelihood, and the largest per character."""
    right = right_norm = 0
    at = 0
    for q in task.questions:
        scores = log_likelihoods[at : at + len(q.choices)]
        at += len(q.choices)
        per_char = [s / len(c) for s, c in zip(scores, q.choices, strict=True)]
        right += max(range(len(scores)), key=scores.__getitem__) == q.label
        right_norm += max(range(len(per_char)), key=per_char.__getitem__) == q.label
    return right / len(task.questions), right_norm / len(task.questions)


def right_log_likelihood(task: Task, log_likelihoods: list[float]) -> float:
    """The mean log-likelihood of the right choices (rows in question order)."""
    total, at = 0.0, 0
    for q in task.questions:
        total += log_likelihoods[at + q.label]
        at += len(q.choices)
    return total / len(task.questions)
