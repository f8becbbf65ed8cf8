"""--job.dry_run: the layout of a large job checked in one local process, and with
--job.dry_run_init_rank one rank's real shards allocated and initialized on this CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_train, subprocess_env
from test_preflight import one_line_error, run_preflight

CONFIG_405B = str(REPO / "train_configs" / "llama3_405b.toml")


@pytest.mark.slow
def test_multi_node_dry_run_needs_no_rendezvous_and_sizes_the_shards(tmp_path: Path) -> None:
    """The README's command as pasted: NNODES > 1 without RDZV_ENDPOINT is fine for a dry run."""
    result = run_train(
        tmp_path,
        CONFIG_405B,
        "--job.dry_run",
        "--model.vocab_size",
        "128256",
        ngpu=8,
        NNODES="256",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dry run: llama3/405B on 2048 ranks" in out
    assert "mesh            dp_shard=256 x tp=8" in out
    assert "405,853,388,800" in out
    assert "init rank" not in out  # nothing allocated without dry_run_init_rank


@pytest.mark.slow
def test_dry_run_init_rank_allocates_and_initializes_one_ranks_shards(tmp_path: Path) -> None:
    # Llama 3 1B on 64 ranks (dp_shard 16 x tp 4): ~19 M elements for rank 37.
    result = run_train(
        tmp_path,
        CONFIG_405B,
        "--model.flavor",
        "1B",
        "--job.dry_run",
        "--model.vocab_size",
        "128256",
        "--parallelism.tensor_parallel_degree",
        "4",
        "--job.dry_run_init_rank",
        "37",
        ngpu=8,
        NNODES="8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    local = int(re.search(r"([\d,]+) on rank 37", out).group(1).replace(",", ""))
    init = re.search(r"init rank 37\s+([\d,]+) elements \(([\d.]+) GiB\).* in ([\d.]+) s", out)
    assert init, out
    assert int(init.group(1).replace(",", "")) == local  # every local element, no more
    assert abs(float(init.group(2)) - local * 4 / 2**30) < 1e-3
    ratio = float(re.search(r"= ([\d.]+) x the shard", out).group(1))
    assert 0.5 < ratio < 2.0, out  # the bound: peak memory under twice the shard
    assert "values all finite" in out


def test_init_rank_outside_the_layout_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [CONFIG_405B, "--job.dry_run", "--model.vocab_size", "128256"]
    line = one_line_error(
        *run_preflight([*argv, "--job.dry_run_init_rank", "64"], monkeypatch, capsys, world=64)
    )
    assert "job.dry_run_init_rank 64" in line and "world size 64" in line
    line = one_line_error(
        *run_preflight([CONFIG_405B, "--job.dry_run_init_rank", "3"], monkeypatch, capsys, world=64)
    )
    assert "needs --job.dry_run" in line


def test_pipeline_dry_run_sizes_one_ranks_stages_and_their_activations(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """405B on 2,048 ranks with pp 16 (x dp_shard 16 x tp 8): rank 0 holds stage 0 of 16,
    about 1/16 of the model state of dp_shard 16 x tp 8 without PP (128 ranks); the
    activations line follows the schedule's peak."""
    from titanlite import preflight

    base = [CONFIG_405B, "--job.dry_run", "--model.vocab_size", "128256"]
    pp = ["--parallelism.pipeline_parallel_degree", "16", "--training.local_batch_size", "16"]
    state = {}
    for name, world, argv in (("no_pp", "128", base), ("pp16", "2048", [*base, *pp])):
        monkeypatch.setenv("WORLD_SIZE", world)
        capsys.readouterr()
        assert preflight.main(["--job.config_file", *argv]) == preflight.EXIT_NO_LAUNCH
        out = capsys.readouterr().out
        state[name] = float(re.search(r"model state\s+([\d.]+) GiB per rank", out).group(1))
    assert "mesh            pp=16 x dp_shard=16 x tp=8" in out
    assert "1F1B, 16 stages (14 x 8, 2 x 7 blocks), 16 micro-batches" in out  # 126 blocks
    assert "this rank runs stage(s) 0" in out
    sets = int(re.search(r"peak: (\d+) \(micro-batch, stage\) sets", out).group(1))
    assert sets == 16  # 1F1B's rank 0 keeps min(micro-batches, pp) = 16
    assert 0.9 < state["no_pp"] / state["pp16"] / 16 < 1.1, state


def test_dry_run_sizes_context_parallel_activations() -> None:
    """Llama 3 8B, 32K tokens per sequence on 32 ranks: with cp=4 each rank keeps about a
    quarter of the activations (its chunks, plus the gathered keys and values), and FSDP
    shards over dp_shard x cp, so the model state per rank is the same as at cp=1."""
    from titanlite.config import load_config
    from titanlite.dry_run import dry_run

    reports = {}
    for cp in (1, 4):
        cfg = load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs" / "llama3_8b.toml"),
                "--training.seq_len",
                "32768",
                "--training.local_batch_size",
                "1",
                "--parallelism.tensor_parallel_degree",
                "4",
                "--parallelism.context_parallel_degree",
                str(cp),
            ]
        )
        reports[cp] = dry_run(cfg, 32, 128256)
    gib = {
        cp: float(re.search(r"activations\s+~([\d.]+) GiB", out).group(1))
        for cp, out in reports.items()
    }
    assert 0.2 < gib[4] / gib[1] < 0.35, reports
    assert "8,192 tokens of each sequence" in reports[4]
    assert "mesh            dp_shard=2 x cp=4 x tp=4" in reports[4]
    state = {
        cp: re.search(r"model state\s+([\d.]+) GiB", out).group(1) for cp, out in reports.items()
    }
    assert state[1] == state[4], reports


def test_dry_run_counts_only_the_keys_a_window_reaches_under_context_parallelism() -> None:
    """gpt-oss's debug shape at cp 2, 4,096 tokens: a windowed layer keeps its two chunks'
    spans of keys and values (busiest rank: 2 x (1,024 + 127) = 2,302 rows), not the whole
    gathered sequence (4,096). Pattern "GL" keeps block 0 (the probe the dry run measures a
    block on) global either way, so the two estimates differ by the 2 windowed layers' keys
    and values alone: 2 x 2 x 64 sequences x (4,096 - 2,302) rows x 128 channels x 4 bytes."""
    from titanlite.config import load_config
    from titanlite.dry_run import dry_run

    gib = {}
    for window in (128, 0):
        cfg = load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs" / "gpt_oss_debug.toml"),
                "--training.seq_len",
                "4096",
                "--training.local_batch_size",
                "64",
                "--parallelism.context_parallel_degree",
                "2",
                "--model.window_pattern",
                "GL",
                "--model.sliding_window",
                str(window),
            ]
        )
        out = dry_run(cfg, 2, 2000)
        gib[window] = float(re.search(r"activations\s+~([\d.]+) GiB", out).group(1))
    kept_less = 2 * 2 * 2 * 64 * (4096 - 2302) * 128 * 4 / 2**30  # 0.44 GiB
    assert gib[128] < gib[0], gib
    assert abs(gib[0] - gib[128] - kept_less) < 0.015, (gib, kept_less)


MOE_CONFIG = str(REPO / "train_configs" / "qwen3_moe_debug.toml")


def _figure(pattern: str, out: str) -> str:
    found = re.search(pattern, out)
    assert found, (pattern, out)
    return found.group(1)


@pytest.mark.slow  # seconds each: the fast subset stays under a minute
def test_moe_dry_run_sizes_qwen3_235b_on_256_ranks_under_expert_parallelism(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: Qwen3-235B-A22B (94 layers of 128 experts, top-8, dim 4096, expert
    width 1536) on 256 ranks, bf16, 4,096-token sequences, at ep 8 and ep 16. Expert
    parallelism borrows its ranks from dp_shard, so every rank keeps 128 / 256 experts' worth
    of model state whatever ep is (FSDP splits each expert in two: 16 or 8 of them over 32 or
    16 ranks); what ep shrinks is the experts a block gathers (128 / ep), and what it costs
    is all-to-all traffic."""
    from titanlite import preflight

    layers, dim, hidden, top_k, tokens = 94, 4096, 1536, 8, 4096
    expert_elements = 3 * dim * hidden  # w1, w3, w2 of one expert
    base = [
        MOE_CONFIG,
        "--job.dry_run",
        "--model.flavor",
        "235B-A22B",
        "--model.vocab_size",
        "151936",
        "--training.seq_len",
        str(tokens),
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "bfloat16",
    ]
    monkeypatch.setenv("WORLD_SIZE", "256")
    figures = {}
    for ep in (8, 16):
        capsys.readouterr()
        argv = [*base, "--parallelism.expert_parallel_degree", str(ep)]
        assert preflight.main(["--job.config_file", *argv]) == preflight.EXIT_NO_LAUNCH
        out = capsys.readouterr().out
        assert "dry run: qwen3_moe/235B-A22B on 256 ranks" in out
        assert f"mesh            dp_shard=256 (ep={ep} within dp_shard)" in out
        split = f"split {128 // ep} per ep rank (ep={ep}), then FSDP-sharded over the other "
        assert f"{split}{256 // ep} dp_shard ranks" in out
        figures[ep] = {
            "state": _figure(r"model state\s+([\d.]+) GiB per rank", out),
            "experts": int(_figure(r"model state \(([\d,]+) elements\)", out).replace(",", "")),
            "gathered": float(_figure(r"\+ ([\d.]+) for its \d+ experts", out)),
            "sent": int(_figure(r"GiB \(([\d,]+) bytes\) sent per step", out).replace(",", "")),
        }
        # An even share: half an expert per layer (before, one whole one on half the ranks).
        assert figures[ep]["experts"] == layers * expert_elements // 2, out
        assert "0.50 experts' worth here per layer (an even share: 0.50)" in out
        assert abs(figures[ep]["gathered"] - 128 // ep * expert_elements * 2 / 2**30) < 0.006
        # Dispatch + combine, forward + backward: 4 passes of the slots leaving the rank.
        slots_leaving = tokens * top_k * (ep - 1) // ep
        assert figures[ep]["sent"] == 4 * layers * slots_leaving * dim * 2, out
    assert figures[8]["state"] == figures[16]["state"], figures
    assert figures[8]["experts"] == figures[16]["experts"], figures
    assert 1.95 < figures[8]["gathered"] / figures[16]["gathered"] < 2.05, figures
    assert figures[16]["sent"] * 14 == figures[8]["sent"] * 15, figures  # 15/16 vs 7/8 leave


@pytest.mark.slow  # seconds each: the fast subset stays under a minute
def test_moe_dry_run_sizes_qwen3_5_397b_a17b(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3.5-397B-A17B (60 hybrid blocks of 512 experts, top-10, dim 4096, expert width
    1024, a gated shared expert) on 256 ranks at ep 16, bf16, 4,096-token sequences: the
    parameters are the published model's (tests/test_qwen3_5.py checks them against
    transformers), each rank keeps two experts' worth per block, and the all-to-all is the
    formula's."""
    from titanlite import preflight

    layers, dim, top_k, tokens = 60, 4096, 10, 4096
    argv = [
        MOE_CONFIG,
        "--job.dry_run",
        "--model.name",
        "qwen3_5_moe",
        "--model.flavor",
        "397B-A17B",
        "--model.vocab_size",
        "248320",
        "--training.seq_len",
        str(tokens),
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "bfloat16",
        "--parallelism.expert_parallel_degree",
        "16",
    ]
    monkeypatch.setenv("WORLD_SIZE", "256")
    assert preflight.main(["--job.config_file", *argv]) == preflight.EXIT_NO_LAUNCH
    out = capsys.readouterr().out
    assert "dry run: qwen3_5_moe/397B-A17B on 256 ranks" in out
    assert "parameters      396,346,350,336 (396.35 B)" in out, out
    assert "512 experts split 32 per ep rank (ep=16)" in out, out
    assert "2.00 experts' worth here per layer (an even share: 2.00)" in out, out
    sent = 4 * layers * (tokens * top_k * 15 // 16) * dim * 2
    assert f"({sent:,} bytes) sent per step per rank" in out, out


def test_moe_dry_run_all_to_all_bytes_follow_the_formula() -> None:
    """The debug MoE (4 layers of 8 experts, top-2, dim 256) on 8 ranks at ep 4, float32,
    2 micro-batches of 2 x 256 tokens per step, full activation checkpointing (each forward's
    dispatch and combine run again in backward): the figure computed here by hand. Without
    expert parallelism there is no all-to-all, and each rank keeps all experts over dp_shard."""
    from titanlite.config import load_config
    from titanlite.dry_run import dry_run

    def report(ep: int) -> str:
        cfg = load_config(
            [
                "--job.config_file",
                MOE_CONFIG,
                "--training.seq_len",
                "256",
                "--training.local_batch_size",
                "2",
                "--training.global_batch_size",
                "32",
                "--activation_checkpoint.mode",
                "full",
                "--parallelism.expert_parallel_degree",
                str(ep),
            ]
        )
        return dry_run(cfg, 8, 4096)

    out = report(4)
    tokens = 2 * 2 * 256  # micro-batches x sequences x seq_len on this rank
    passes = 4 * (2 + 2 + 2)  # layers x (forward 2, backward 2, recomputed forward 2)
    expected = passes * tokens * 2 * 3 // 4 * 256 * 4  # x top_k x 3/4 off-rank x dim x fp32
    assert f"({expected:,} bytes) sent per step per rank" in out, out
    assert "4 MoE layers x 4 + 4 recomputed x 2 passes" in out
    # 8 experts over 8 dp_shard ranks (2 per ep rank, then over 2): one per layer per rank.
    elements = int(_figure(r"model state \(([\d,]+) elements\)", out).replace(",", ""))
    assert elements == 4 * 3 * 256 * 256, out
    assert "all-to-all      none" in report(1)


@pytest.mark.slow  # a process start or a pool run: not for the fast subset
def test_the_training_module_dry_runs_gpt_oss_120b_without_building_it(tmp_path: Path) -> None:
    """`python -m titanlite.train --job.dry_run` without the launcher prints the report and
    exits 0, as ./run_train.sh's preflight does. It used to start a Trainer instead: gpt-oss
    120b at 4,096 tokens built and initialized 117 B real parameters (over 12 minutes and
    7.7 GB before it was stopped)."""
    argv = [
        "--job.dry_run",
        "true",
        "--model.name",
        "gpt_oss",
        "--model.flavor",
        "120b",
        "--model.vocab_size",
        "201088",
        "--training.seq_len",
        "4096",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "titanlite.train", *argv],
        cwd=REPO,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run: gpt_oss/120b on 1 ranks" in result.stdout, result.stdout
    total = int(_figure(r"parameters\s+([\d,]+)", result.stdout).replace(",", ""))
    assert abs(total / 116.83e9 - 1) < 0.005  # OpenAI's model card
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
