"""Job configuration: schema (job_config), parsing (parse), layout arithmetic (layout)."""

from titanlite.config.job_config import ConfigError, JobConfig
from titanlite.config.layout import (
    Degrees,
    global_batch_size,
    gradient_accumulation_steps,
    resolve_degrees,
)
from titanlite.config.parse import help_text, load_config, parse_cli, to_toml

__all__ = [
    "ConfigError",
    "Degrees",
    "JobConfig",
    "global_batch_size",
    "gradient_accumulation_steps",
    "help_text",
    "load_config",
    "parse_cli",
    "resolve_degrees",
    "to_toml",
]
