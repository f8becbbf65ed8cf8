"""Shipped configs at their scale, parallel layout arithmetic, model-family keys, and the
preflight's exit codes and one-line errors (in-process and in real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_config import REPO, TRAIN_CONFIGS, write_toml

from titanlite import preflight
from titanlite.assembly import build_model_args
from titanlite.checks import check
from titanlite.config import (
    ConfigError,
    JobConfig,
    gradient_accumulation_steps,
    help_text,
    load_config,
    resolve_degrees,
)
from titanlite.config.parse import sections, tomllib, validate
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH

# --- shipped configs --------------------------------------------------------------------------


def test_train_configs_exist() -> None:
    assert {p.name for p in TRAIN_CONFIGS} >= {"debug_model.toml"}


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_has_no_unknown_keys(path: Path) -> None:
    cfg = load_config(["--job.config_file", str(path)])
    validate(cfg)
    # Every key written in the file is honoured (not silently defaulted).
    data = tomllib.loads(path.read_text())
    for section, table in data.items():
        for key, value in table.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


@pytest.mark.parametrize(
    ("name", "world_size", "vocab_size"),
    [
        ("debug_model.toml", 1, 4096),
        ("llama3_8b.toml", 8, 32000),
        ("llama3_70b.toml", 64, 32000),
        ("llama3_405b.toml", 2048, 128256),
        ("deepseek_v3_671b.toml", 2048, 129280),
        ("kimi_k2.toml", 2048, 163840),
    ],
)
def test_shipped_config_layout_is_valid_at_its_scale(
    name: str, world_size: int, vocab_size: int
) -> None:
    """Each recipe passes every launch check at its scale (as its dry run would: no tokenizer
    or data folder needed), and its layout divides its batch and heads."""
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / name)])
    dry = ["--job.dry_run", "--model.vocab_size", str(vocab_size)]
    check(load_config(["--job.config_file", str(REPO / "train_configs" / name), *dry]), world_size)
    degrees = resolve_degrees(cfg, world_size)
    assert degrees.world_size == world_size
    assert gradient_accumulation_steps(cfg, degrees) >= 1
    _, args = build_model_args(cfg, vocab_size)
    assert args.max_seq_len == cfg.training.seq_len
    assert args.n_heads % cfg.parallelism.tensor_parallel_degree == 0


def test_build_model_args_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="model.flavor.*'9B'.*8B"):
        build_model_args(load_config(["--model.flavor", "9B"]), 4096)
    with pytest.raises(ConfigError, match="n_heads"):
        build_model_args(load_config(["--model.n_heads", "7"]), 4096)


# --- layout arithmetic ------------------------------------------------------------------------


def layout(*argv: str) -> JobConfig:
    return load_config(list(argv))


def test_resolve_degrees_fills_shard_degree() -> None:
    d = resolve_degrees(layout(), 8)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (1, 8, 1)
    d = resolve_degrees(
        layout(
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.tensor_parallel_degree=4",
        ),
        16,
    )
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 2, 4)
    assert d.dp == 4 and d.world_size == 16


def test_resolve_degrees_explicit_product_must_match() -> None:
    cfg = layout(
        "--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2"
    )
    assert resolve_degrees(cfg, 4).world_size == 4
    with pytest.raises(ConfigError, match=r"1 x 2 x 2 = 4, but the world size is 8"):
        resolve_degrees(cfg, 8)


def test_resolve_degrees_not_divisible() -> None:
    cfg = layout(
        "--parallelism.data_parallel_replicate_degree=2", "--parallelism.tensor_parallel_degree=2"
    )
    with pytest.raises(ConfigError, match="world size 6 is not divisible") as info:
        resolve_degrees(cfg, 6)
    assert "data_parallel_replicate_degree" in str(info.value)


def test_gradient_accumulation_steps() -> None:
    cfg = layout("--training.local_batch_size=4", "--training.global_batch_size=64")
    assert gradient_accumulation_steps(cfg, resolve_degrees(cfg, 4)) == 4  # 64 / (4 x 4)
    assert gradient_accumulation_steps(cfg, resolve_degrees(cfg, 16)) == 1
    default = layout("--training.local_batch_size=4")
    assert gradient_accumulation_steps(default, resolve_degrees(default, 4)) == 1


def test_gradient_accumulation_steps_tp_does_not_count_as_data_parallel() -> None:
    cfg = layout(
        "--training.local_batch_size=2",
        "--training.global_batch_size=8",
        "--parallelism.tensor_parallel_degree=2",
    )
    assert gradient_accumulation_steps(cfg, resolve_degrees(cfg, 4)) == 2  # dp = 2


def test_gradient_accumulation_steps_not_divisible() -> None:
    cfg = layout("--training.local_batch_size=4", "--training.global_batch_size=24")
    with pytest.raises(ConfigError, match="training.global_batch_size 24") as info:
        gradient_accumulation_steps(cfg, resolve_degrees(cfg, 4))
    assert "16" in str(info.value)


# --- preflight and the train entry point ------------------------------------------------------
#
# Every preflight case runs through preflight.main(), the function `python -m titanlite.preflight`
# exits with; the exit-code/one-line/no-traceback contract is also checked end to end in real
# processes for one failing and one good config (each process pays ~3 s of torch import).

GOOD_CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def run_preflight(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], world: int
) -> tuple[int, str]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    capsys.readouterr()
    rc = preflight.main(["--job.config_file", *argv])
    return rc, capsys.readouterr().err


def one_line_error(rc: int, stderr: str) -> str:
    assert rc == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("titanlite: error: ")
    return lines[0]


def test_preflight_good_config(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    assert DEFAULT_TOKENIZER_PATH.is_file()
    assert run_preflight([GOOD_CONFIG], monkeypatch, capsys, world=2) == (0, "")


def test_preflight_unknown_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    path = write_toml(tmp_path, "[training]\nstesp = 5\n")
    line = one_line_error(*run_preflight([path], monkeypatch, capsys, world=1))
    assert "stesp" in line and "did you mean 'steps'" in line


def test_preflight_world_size_mismatch(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = [GOOD_CONFIG, "--parallelism.data_parallel_replicate_degree", "2"]
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=3))
    assert "parallelism" in line and "world size 3" in line
    assert run_preflight(argv, monkeypatch, capsys, world=4) == (0, "")


def test_preflight_global_batch_not_divisible(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = [GOOD_CONFIG, "--training.global_batch_size", "20"]  # local batch 8, dp 2
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=2))
    assert "training.global_batch_size 20" in line


def test_preflight_missing_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    missing = str(tmp_path / "no.model")
    argv = [GOOD_CONFIG, "--model.tokenizer_path", missing]
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=1))
    assert missing in line


def test_preflight_not_sentencepiece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a sentencepiece model\n" * 20)
    argv = [GOOD_CONFIG, "--model.tokenizer_path", str(garbage)]
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=1))
    assert str(garbage) in line and "sentencepiece" in line


def test_preflight_missing_dataset_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    missing = str(tmp_path / "corpus")
    argv = [GOOD_CONFIG, "--training.dataset_path", missing]
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=1))
    assert "training.dataset_path" in line and missing in line


def test_preflight_bad_model_shape(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = [GOOD_CONFIG, "--model.n_kv_heads", "3"]
    line = one_line_error(*run_preflight(argv, monkeypatch, capsys, world=1))
    assert "n_kv_heads 3" in line


def test_preflight_reports_every_layout_and_file_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The world size, the tokenizer and the data folder are wrong at once: three lines."""
    missing_tok, missing_data = str(tmp_path / "no.model"), str(tmp_path / "corpus")
    argv = [GOOD_CONFIG, "--parallelism.data_parallel_replicate_degree", "2"]
    argv += ["--model.tokenizer_path", missing_tok, "--training.dataset_path", missing_data]
    rc, stderr = run_preflight(argv, monkeypatch, capsys, world=3)
    assert rc == 2 and "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("titanlite: error: ") for line in lines)
    assert "world size 3" in lines[0] and missing_tok in lines[1] and missing_data in lines[2]


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """The real entry points as processes, run concurrently."""
    bad_key = tmp_path_factory.mktemp("preflight") / "bad_key.toml"
    bad_key.write_text("[training]\nstesp = 5\n")
    many = bad_key.with_name("many.toml")
    many.write_text('[training]\nstesp = 5\nseq_len = "x"\n[metrics]\nlog_freq = 0\n')
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    cases = {
        "unknown_key": ["-m", "titanlite.preflight", "--job.config_file", str(bad_key)],
        "good": ["-m", "titanlite.preflight", "--job.config_file", GOOD_CONFIG],
        "many_problems": ["-m", "titanlite.preflight", "--job.config_file", str(many)],
        "train_help": ["-m", "titanlite.train", "--help"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in cases.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def test_preflight_process_unknown_key(processes: dict[str, subprocess.CompletedProcess]) -> None:
    result = processes["unknown_key"]
    line = one_line_error(result.returncode, result.stderr)
    assert "did you mean 'steps'" in line
    assert result.stdout == ""


def test_preflight_process_many_problems(processes: dict[str, subprocess.CompletedProcess]) -> None:
    result = processes["many_problems"]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("titanlite: error: ") for line in lines)
    for want in ("stesp", "training.seq_len", "metrics.log_freq"):
        assert sum(want in line for line in lines) == 1, (want, lines)


def test_preflight_process_good_config(processes: dict[str, subprocess.CompletedProcess]) -> None:
    result = processes["good"]
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_train_help_lists_every_section(processes: dict[str, subprocess.CompletedProcess]) -> None:
    result = processes["train_help"]
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip() == help_text().strip()
    for section in sections():
        assert f"\n[{section}]\n" in result.stdout


def test_model_names_and_flavors_come_from_the_registry() -> None:
    """A new family is one folder and one registry line: config validation and --help find
    its name and flavors there, with nothing to add to the config schema."""
    from titanlite import models
    from titanlite.config import help_text

    text = help_text()
    assert f"one of: {', '.join(models.REGISTRY)}" in text
    for name, spec in models.REGISTRY.items():
        assert f"{name}: {', '.join(spec.flavors)}" in text
        load_config(["--model.name", name])  # accepted
    with pytest.raises(
        ConfigError, match=r"model.name: 'qwen' is not one of llama3, .*did you mean"
    ):
        load_config(["--model.name", "qwen"])


def test_override_of_another_family_is_a_config_error_naming_the_keys() -> None:
    cfg = load_config(["--model.name", "qwen3", "--model.multiple_of", "64"])
    with pytest.raises(ConfigError, match="multiple_of does not apply to qwen3.*head_dim"):
        build_model_args(cfg, 4096)
    cfg = load_config(["--model.head_dim", "64"])  # llama3 derives head_dim
    with pytest.raises(ConfigError, match="head_dim does not apply to llama3"):
        build_model_args(cfg, 4096)
