"""Running TorchTitan v0.2 config files: ``convert`` turns one into its titanlite equivalent
(each key by its ``Rule``: ``rules.mapping()``, split by section into ``training_keys`` and
``run_keys``), with a note for each key titanlite drops or cannot honour.

May import: ``errors`` and the config's own modules; the families' TorchTitan flavors come
from the component catalog. No torch.
"""

from titanlite.config.torchtitan.convert import (
    Conversion,
    Note,
    convert,
    looks_like_torchtitan,
    mapping_table_markdown,
)
from titanlite.config.torchtitan.rules import mapping

__all__ = [
    "Conversion",
    "Note",
    "convert",
    "looks_like_torchtitan",
    "mapping",
    "mapping_table_markdown",
]
