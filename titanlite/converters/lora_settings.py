"""[lora]: the settings of the LoRA converter (``titanlite.converters.lora``) and the section
its registry entry declares. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.catalog import Section
from titanlite.config.planned import PlannedRun

DEFAULT_TARGETS = [
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]


@dataclass
class LoraSettings:
    """[lora]: low-rank adapters (model.converters = ["lora"]): every weight of the model is
    frozen and the chosen linears learn an update B A of rank ``rank``, scaled by
    alpha / rank. Checkpoints hold the adapters (the frozen weights come back from
    checkpoint.initial_load_path, recorded as their base, or from the seed).
    docs/finetuning.md: from a Hugging Face model to a merged one."""

    rank: int = 8
    """Rank of each update (the inner size of A [rank, in] and B [out, rank])."""
    alpha: float = 16.0
    """The update is multiplied by alpha / rank, so changing the rank keeps its scale."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training (0: none; the frozen path never has it)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linears that get adapters: shell-style patterns matched against the end of each
    module's path (attention.wq matches layers.3.attention.wq; "*" alone matches every linear
    but the output projection)."""


def refuses(run: PlannedRun) -> list[str]:
    """What the LoRA converter cannot take."""
    s = run.cfg.lora
    lines = []
    if s.rank < 1:
        lines.append(f"lora.rank must be at least 1 (got {s.rank})")
    if not 0.0 <= s.dropout < 1.0:
        lines.append(f"lora.dropout must be in [0, 1) (got {s.dropout})")
    if not s.target_modules:
        lines.append("lora.target_modules is empty: name at least one linear")
    c = run.cfg.checkpoint
    if c.last_save_model_only or c.last_save_in_hf or c.save_format != "dcp":
        lines.append(
            "checkpoints of a LoRA run hold its adapters; write the merged model after "
            "training with scripts/convert_to_hf.py --merge-lora (unset "
            "checkpoint.last_save_model_only, last_save_in_hf and save_format)"
        )
    return lines


SECTION = Section("lora", LoraSettings, after="float8")
