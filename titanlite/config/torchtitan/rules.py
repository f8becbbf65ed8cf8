"""TorchTitan v0.2.x keys, as data: where each goes in titanlite (``mapping()``) and
TorchTitan's defaults. ``titanlite.config.torchtitan`` applies them; the model flavors the
families reproduce come from the component catalog (``titanlite.models.torchtitan``). No
torch here."""

from __future__ import annotations

import functools
from typing import Any

from titanlite.config import catalog
from titanlite.config.torchtitan.rule import Rule
from titanlite.config.torchtitan.run_keys import run_rules
from titanlite.config.torchtitan.training_keys import training_rules


@functools.cache
def mapping() -> dict[str, Rule]:
    """TorchTitan key ("section.key"; "prefix*" covers every key it starts) -> its Rule."""
    known = catalog.current()
    return {
        **training_rules(", ".join(known.families), ", ".join(known.optimizers)),
        **run_rules(),
    }


TORCHTITAN_DEFAULTS: dict[str, Any] = {
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "checkpoint.enable": False,
    "checkpoint.keep_latest_k": 10,
    "checkpoint.last_save_model_only": True,
    "activation_checkpoint.mode": "selective",
    "training.mixed_precision_param": "bfloat16",
    "training.dataset": "c4_test",
}
"""TorchTitan defaults unlike titanlite's: applied when a file leaves the key unset, so the
converted run behaves as TorchTitan would."""

ATTENTION_SUFFIXES = {
    "_flex_attn": "flex",
    "_varlen_attn": "varlen",
    "_flex": "flex",
    "_varlen": "varlen",
}
STATE_NAMES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
