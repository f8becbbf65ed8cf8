"""What the data settings need of the rest of the run, checked before it starts (rules of
``titanlite.config.planned``). Plain Python."""

from __future__ import annotations

import os

from titanlite.config.planned import PlannedRun
from titanlite.data.tokens import is_token_folder
from titanlite.paths import resolve_path


def document_mask(run: PlannedRun) -> list[str]:
    """training.document_mask finds documents by the tokenizer's BOS/EOS and splits attention
    by them, which pipeline stages and compiled blocks cannot take yet."""
    t, lines = run.cfg.training, []
    if t.document_positions and not t.document_mask:
        lines.append("training.document_positions needs training.document_mask = true")
    if not t.document_mask:
        return lines
    if run.degrees is not None and run.degrees.pp > 1:
        lines.append(
            "training.document_mask does not combine with pipeline parallelism yet; set "
            "parallelism.pipeline_parallel_degree to 1"
        )
    if run.cfg.compile.enable:
        lines.append(
            "training.document_mask does not combine with compile.enable yet (blocks compile "
            "as whole graphs, and the split by document depends on the data)"
        )
    tokenizer = run.tokenizer
    if tokenizer is not None and tokenizer.bos_id < 0 and tokenizer.eos_id < 0:
        lines.append(
            "training.document_mask: the tokenizer has neither a BOS nor an EOS token to find "
            "document boundaries by"
        )
    return lines


def sources(run: PlannedRun) -> list[str]:
    """The data a run reads exists: training.dataset_path, each mixture entry's folder of
    token shards. A dry run reads no data: a cluster recipe's shared folder need not exist
    where it runs."""
    t, lines = run.cfg.training, []
    path = resolve_path(t.dataset_path)
    if path and not os.path.exists(path) and not t.datasets and not run.cfg.job.dry_run:
        lines.append(f"training.dataset_path: {path!r} does not exist")
    for i, entry in enumerate(t.datasets):
        folder = resolve_path(entry.path)
        if not os.path.isdir(folder):
            lines.append(f"training.datasets[{i}].path: {folder!r} is not a folder")
        elif not is_token_folder(folder):
            lines.append(
                f"training.datasets[{i}].path: {folder!r} is not a pre-tokenized folder "
                "(make one with scripts/pretokenize.py)"
            )
    return lines


RULES = (document_mask, sources)
