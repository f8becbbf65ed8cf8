"""Config: TOML/CLI precedence, every user-facing error names its key, --help documents every
field, the resolved config round-trips, parallel layout arithmetic, and the preflight exit codes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from titanlite.config import (
    ConfigError,
    JobConfig,
    catalog,
    help_text,
    load_config,
    parse_cli,
    to_toml,
)
from titanlite.config.parse import apply_toml, tomllib
from titanlite.config.schema import field_docs, keys, sections

REPO = Path(__file__).resolve().parent.parent
TRAIN_CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def write_toml(tmp_path: Path, text: str, name: str = "cfg.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return str(info.value)


# --- precedence and CLI syntax ----------------------------------------------------------------


def test_defaults_without_arguments() -> None:
    assert load_config([]) == JobConfig()


def test_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        "[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 1e-3\n"
        '[job]\ndescription = "toml"\n',
    )
    cfg = load_config(["--job.config_file", path, "--training.steps", "7", "--job.description=cli"])
    assert cfg.training.steps == 7  # CLI beats TOML
    assert cfg.job.description == "cli"
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert cfg.job.config_file == path


def test_cli_order_does_not_matter_for_config_file(tmp_path: Path) -> None:
    """The TOML is applied first even when --job.config_file comes after the override."""
    path = write_toml(tmp_path, "[training]\nsteps = 50\n")
    cfg = load_config(["--training.steps", "7", "--job.config_file", path])
    assert cfg.training.steps == 7


def test_space_and_equals_forms_are_equivalent() -> None:
    spaced = load_config(["--optimizer.lr", "0.01", "--lr_scheduler.decay_type", "cosine"])
    equals = load_config(["--optimizer.lr=0.01", "--lr_scheduler.decay_type=cosine"])
    assert spaced == equals
    assert spaced.optimizer.lr == 0.01 and spaced.lr_scheduler.decay_type == "cosine"


def test_equals_form_keeps_everything_after_the_first_equals() -> None:
    cfg = load_config(["--job.description=a=b c"])
    assert cfg.job.description == "a=b c"


def test_negative_number_is_a_value_not_an_option() -> None:
    cfg = load_config(["--training.global_batch_size", "-1", "--validation.steps", "-1"])
    assert cfg.training.global_batch_size == -1
    assert cfg.validation.steps == -1


def test_bare_boolean_flag_means_true() -> None:
    cfg = load_config(["--job.dry_run", "--training.steps", "3"])
    assert cfg.job.dry_run is True
    assert cfg.training.steps == 3
    assert load_config(["--validation.enable"]).validation.enable is True  # last token


@pytest.mark.parametrize(
    ("raw", "expected"), [("false", False), ("0", False), ("off", False), ("true", True)]
)
def test_boolean_flag_with_value(raw: str, expected: bool) -> None:
    assert load_config(["--job.dry_run", raw]).job.dry_run is expected
    assert load_config([f"--job.dry_run={raw}"]).job.dry_run is expected


def test_cli_can_unset_an_optional_override_from_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[lr_scheduler]\ndecay_ratio = 0.2\n[model]\ndim = 512\n")
    assert load_config(["--job.config_file", path]).lr_scheduler.decay_ratio == 0.2
    cfg = load_config(["--job.config_file", path, "--lr_scheduler.decay_ratio", "none"])
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.model.dim == 512


def test_toml_integer_accepted_for_float_field(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[optimizer]\nlr = 1\n")
    lr = load_config(["--job.config_file", path]).optimizer.lr
    assert lr == 1.0 and isinstance(lr, float)


def test_help_flag_is_reported_not_parsed_as_option() -> None:
    assert parse_cli(["--training.steps", "3", "--help"]) == (True, {"training.steps": "3"})
    assert parse_cli(["-h"])[0] is True
    assert parse_cli(["--training.steps=3"]) == (False, {"training.steps": "3"})


# --- errors name the key ----------------------------------------------------------------------


def test_unknown_toml_section_names_it(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[trainig]\nsteps = 5\n")
    msg = config_error(["--job.config_file", path])
    assert "trainig" in msg and "[training]" in msg  # suggestion
    assert path in msg


def test_unknown_toml_key_suggests_the_right_one(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nstesp = 5\n")
    msg = config_error(["--job.config_file", path])
    assert "stesp" in msg
    assert "did you mean 'steps'" in msg
    assert "[training]" in msg


def test_toml_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "training = 5\n")
    assert "training" in config_error(["--job.config_file", path])


def test_unknown_cli_option_suggests_the_right_one() -> None:
    msg = config_error(["--training.setps", "5"])
    assert "--training.setps" in msg
    assert "did you mean '--training.steps'" in msg


def test_unknown_cli_section_and_missing_field_name() -> None:
    assert "--nosuch.key" in config_error(["--nosuch.key", "1"])
    assert "--training" in config_error(["--training", "1"])


@pytest.mark.parametrize(
    ("toml", "key", "expected"),
    [
        ('[training]\nsteps = "ten"\n', "training.steps", "integer"),
        ("[training]\nsteps = 10.0\n", "training.steps", "integer"),
        ("[training]\nsteps = true\n", "training.steps", "integer"),
        ("[job]\ndry_run = 1\n", "job.dry_run", "true or false"),
        ('[job]\ndry_run = "true"\n', "job.dry_run", "true or false"),
        ("[optimizer]\nlr = true\n", "optimizer.lr", "number"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr", "finite"),
        ("[optimizer]\nlr = inf\n", "optimizer.lr", "finite"),
        ("[job]\ndescription = 3\n", "job.description", "string"),
        ("[model]\ndim = 1.5\n", "model.dim", "integer"),
    ],
)
def test_wrong_type_in_toml_names_key(tmp_path: Path, toml: str, key: str, expected: str) -> None:
    path = write_toml(tmp_path, toml)
    msg = config_error(["--job.config_file", path])
    assert key in msg and expected in msg


@pytest.mark.parametrize(
    ("argv", "key", "expected"),
    [
        (["--training.steps", "ten"], "--training.steps", "integer"),
        (["--training.steps", "1.5"], "--training.steps", "integer"),
        (["--job.dry_run", "maybe"], "--job.dry_run", "true or false"),
        (["--optimizer.lr", "fast"], "--optimizer.lr", "number"),
        (["--optimizer.lr", "nan"], "--optimizer.lr", "finite"),
        (["--optimizer.lr=-inf"], "--optimizer.lr", "finite"),
        (["--training.steps", "none"], "--training.steps", "integer"),  # not optional
    ],
)
def test_wrong_type_on_cli_names_key(argv: list[str], key: str, expected: str) -> None:
    msg = config_error(argv)
    assert key in msg and expected in msg


def test_literal_mismatch_lists_choices_and_suggests() -> None:
    msg = config_error(["--lr_scheduler.decay_type", "cosin"])
    assert "--lr_scheduler.decay_type" in msg
    assert "did you mean 'cosine'" in msg
    for choice in ("linear", "sqrt", "cosine"):
        assert choice in msg


def test_literal_mismatch_in_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[optimizer]\nimplementation = "fuzed"\n')
    msg = config_error(["--job.config_file", path])
    assert "optimizer.implementation" in msg and "did you mean 'fused'" in msg


def test_missing_toml_file_names_path(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    msg = config_error(["--job.config_file", path])
    assert path in msg and "not found" in msg


def test_malformed_toml_names_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training\nsteps = \n")
    msg = config_error(["--job.config_file", path])
    assert path in msg and "TOML" in msg


def test_missing_cli_value_names_option() -> None:
    msg = config_error(["--training.steps"])
    assert "--training.steps" in msg and "missing value" in msg


def test_option_followed_by_option_is_a_missing_value() -> None:
    msg = config_error(["--job.description", "--job.dry_run"])
    assert "--job.description" in msg and "missing value" in msg
    assert parse_cli(["--job.dry_run", "-h"]) == (True, {"job.dry_run": True})


def test_positional_argument_is_rejected() -> None:
    msg = config_error(["train_configs/debug_model.toml"])
    assert "train_configs/debug_model.toml" in msg
    msg = config_error(["--training.steps", "3", "4"])
    assert "'4'" in msg


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--training.steps", "0"], "training.steps"),
        (["--training.seq_len", "0"], "training.seq_len"),
        (["--training.local_batch_size", "0"], "training.local_batch_size"),
        (["--training.global_batch_size", "0"], "training.global_batch_size"),
        (["--training.max_norm", "-1"], "training.max_norm"),
        (["--optimizer.lr", "0"], "optimizer.lr"),
        (["--optimizer.lr", "-1e-3"], "optimizer.lr"),
        (["--optimizer.eps", "0"], "optimizer.eps"),
        (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
        (["--optimizer.beta1", "1"], "optimizer.beta1"),
        (["--optimizer.beta2", "1.5"], "optimizer.beta2"),
        (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps"),
        (["--lr_scheduler.decay_ratio", "1.01"], "lr_scheduler.decay_ratio"),
        (["--lr_scheduler.decay_ratio", "-0.1"], "lr_scheduler.decay_ratio"),
        (["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--validation.freq", "0"], "validation.freq"),
        (["--validation.steps", "0"], "validation.steps"),
        (["--validation.holdout_fraction", "1"], "validation.holdout_fraction"),
        (
            ["--validation.enable", "--validation.holdout_fraction", "0"],
            "validation.holdout_fraction",
        ),
        (
            ["--parallelism.data_parallel_replicate_degree", "0"],
            "parallelism.data_parallel_replicate_degree",
        ),
        (
            ["--parallelism.data_parallel_shard_degree", "0"],
            "parallelism.data_parallel_shard_degree",
        ),
        (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree"),
        (["--parallelism.ddp_bucket_cap_mb", "0"], "parallelism.ddp_bucket_cap_mb"),
    ],
)
def test_out_of_range_values_name_the_key(argv: list[str], key: str) -> None:
    msg = config_error(argv)
    assert msg.startswith(key), msg


def test_seed_out_of_range_is_a_config_error() -> None:
    msg = config_error(["--training.seed", str(10**14)])
    assert msg.startswith("training.seed")


def test_boundary_values_are_accepted() -> None:
    cfg = load_config(
        [
            "--training.steps=1",
            "--lr_scheduler.decay_ratio=1",
            "--lr_scheduler.decay_ratio=0",
            "--lr_scheduler.min_lr_factor=1",
            "--optimizer.beta1=0",
            "--training.max_norm=0",
            "--validation.holdout_fraction=0",  # fine while validation is disabled
            "--lr_scheduler.warmup_steps=0",
        ]
    )
    assert cfg.lr_scheduler.decay_ratio == 0.0  # the last of repeated options wins
    assert cfg.validation.holdout_fraction == 0.0


# --- every problem at once --------------------------------------------------------------------


def test_every_problem_of_file_and_command_line_is_reported_at_once(tmp_path: Path) -> None:
    """Two unknown keys, an unknown section, a wrong type and an out-of-range value in the file,
    an unknown option and a bad value on the command line: one ConfigError, a line for each."""
    path = write_toml(
        tmp_path,
        '[training]\nstpes = 3\nseq_len = "long"\nlocal_batch_size = 0\n'
        "[optimizer]\nlrr = 1e-3\n[trainer]\nsteps = 1\n",
    )
    argv = ["--job.config_file", path, "--metrics.log_frq", "5", "--training.seed", "-1"]
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    lines = str(info.value).split("\n")
    assert lines == info.value.problems and len(lines) == 7, lines
    expected = [
        "did you mean 'steps'",
        "training.seq_len: expected an integer",
        "training.local_batch_size: must be at least 1",
        "did you mean 'lr'",
        "[trainer]",
        "--metrics.log_frq",
        "training.seed: must be in [0, 2**32)",
    ]
    for want in expected:
        assert sum(want in line for line in lines) == 1, (want, lines)


def test_a_key_that_failed_is_not_reported_again_by_validation(tmp_path: Path) -> None:
    """A value that could not be read keeps its (valid) default, so its range check is quiet."""
    path = write_toml(tmp_path, '[training]\nsteps = "many"\n')
    assert str(config_error(["--job.config_file", path])).count("training.steps") == 1


def test_unknown_option_does_not_swallow_the_next_option() -> None:
    """An unknown --key still steps over its value: the option after it is parsed as usual."""
    message = config_error(["--training.stpes", "3", "--training.seq_len", "x"])
    assert message.count("\n") == 1 and "--training.stpes" in message
    assert "--training.seq_len: expected an integer, got 'x'" in message


# --- --help documents every field -------------------------------------------------------------


def test_every_field_has_a_docstring() -> None:
    """Every key: the sections' own and the families' shape fields ([model])."""
    for section, cls in sections().items():
        docs = field_docs(cls)
        for key in keys(cls):
            assert docs.get(key, "").strip(), f"{section}.{key} has no docstring"


def test_help_lists_every_field_with_its_doc() -> None:
    text = help_text()
    own = [f.name for f in dataclasses.fields(JobConfig) if f.name != "components"]
    declared = [s.name for s in catalog.current().sections]
    assert [name for name in sections() if name in own] == own
    assert sorted(set(sections()) - set(own)) == sorted(declared)
    lines = text.splitlines()
    for section, cls in sections().items():
        assert f"[{section}]" in lines
        docs = field_docs(cls)
        for key in keys(cls):
            option = f"--{section}.{key}"
            index = next(i for i, line in enumerate(lines) if line.strip().startswith(option + " "))
            assert docs[key] in lines[index + 1], option


def test_help_shows_types_and_defaults() -> None:
    text = help_text()
    assert "--training.steps  (int, default 10000)" in text
    assert '--lr_scheduler.decay_type  (linear|sqrt|cosine, default "linear")' in text
    assert "--model.dim  (int (optional), default unset)" in text
    assert "--job.dry_run  (bool, default false)" in text


# --- to_toml round-trip -----------------------------------------------------------------------


def round_trip(cfg: JobConfig) -> JobConfig:
    text = to_toml(cfg)
    back = JobConfig()
    apply_toml(back, tomllib.loads(text), "<to_toml>")
    return back


def test_to_toml_round_trips_defaults() -> None:
    cfg = JobConfig()
    assert round_trip(cfg) == cfg
    assert "# dim = (unset)" in to_toml(cfg)


def test_to_toml_round_trips_set_overrides_and_awkward_values() -> None:
    cfg = load_config(
        [
            "--model.dim=512",
            "--model.ffn_dim_multiplier=1.3",
            "--model.tie_embeddings=false",
            "--model.rope_theta=500000",
            "--model.norm_eps=1e-6",
            "--lr_scheduler.decay_ratio=0.2",
            "--optimizer.lr=3e-4",
            "--optimizer.eps=1e-12",
            "--training.global_batch_size=-1",
            "--job.dry_run",
            '--job.description=quote " back\\slash\nnewline\ttab ünïcode 東京',
        ]
    )
    back = round_trip(cfg)
    assert back == cfg
    assert back.model.tie_embeddings is False  # set to False, not unset
    assert back.model.n_layers is None


@pytest.mark.parametrize("char", ["\r", "\x01", "\x7f"])
def test_to_toml_escapes_control_characters(char: str) -> None:
    cfg = load_config([f"--job.description=a{char}b"])
    assert round_trip(cfg) == cfg


def test_to_toml_of_a_loaded_file_round_trips() -> None:
    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "llama3_70b.toml")])
    assert round_trip(cfg) == cfg


@pytest.mark.parametrize(
    ("flavor", "built"), [("debugmodel_moe", "debugmodel"), ("35B-A3B", "35B-A3B")]
)
def test_qwen3_5_moe_sizes_named_under_qwen3_5_build_the_moe_family(
    flavor: str, built: str
) -> None:
    cfg = load_config(["--model.name", "qwen3_5", "--model.flavor", flavor])
    assert (cfg.model.name, cfg.model.flavor) == ("qwen3_5_moe", built)
    assert load_config(["--model.name", "qwen3_5"]).model.name == "qwen3_5"
