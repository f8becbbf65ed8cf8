"""ModelSpec: everything the rest of titanlite may know about a model family, as data.

A family (``models/llama``, ``models/qwen3``, ...) registers one ``ModelSpec``. The parallel
layer, the checkpointer, the trainer and the Hugging Face interop reach the model only through
it: which module holds the repeated blocks, how each module is split by tensor parallelism,
how each parameter starts, how many FLOPs a token costs, and how names map to Hugging Face.

This module and every spec's own module are plain Python: the launcher's preflight checks a
config against the flavors without importing torch. What needs torch (building the modules,
the Hugging Face adapter) is imported on first use, from the module paths the spec names.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: a normal distribution truncated at +-3 std, a constant, or
    one of two per-element draws of state-space decays (Mamba's, Gated DeltaNet's):
    ``log_uniform`` is log(A) for A uniform in (low, high); ``softplus_inverse`` is the
    inverse softplus of a dt drawn log-uniformly in [low, high] (a bias whose softplus is dt).

    The values themselves are a pure function of (seed, parameter name, element index): see
    ``titanlite.models.init``. Every layout therefore starts from bit-identical weights.
    """

    kind: Literal["trunc_normal", "constant", "log_uniform", "softplus_inverse"]
    std: float = 0.0
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0

    @staticmethod
    def normal(std: float) -> InitRule:
        return InitRule("trunc_normal", std=std)

    @staticmethod
    def constant(value: float) -> InitRule:
        return InitRule("constant", value=value)

    @staticmethod
    def log_uniform(low: float, high: float) -> InitRule:
        return InitRule("log_uniform", low=low, high=high)

    @staticmethod
    def softplus_inverse(low: float, high: float) -> InitRule:
        return InitRule("softplus_inverse", low=low, high=high)


# Tensor-parallel styles a plan may name (titanlite.parallel.tensor turns them into torch's
# ParallelStyle objects). Each assumes sequence parallelism between sub-layers: activations
# outside attention and the MLP are sharded along the sequence (dimension 1).
TPStyle = Literal[
    "embedding",  # vocab-parallel lookup: rows split, output sharded along the sequence
    "norm",  # a norm on sequence shards (weight replicated)
    "head_norm",  # a norm over the head dimension on this rank's heads (e.g. q/k norms)
    "gather_input",  # all-gather the first positional input along the sequence
    "colwise",  # output features split (q/k/v, gate/up projections)
    "rowwise",  # input features split, output reduce-scattered along the sequence
    "output",  # the vocabulary projection (logits sharded under loss parallel)
    "heads",  # the module's parameters hold one entry per query head (attention sinks):
    # split along dimension 0 as the heads are (a module without parameters is untouched)
    "local_tokens",  # runs whole on this rank's sequence shard (a mixture of experts routes
    # its own tokens); its weights are not split and their gradients are summed over TP
    "latent",  # runs whole on the gathered sequence, weights replicated (latent attention's
    # compressing projections and norms), output handed on replicated to a colwise module
    "latent_local",  # the same, output used by this rank's heads only (partial gradients)
    "channels",  # per-channel weights (a depthwise convolution, per-head decays) split along
    # dim 0 like the colwise projection feeding them; the module reads its local rows
]


@dataclass(frozen=True)
class TensorParallelPlan:
    """Module path -> style: ``root`` relative to the model, ``block`` to each block, and for
    each container of ``extra`` (a module dict beside the blocks, e.g. multi-token prediction's
    depths) relative to each of its children."""

    root: Mapping[str, TPStyle]
    block: Mapping[str, TPStyle]
    extra: Mapping[str, Mapping[str, TPStyle]] = field(default_factory=dict)


PARAM_ROLES: Mapping[str, tuple[str, ...]] = {
    "embeddings": ("tok_embeddings.*",),
    "outputs": ("output.*",),
    "routers": ("*.router.*",),
}
"""The parameters optimizers treat apart from the hidden matrices, by role (a family whose
modules are named otherwise gives its own patterns): the input embeddings, the projection(s)
to the vocabulary, and the routers of mixture-of-experts layers."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    ``flavors`` maps a size name to an instance of ``args_cls`` (a torch-free dataclass with a
    ``check()`` method raising ValueError and a ``vocab_size`` field set from the tokenizer).
    The ``model_module`` provides ``build(args) -> nn.Module`` (call it under
    ``torch.device("meta")``) and ``init_buffers(model)`` (non-persistent buffers, such as
    RoPE tables, on the model's device); ``hf_module`` is the Hugging Face adapter
    (``titanlite.interop.hf`` documents what it must provide).
    """

    name: str
    args_cls: type
    flavors: Mapping[str, Any]
    model_module: str
    hf_module: str
    tp_plan: TensorParallelPlan
    flops_per_token: Callable[[Any, int], int]
    """(args, seq_len) -> training FLOPs per token (forward and backward)."""
    init_rule: Callable[[Any, str], InitRule]
    """(args, parameter name) -> how that parameter starts."""
    tp_divisible: Callable[[Any], Mapping[str, int]]
    """args -> the sizes the tensor-parallel degree must divide, by model.* key."""
    blocks: str = "layers"
    """Attribute holding the repeated blocks: a ModuleDict keyed "0", "1", ... (stable names
    when blocks are wrapped or, under pipeline parallelism, some are absent)."""
    input_modules: tuple[str, ...] = ("tok_embeddings",)
    """Modules before the first block (the first pipeline stage holds them)."""
    output_modules: tuple[str, ...] = ("norm", "output")
    """Modules after the last block (the last pipeline stage holds them)."""
    head: str = "output"
    """The projection to the vocabulary (a bias-free ``nn.Linear``, one of ``output_modules``):
    with training.fused_loss the loss takes its weight and the module passes its input on."""
    tied_weights: tuple[str, str] = ("output.weight", "tok_embeddings.weight")
    """(alias, owner): the parameter that is the owner's weight when args.tie_embeddings."""
    overrides: tuple[str, ...] = field(default=())
    """``model.*`` config keys that override a flavor's fields (each is a field of args_cls)."""
    active_params: Callable[[Any, int], int] | None = None
    """(args, total parameters) -> parameters one token uses (mixtures of experts)."""
    experts: bool = False
    """Blocks hold mixture-of-experts layers (the layout checks read it: ep needs experts)."""
    also_named: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """(model.name, model.flavor) as users also write them -> this family's flavor (a size
    published under a sibling family's name that this family builds)."""
    param_roles: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(PARAM_ROLES))
    """Role -> parameter-name patterns of the parameters that play it (``PARAM_ROLES``
    lists the roles); parameter-group rules name them as ``@role``."""

    # ------------------------------------------------------------------ args
    def make_args(
        self, flavor: str, vocab_size: int, max_seq_len: int, overrides: Mapping[str, Any]
    ) -> Any:
        """The flavor's args with vocab, sequence length and the non-None overrides applied.

        KeyError for an unknown flavor; ValueError naming the field for a key this family
        does not have or shapes the architecture cannot take.
        """
        if flavor not in self.flavors:
            raise KeyError(flavor)
        changes = {k: v for k, v in overrides.items() if v is not None}
        foreign = sorted(set(changes) - set(self.overrides))
        if foreign:
            raise ValueError(
                f"{', '.join(foreign)} does not apply to {self.name} (it takes "
                f"{', '.join(self.overrides)})"
            )
        args = dataclasses.replace(
            self.flavors[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len, **changes
        )
        args.check()
        return args

    def args_from_dict(self, values: Mapping[str, Any]) -> Any:
        """Args saved with ``dataclasses.asdict`` (checkpoints); ValueError/TypeError if
        unusable."""
        args = self.args_cls(**values)
        args.check()
        return args

    # ------------------------------------------------------------------ torch side
    def implementation(self) -> ModuleType:
        return importlib.import_module(self.model_module)

    def build(self, args: Any) -> Any:
        """The model's modules; under ``torch.device("meta")`` no memory is allocated."""
        return self.implementation().build(args)

    def init_buffers(self, model: Any) -> None:
        self.implementation().init_buffers(model)

    def hf_adapter(self) -> ModuleType:
        return importlib.import_module(self.hf_module)
