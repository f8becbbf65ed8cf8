"""Context parallelism: the split of each sequence (load-balanced chunks, positions), the
checks before launch, and the attention kernel against full causal attention on 2 and 4 gloo
ranks (float64, outputs and gradients), the windowed layers' exchange of only the keys their
windows reach, and the linear-attention layers' state passing on a Qwen3.5 hybrid. Training
parity of every CP layout is in test_parity.py, resume across CP degrees in
test_resume_layouts.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import cp_scenarios
import pytest
import torch
import train_scenarios
from pool import get_pool

from titanlite.checks import check
from titanlite.config import ConfigError, JobConfig, resolve_degrees
from titanlite.config.planned import PlannedRun
from titanlite.errors import Problems
from titanlite.metrics.compare import relative_difference
from titanlite.parallel.context.attention import chunk_positions
from titanlite.parallel.context.window import kv_bytes_received
from titanlite.parallel.rules import context as context_rule


def config(**parallelism: int) -> JobConfig:
    cfg = JobConfig()
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_chunks_cover_the_sequence_once_and_balance_causal_work(cp: int) -> None:
    seq = 16 * cp
    shares = [chunk_positions(seq // cp, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shares).tolist()) == list(range(seq))
    # Causal work of a rank = keys its queries see = sum of (position + 1): equal for all.
    work = {int((share + 1).sum()) for share in shares}
    assert len(work) == 1
    # One early and one late chunk: rank 0 holds the first and the last.
    assert shares[0][0] == 0 and shares[0][-1] == seq - 1


def test_degrees_include_the_context_dimension() -> None:
    d = resolve_degrees(config(context_parallel_degree=2, tensor_parallel_degree=2), 8)
    assert (d.dp_shard, d.cp, d.tp, d.loss, d.fsdp) == (2, 2, 2, 4, 4)
    assert d.describe() == "dp_shard=2 x cp=2 x tp=2"
    with pytest.raises(
        ConfigError,
        match=r"not divisible by data_parallel_replicate_degree x "
        r"context_parallel_degree x tensor_parallel_degree = 1 x 4 x 1",
    ):
        resolve_degrees(config(context_parallel_degree=4), 6)
    with pytest.raises(ConfigError, match="context_parallel_degree must be at least 1"):
        resolve_degrees(config(context_parallel_degree=0), 2)


@pytest.mark.parametrize(
    ("seq", "cp", "tp", "pp", "words"),
    [
        (96, 2, 2, 1, None),
        (
            98,
            2,
            1,
            1,
            r"seq_len 98 is not divisible by 2 x context_parallel_degree x "
            r"tensor_parallel_degree = 2 x 2 x 1 = 4",
        ),
        (80, 4, 4, 1, "seq_len 80 is not divisible by .* = 2 x 4 x 4 = 32"),
        (96, 2, 1, 2, "does not combine with pipeline parallelism"),
    ],
)
def test_context_parallel_layout_checks(
    seq: int, cp: int, tp: int, pp: int, words: str | None
) -> None:
    cfg = config(context_parallel_degree=cp, tensor_parallel_degree=tp, pipeline_parallel_degree=pp)
    cfg.training.seq_len = seq
    problems = Problems()
    degrees = resolve_degrees(cfg, cp * tp * pp)
    problems.lines += context_rule(PlannedRun(cfg, cp * tp * pp, degrees))
    if words is None:
        assert not problems.lines
    else:
        with pytest.raises(ConfigError, match=words):
            problems.raise_if_any(ConfigError)


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["flash", "mask"])
@pytest.mark.parametrize(("world", "kv_heads"), [(2, 4), (2, 2), (4, 1)])
def test_attention_kernel_matches_full_attention(world: int, kv_heads: int, masked: bool) -> None:
    diffs = get_pool(world).run(
        cp_scenarios.attention_matches_full, kv_heads=kv_heads, seq=8 * world, masked=masked
    )
    for rank, worst in enumerate(diffs):
        assert max(worst.values()) < 1e-12, (rank, worst)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_attention_kernel_with_documents_matches_a_block_causal_mask(world: int) -> None:
    diffs = get_pool(world).run(
        cp_scenarios.attention_matches_full,
        kv_heads=2,
        seq=8 * world,
        masked=False,
        documents=True,
    )
    for rank, worst in enumerate(diffs):
        assert max(worst.values()) < 1e-12, (rank, worst)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_windowed_attention_receives_only_what_its_windows_reach(world: int) -> None:
    """Chunks of 4 tokens; windows of 1 (nothing to receive), 3 (the 2-token tail of the
    chunk before), 5 (the whole chunk before), 7 (two chunks back) and the whole sequence (it
    reaches every key: the layer gathers), with and without documents and sinks: outputs,
    gradients (sinks' too) and QK-clip's largest logits of one process, float64."""
    seq, chunk = 8 * world, 4
    cases = [
        (1, False, True),
        (3, True, True),
        (5, False, True),
        (7, True, False),
        (seq, True, True),
    ]
    results = get_pool(world).run(cp_scenarios.window_matches_full, seq=seq, cases=cases)
    for rank, per_case in enumerate(results):
        for (window, _, sinks), diffs in zip(cases, per_case, strict=True):
            worst = max(v for key, v in diffs.items() if key != "received")
            assert worst < 1e-12, (rank, window, diffs)
            assert ("grad_sinks" in diffs) == sinks
            reach = window - 1
            if reach <= chunk:  # the tails before its chunks: one for the first and last rank
                assert diffs["received"] == reach * (1 if rank in (0, world - 1) else 2)
            elif window < seq:  # more, but less than the gather's (cp - 1) x local tokens
                assert 0 < diffs["received"] < (world - 1) * 2 * chunk, (rank, diffs)
            else:
                assert diffs["received"] is None
    # The byte count docs and benchmarks quote is what the busiest rank received (1 channel
    # of 1 byte: 2 per token, keys and values), the gather's where the layer gathered.
    for w, per_rank in zip(cases, zip(*results, strict=True), strict=True):
        received = [
            (world - 1) * 2 * chunk if d["received"] is None else d["received"] for d in per_rank
        ]
        assert kv_bytes_received(
            seq_len=seq, cp=world, window=w[0], batch=1, kv_channels=1, element_size=1
        ) == 2 * max(received), w


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "chunk", "documents"),
    [(2, 8, True), (2, 2, True), (4, 8, True), (4, 8, False)],
    ids=["cp2-docs", "cp2-short-chunks-docs", "cp4-docs", "cp4"],
)
def test_linear_attention_layers_match_one_process(world: int, chunk: int, documents: bool) -> None:
    """Gated DeltaNet layers under CP (each chunk's state from the chunks before it, the
    convolution's lead-in from the previous chunk; 2 tokens: shorter than the lead-in of 3)
    give one process's logits and gradients, documents restarting both across ranks."""
    results = get_pool(world).run(
        cp_scenarios.hybrid_matches_full, seq=2 * world * chunk, documents=documents
    )
    for rank, result in enumerate(results):
        assert max(result["out"], result["grads"]) < 1e-5, (rank, result)
        assert result["received_bytes"] > 0
    print(
        f"cp={world}, chunk {chunk}: rank 0 received {results[0]['received_bytes']} bytes "
        f"(keys and values: {results[0]['kv_bytes']})"
    )


def test_launcher_checks_report_the_context_parallel_problems() -> None:
    cfg = config(context_parallel_degree=4, pipeline_parallel_degree=2)
    cfg.training.seq_len = 100
    with pytest.raises(ConfigError) as info:
        check(cfg, 8)
    lines = str(info.value).split("\n")
    assert any("seq_len 100 is not divisible" in line for line in lines), lines
    assert any("does not combine with pipeline parallelism" in line for line in lines), lines


@pytest.mark.slow
def test_validation_loss_under_context_parallelism_matches_one_process(tmp_path: Path) -> None:
    """The held-out batches are split like the training ones: the same validation loss (and
    token count) on cp=2 x dp_shard=2 as in one process, global batch 4."""
    argv = [
        "--training.steps",
        "2",
        "--validation.freq",
        "2",
        "--validation.steps",
        "3",
        "--checkpoint.enable",
        "false",
        "--training.seq_len",
        "64",
        "--model.n_layers",
        "2",
    ]
    results = {}
    for world, layout in (
        (1, ["--training.local_batch_size", "4"]),
        (4, ["--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2"]),
    ):
        out = tmp_path / f"w{world}"
        run = get_pool(world).run(
            train_scenarios.train, argv=[*argv, *layout, "--job.dump_folder", str(out)]
        )[0]
        (record,) = [r for r in run["records"] if r.get("kind") == "validation"]
        results[world] = record
    assert results[1]["val_tokens"] == results[4]["val_tokens"] > 0
    assert relative_difference(results[1]["val_loss"], results[4]["val_loss"]) < 1e-6


def short_documents(path: Path, n: int = 400) -> Path:
    """A JSONL file of n short documents (5-40 words), so that most 64-token windows hold
    several documents and their boundaries."""
    rng = random.Random(0)
    words = "the nation congress people state union year government new world law".split()
    lines = [
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 40))).capitalize()})
        for _ in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_document_masking_under_context_parallelism_matches_one_process(tmp_path: Path) -> None:
    """training.document_mask (and restarted positions) on cp=2, 8 steps, global batch 8:
    the one-process masked losses to float32 round-off, and visibly unlike unmasked ones."""
    data = short_documents(tmp_path / "docs.jsonl")
    argv = [
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "false",
        "--training.seq_len",
        "64",
        "--model.n_layers",
        "2",
        "--training.local_batch_size",
        "8",
        "--training.dataset_path",
        str(data),
    ]
    masked = ["--training.document_mask", "true", "--training.document_positions", "true"]
    runs = {}
    for name, world, extra in (
        ("one", 1, masked),
        ("cp2", 2, [*masked, "--parallelism.context_parallel_degree", "2"]),
        ("unmasked", 1, []),
    ):
        out = tmp_path / name
        run = get_pool(world).run(
            train_scenarios.train, argv=[*argv, *extra, "--job.dump_folder", str(out)]
        )[0]
        runs[name] = [r["loss"] for r in run["records"] if "loss" in r]
    assert len(runs["one"]) == len(runs["cp2"]) == 8
    worst = max(relative_difference(a, b) for a, b in zip(runs["one"], runs["cp2"], strict=True))
    assert worst < 1e-6, (worst, runs)
    changed = max(
        relative_difference(a, b) for a, b in zip(runs["one"], runs["unmasked"], strict=True)
    )
    assert changed > 1e-4, runs
    print(f"document mask, cp=2 vs 1 process: {worst:.2g}; masked vs unmasked: {changed:.2g}")
