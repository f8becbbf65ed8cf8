"""Validator: the validation loss of a run, in the training loop.

Every pass reads the same held-out batches. The first pass's are kept (within
VALIDATION_CACHE_BYTES per rank), so later passes neither rescan the corpus for the held-out
documents nor tokenize them again; a text stream's are also kept on disk, for a restart in
the same dump folder (``titanlite.data.held_out``). With a mixture, each dataset's own loss
is reported too (val_loss_NAME), val_loss over all of them.

The loss is a sum over every rank's target tokens divided by their global count, as in
training, so it is the same under every layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config.job_config import JobConfig, Validation
from titanlite.data import held_out
from titanlite.data.base import Batch
from titanlite.data.batches import IGNORE_INDEX
from titanlite.data.build import build_dataloader
from titanlite.data.spec import DataSpec
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.tokens import is_token_folder
from titanlite.metrics.loggers import MetricsLogger
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallel_model import ParallelModel
from titanlite.runtime import distributed

logger = logging.getLogger("titanlite.train")

VALIDATION_CACHE_BYTES = 512 << 20
"""Validation batches a rank keeps in memory between passes (beyond it: read again)."""


class Validator:
    """Validation passes over the held-out split of each source, for one rank."""

    def __init__(
        self,
        config: Validation,
        sources: Sequence[tuple[str, DataSpec]],
        *,
        tokenizer: Tokenizer,
        batch_rank: int,
        batch_ranks: int,
        loss_group: dist.ProcessGroup,
        cache_folder: Path,
    ) -> None:
        """``sources``: (name, spec) of each source (one unnamed without a mixture);
        ``batch_rank`` of ``batch_ranks`` is this rank's share of each batch; the loss adds up
        over ``loss_group``; a text stream's batches are kept under ``cache_folder``."""
        self.config = config
        self.sources = list(sources)
        self.tokenizer = tokenizer
        self.batch_rank, self.batch_ranks = batch_rank, batch_ranks
        self.loss_group = loss_group
        self.cache_folder = cache_folder
        self._cache: dict[DataSpec, list[Batch]] = {}
        self._uncached: set[DataSpec] = set()

    @classmethod
    def of(
        cls,
        cfg: JobConfig,
        sources: Sequence[tuple[str, DataSpec]],
        tokenizer: Tokenizer,
        dims: ParallelDims,
    ) -> Validator:
        """The run's validator (batches cached under the dump folder's validation/)."""
        return cls(
            cfg.validation,
            sources,
            tokenizer=tokenizer,
            batch_rank=dims.batch_rank,
            batch_ranks=dims.batch_size,
            loss_group=dims.group("loss"),
            cache_folder=Path(cfg.job.dump_folder) / "validation",
        )

    def due(self, step: int, last: bool) -> bool:
        return self.config.enable and (step % self.config.freq == 0 or last)

    @torch.no_grad()
    def validate(self, model: ParallelModel, step: int, metrics: MetricsLogger) -> None:
        """One pass over every source; the results go to ``metrics`` (rank 0 writes)."""
        sums = [self._sums(model, spec) for _, spec in self.sources]
        total = sum(count for _, count in sums)
        if total == 0:
            logger.warning("validation split is empty; no validation loss")
            return
        val_loss = sum(loss for loss, _ in sums) / total
        record = {"step": step, "kind": "validation", "val_loss": val_loss, "val_tokens": total}
        parts = ""
        if len(self.sources) > 1 or self.sources[0][0]:  # a mixture: each dataset's own
            for (name, _), (loss, count) in zip(self.sources, sums, strict=True):
                if count:
                    record[f"val_loss_{name}"] = loss / count
            parts = " | " + ", ".join(
                f"{name} {record[f'val_loss_{name}']:.4f}"
                for name, _ in self.sources
                if f"val_loss_{name}" in record
            )
        metrics.log(
            record,
            f"validation at step {step} | val_loss {val_loss:7.4f}{parts} | {total:,} tokens",
        )

    def _kept(self, spec: DataSpec) -> tuple[list[Batch] | None, tuple[Path, str] | None]:
        """The batches of ``spec`` kept from an earlier pass (in memory, else on disk), and
        the disk file (path, key) where a text stream's batches go after a first pass."""
        cached = self._cache.get(spec)
        text = not is_token_folder(spec.dataset_path)  # a folder's windows are cheap to read
        if cached is not None or not text or spec in self._uncached:
            return cached, None
        key = held_out.batches_key(
            spec,
            self.tokenizer.fingerprint,
            dp_rank=self.batch_rank,
            dp=self.batch_ranks,
            steps=self.config.steps,
        )
        disk = (self.cache_folder / f"dp{self.batch_rank}-of-{self.batch_ranks}.pt", key)
        cached = held_out.load(*disk)
        # The same batches a scan would give, so ranks may differ in which read them; one kept
        # under a larger cache is read as a first pass would be.
        if cached is not None and self._kept_bytes() + _nbytes(cached) <= VALIDATION_CACHE_BYTES:
            self._cache[spec] = cached
            logger.info("validation: %d batches read from %s", len(cached), disk[0])
            return cached, disk
        return None, disk

    def _kept_bytes(self) -> int:
        return sum(_nbytes(kept) for kept in self._cache.values())

    def _sums(self, model: ParallelModel, spec: DataSpec) -> tuple[float, int]:
        """(summed loss, label count) over the validation split of ``spec``, all ranks."""
        cached, disk = self._kept(spec)
        recorded_bytes = self._kept_bytes()
        if cached is None:
            loader = build_dataloader(
                self.tokenizer, spec, self.batch_rank, self.batch_ranks, split="validation"
            )
            # Record the pass for later ones unless an earlier pass found it too big.
            it, recorded = iter(loader), None if spec in self._uncached else []
        else:
            loader, it, recorded = None, iter(cached), None
        device = next(model.parts[0].parameters()).device
        model.train(False)
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        count = torch.zeros((), device=device, dtype=torch.float64)
        batches = 0
        while self.config.steps == -1 or batches < self.config.steps:
            batch = next(it, None)
            if recorded is not None and batch is not None:
                recorded.append(batch)
                recorded_bytes += _nbytes([batch])
                if recorded_bytes > VALIDATION_CACHE_BYTES:  # the same on every rank
                    logger.info(
                        "validation: the batches are over the %d MiB cache; every pass reads "
                        "them again",
                        VALIDATION_CACHE_BYTES >> 20,
                    )
                    self._uncached.add(spec)
                    recorded = None
            # Every rank must run the same number of forwards (FSDP gathers inside them).
            have = distributed.all_reduce(
                torch.tensor(int(batch is not None)), dist.ReduceOp.MIN, self.loss_group
            )
            if not int(have):
                break
            inputs, labels = (t.to(device) for t in batch)
            loss_sum += model.evaluate(inputs, labels).double()
            count += (model.local_labels(labels) != IGNORE_INDEX).sum()
            batches += 1
        model.train(True)
        if loader is not None:
            loader.close()
        if recorded is not None:
            self._cache[spec] = recorded
            logger.info(
                "validation: %d batches kept for later passes (%.1f MiB in all)",
                len(recorded),
                recorded_bytes / 2**20,
            )
            if disk is not None:
                held_out.save(*disk, recorded)
        loss_sum = distributed.all_reduce(loss_sum, dist.ReduceOp.SUM, self.loss_group)
        count = distributed.all_reduce(count, dist.ReduceOp.SUM, self.loss_group)
        return float(loss_sum), int(count)


def _nbytes(batches: list[Batch]) -> int:
    """Bytes held by a list of (inputs, labels) batches."""
    return sum(t.numel() * t.element_size() for batch in batches for t in batch)
