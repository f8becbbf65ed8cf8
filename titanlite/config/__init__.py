"""Job configuration: titanlite's own sections (``job_config``, ``model_section``), the TOML and
command-line parser (``parse``), the checks that need no world size (``constraints``), layout
arithmetic (``layout``, ``batch_ramp``), --help and config.toml (``render``), TorchTitan's
files (``torchtitan``), and what the components hand in (``catalog``: their sections, names,
checks; ``planned``: the run the cross-feature rules check).

May import: ``errors`` and nothing of the components: they import this package, and
``titanlite.components`` hands their part in through the catalog.
"""

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
