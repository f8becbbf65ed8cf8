"""--job.dry_run: the layout, model size, per-rank memory and FLOPs of a run, without it.

Runs in one process over a fake process group of the full world size, with the model on
the meta device, so the 405B layout for thousands of GPUs is checked on a laptop: every
parallelism is applied exactly as in training, and the shapes of the local shards give the
memory each rank will hold. With --job.dry_run_init_rank R the process acts as rank R and
really allocates and initializes that rank's shards on this machine's CPU, which measures
what a start-up costs one rank.

For mixture-of-experts models it also splits the model state into its expert and dense
parts, sizes one block's weights as FSDP gathers them (expert parallelism gathers only the
rank's own experts) and estimates the all-to-all traffic of expert parallelism per step.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.assembly import assemble_model
from titanlite.config import (
    JobConfig,
    global_batch_size,
    gradient_accumulation_steps,
    resolve_degrees,
)
from titanlite.config.layout import Degrees, PipelinePlan, pipeline_plan
from titanlite.dtypes import DTYPES
from titanlite.metrics.loggers import local_bytes
from titanlite.metrics.moe_tracker import MoETracker
from titanlite.models import moe
from titanlite.models.interfaces import AttentionCore, find
from titanlite.parallel.context.window import kv_rows_kept
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.materialize import materialize
from titanlite.training.fused_loss import auto_tokens

# fp32 master weights, fp32 gradients, and AdamW's two fp32 moments.
BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}
GIB = 2**30


def dry_run(cfg: JobConfig, world_size: int, tokenizer_vocab: int) -> str:
    """The report (several lines) for this config at this world size."""
    degrees = resolve_degrees(cfg, world_size)
    init_rank = cfg.job.dry_run_init_rank
    rank = max(init_rank, 0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        dims = ParallelDims(degrees, "cpu")
        # Under pipeline parallelism a rank holds only its stages: those are what it sizes.
        assembled = assemble_model(cfg, tokenizer_vocab=tokenizer_vocab, dims=dims, device=None)
        spec, args, parts = assembled.spec, assembled.args, assembled.model.parts
        total = assembled.num_params
        # Under CP, what each block's attention keeps of the sequence's keys and values (CP
        # never runs with PP, so the parts then hold every block).
        kv_windows = [
            core.mask.window
            for part in parts
            for block in getattr(part, spec.blocks).values()
            for core in find(block, AttentionCore)
            if not core.recurrent  # linear attention passes a state, no keys
        ]
        plan = pipeline_plan(cfg.parallelism, degrees, args.n_layers, cfg.training.local_batch_size)
        pipeline_lines = (
            _pipeline_lines(cfg, spec, args, plan, dims=dims, kv_windows=kv_windows)
            if plan
            else _activation_lines(cfg, spec, args, dims, kv_windows=kv_windows)
        )
        params = list({id(p): p for part in parts for p in part.parameters()}.values())
        local_numel = local_bytes(params) // 4  # still float32 on meta
        accum = gradient_accumulation_steps(cfg, degrees)
        expert_lines = _expert_lines(cfg, parts, dims, accum) if spec.experts else []
        init_lines = (
            _initialize_one_rank(parts, spec, args, cfg, rank=rank) if init_rank >= 0 else []
        )
    finally:
        dist.destroy_process_group()
    state = {k: local_numel * b / GIB for k, b in BYTES_PER_PARAM.items()}
    ema = ""
    if cfg.training.ema_decay > 0:  # the average of the weights: one float32 copy, sharded alike
        state["ema"] = local_numel * 4 / GIB
        ema = f" + EMA {state['ema']:.2f}"
    gbs = global_batch_size(cfg, degrees)
    return "\n".join(
        [
            f"dry run: {cfg.model.name}/{cfg.model.flavor} on {world_size} ranks",
            f"  mesh            {degrees.describe()}",
            f"  parameters      {total:,} ({total / 1e9:.2f} B); {local_numel:,} on rank {rank}",
            f"  model state     {sum(state.values()):.2f} GiB per rank (params "
            f"{state['params']:.2f} + grads {state['grads']:.2f} + AdamW "
            f"{state['optimizer']:.2f}{ema}), before activations",
            f"  FLOPs per token {spec.flops_per_token(args, cfg.training.seq_len):.4g} (seq_len "
            f"{cfg.training.seq_len})",
            f"  global batch    {gbs} sequences = {gbs * cfg.training.seq_len:,} tokens "
            f"({accum} micro-batch{'es' if accum > 1 else ''} per step)",
            *expert_lines,
            *pipeline_lines,
            *init_lines,
        ]
    )


def _expert_lines(
    cfg: JobConfig, parts: list[nn.Module], dims: ParallelDims, accum: int
) -> list[str]:
    """A mixture of experts on this rank: the experts' share of the model state, one
    block's weights as FSDP gathers them, and expert parallelism's all-to-all traffic."""
    layers = MoETracker.find(parts)
    if not layers:
        return []
    d, dtype = dims.degrees, cfg.training.mixed_precision_param
    lines = [_expert_state_line(layers, d)]
    if d.dp_shard * d.cp > 1:  # FSDP shards, so each block is gathered to run
        lines.append(_gathered_block_line(parts, layers, d.ep, dtype))
    return [*lines, _all_to_all_line(cfg, parts, layers, d, accum=accum)]


def _expert_state_line(layers: list[moe.MoE], d: Degrees) -> str:
    """Expert parallelism splits each layer's experts over ep, and FSDP shards each rank's
    experts over the other dp_shard / ep ranks (by whole experts when they divide evenly,
    else along each expert's next dimension), so a rank keeps num_experts / dp_shard
    experts' worth whatever ep is."""
    params = list({id(p): p for m in layers for p in m.experts.parameters()}.values())
    local = local_bytes(params) // 4  # still float32 on meta
    gib = local * sum(BYTES_PER_PARAM.values()) / GIB
    n = layers[0].num_experts
    per_expert = sum(p.numel() for p in layers[0].experts.parameters()) // n  # global shapes
    here = local / len(layers) / per_expert
    cp = f" x cp={d.cp}" if d.cp > 1 else ""  # the cp ranks shard the experts too
    if d.ep > 1:
        split = (
            f"split {n // d.ep} per ep rank (ep={d.ep}), then FSDP-sharded over the other "
            f"{d.dp_shard // d.ep} dp_shard ranks{cp}"
        )
    elif d.dp_shard > 1:
        split = f"FSDP-sharded over dp_shard={d.dp_shard}{cp} (no expert parallelism)"
    else:
        split = "whole on each rank (neither expert parallelism nor FSDP)"
    shards = d.dp_shard * d.cp if d.dp_shard > 1 else 1
    return (
        f"  experts         {gib:.2f} GiB of that model state ({local:,} elements): each "
        f"layer's {n} experts {split}; {here:.2f} experts' worth here per layer (an even "
        f"share: {n / shards:.2f})"
    )


def _gathered_block_line(parts: list[nn.Module], layers: list[moe.MoE], ep: int, dtype: str) -> str:
    """One block's weights as FSDP unshards them to run it: the dense part whole, and of
    the experts only the rank's own num_experts / ep, which is where expert parallelism
    saves memory."""
    name = next(n for part in parts for n, m in part.named_modules() if m is layers[0])
    part = next(p for p in parts if any(m is layers[0] for m in p.modules()))
    block = part.get_submodule(name.rsplit(".", 1)[0])  # the MoE layer's parent
    # DTensors report their global shapes: the whole block, all the experts.
    experts = sum(p.numel() for p in layers[0].experts.parameters())
    dense = sum(p.numel() for p in block.parameters()) - experts
    elem = DTYPES[dtype].itemsize
    own = experts // ep * elem
    return (
        f"  gathered block  {(dense * elem + own) / GIB:.2f} GiB: one block's weights "
        f"unsharded in {dtype} while it runs ({dense * elem / GIB:.2f} dense + "
        f"{own / GIB:.2f} for its {layers[0].num_experts // ep} experts; FSDP prefetches the "
        "next block)"
    )


def _all_to_all_line(
    cfg: JobConfig, parts: list[nn.Module], layers: list[moe.MoE], d: Degrees, *, accum: int
) -> str:
    if d.ep == 1:
        return (
            "  all-to-all      none (expert_parallel_degree 1: each rank runs its tokens' experts)"
        )
    # A checkpointed block's forward runs again in backward, all-to-alls included.
    recomputed = sum(
        isinstance(m, moe.MoE)
        for part in parts
        for wrapper in part.modules()
        if isinstance(wrapper, CheckpointWrapper)
        for m in wrapper.modules()
    )
    # Each rank routes its own tokens: its share of each sequence under context parallelism,
    # and under tensor parallelism its sequence shard (the MoE runs on "local_tokens").
    tokens = cfg.training.local_batch_size * accum * cfg.training.seq_len // (d.cp * d.tp)
    top_k, dim = layers[0].top_k, layers[0].experts.w1.shape[1]
    elem = DTYPES[cfg.training.mixed_precision_param].itemsize
    passes = 4 * len(layers) + 2 * recomputed
    sent = all_to_all_bytes(passes, tokens, top_k, dim, ep=d.ep, elem=elem)
    again = f" + {recomputed} recomputed x 2" if recomputed else ""
    return (
        f"  all-to-all      {sent / GIB:.2f} GiB ({sent:,} bytes) sent per step per rank and as "
        f"much received: {len(layers)} MoE layers x 4{again} passes (dispatch + combine, "
        f"forward + backward) x {tokens:,} tokens x top_k {top_k} x {d.ep - 1}/{d.ep} of the "
        f"slots leaving the rank x rows of {dim} x {elem} bytes (even routing, dropless)"
    )


def all_to_all_bytes(passes: int, tokens: int, top_k: int, dim: int, *, ep: int, elem: int) -> int:
    """Bytes one rank sends in ``passes`` all-to-alls (each MoE layer's dispatch and combine
    in forward, and their gradients in backward): each of its tokens x top_k slots whose
    expert lives on another of the ep ranks, (ep - 1) / ep of them under even routing, sends
    a row of ``dim`` elements (and receives one back)."""
    return passes * tokens * top_k * (ep - 1) * dim * elem // ep


def _pipeline_lines(
    cfg: JobConfig, spec, args, plan: PipelinePlan, *, dims: ParallelDims, kv_windows: list
) -> list[str]:  # noqa: ANN001
    """The split, and this rank's activations kept for backward at the schedule's peak."""
    pp_rank, t = dims.local_rank("pp"), cfg.training
    stages = plan.rank_stages(pp_rank)
    micro = cfg.parallelism.pipeline_parallel_microbatch_size
    ac = cfg.activation_checkpoint.mode
    per_block = _block_bytes(cfg, spec, args, dims, sequences=micro, kv_windows=kv_windows)
    per_set = max(len(plan.stage_blocks[s]) for s in stages) * per_block
    sets = plan.in_flight(pp_rank)
    total = sets * per_set
    loss = []
    if plan.n_stages - 1 in stages:  # the last stage's share of the sets keeps float32 logits
        kept, peak, line = _loss_bytes(cfg, args, tokens=micro * t.seq_len, tp=dims.degrees.tp)
        total += (sets // len(stages) - 1) * kept + peak
        loss = [line]
    note = {"none": "", "full": ", full activation checkpointing"}.get(
        ac, f", {ac} checkpointing counted as none"
    )
    return [
        f"  pipeline        {plan.describe()}; this rank runs stage(s) "
        f"{', '.join(map(str, stages))}",
        f"  activations     ~{total / GIB:.2f} GiB at the schedule's peak: {sets} "
        f"(micro-batch, stage) sets of up to {per_set / GIB:.2f} GiB"
        f"{' + the loss' if plan.n_stages - 1 in stages else ''} (estimate: flash-style "
        f"attention{note})",
        *loss,
    ]


def _loss_bytes(cfg: JobConfig, args: Any, *, tokens: int, tp: int) -> tuple[int, int, str]:
    """(bytes the loss keeps for backward, bytes at its peak, the report's line) for one
    micro-batch of ``tokens`` on a rank (its vocabulary shard under TP). Unfused: the float32
    logits are kept (their log-softmax, the same size) and backward adds their gradient and
    the log-softmax's: 3 copies at the peak, measured on CPU (scripts/bench_memory.py).
    Fused (training.fused_loss): one [block, vocab] float32 block of logits (and in a 16-bit
    param dtype, its 16-bit product and gradient), dh and dW accumulated in float32 and kept
    in the param dtype. Recomputing (fused_loss_recompute): nothing of vocabulary size is
    kept; each chunk holds a [tokens, chunk] block and its exponentials or gradient, 2 blocks
    at the peak."""
    t = cfg.training
    vocab = -(-args.vocab_size // tp)
    logits = tokens * vocab * 4
    unfused = (logits, 3 * logits)
    copies = f"3 copies of the {logits / GIB:.2f} GiB float32 logits"
    if t.fused_loss_recompute:
        rows = min(t.fused_loss_chunk, vocab)
        fused = (0, 2 * tokens * rows * 4)
        shape = f"2 x [{tokens:,}, {rows:,}] float32 blocks"
    else:
        rows = min(t.fused_loss_tokens or auto_tokens(vocab), tokens)
        elem = DTYPES[t.mixed_precision_param].itemsize
        grads = (vocab + tokens) * args.dim
        kept = grads * elem
        block = rows * vocab * (4 + 2 * (4 - elem))  # + a 16-bit product and gradient
        fused = (kept, block + grads * 4 + (kept if elem < 4 else 0))
        shape = (
            f"a [{rows:,}, {vocab:,}] float32 block, dh and dW in float32; "
            f"{kept / GIB:.2f} GiB of dh and dW kept for backward"
        )
    kept, peak = fused if t.fused_loss else unfused
    saving = (unfused[1] - fused[1]) / GIB
    if t.fused_loss:
        line = f"fused: ~{peak / GIB:.2f} GiB at its peak ({shape}); unfused {copies}"
    else:
        line = f"unfused: ~{peak / GIB:.2f} GiB at its peak ({copies}); training.fused_loss {shape}"
    return kept, peak, f"  loss            {line}: {saving:.2f} GiB less fused"


def _block_bytes(
    cfg: JobConfig, spec, args, dims: ParallelDims, *, sequences: int, kv_windows: list
) -> int:  # noqa: ANN001
    """Bytes one block keeps for backward on this rank for ``sequences`` sequences: its
    share of each (seq_len / cp tokens, split again by tp), plus under context parallelism
    the keys and values in sequence order, the mean over the blocks of their attention
    layers' (``kv_windows``: each one's window, None for full attention, which gathers the
    whole sequence's; a windowed layer keeps only the tokens its window reaches, a linear
    one none)."""
    d, t = dims.degrees, cfg.training
    local = t.seq_len // d.cp
    if cfg.activation_checkpoint.mode == "full":  # only each block's input is kept
        per_block = sequences * local * args.dim * 4
    else:
        per_block = block_activation_bytes(spec, args, local) * sequences
        if d.cp > 1:  # [rows, kv heads, head_dim] keys and values, gathered and in order
            rows = sum(kv_rows_kept(seq_len=t.seq_len, cp=d.cp, window=w) for w in kv_windows)
            per_block += (
                2 * 2 * sequences * rows * args.kv_heads * args.head_dim * 4 // args.n_layers
            )
    if t.mixed_precision_param == "bfloat16":
        per_block //= 2
    return per_block // d.tp  # sequence and tensor parallelism split them


def _activation_lines(
    cfg: JobConfig, spec, args, dims: ParallelDims, *, kv_windows: list
) -> list[str]:  # noqa: ANN001
    """Without pipeline stages: one micro-batch's activations kept for backward."""
    d, t = dims.degrees, cfg.training
    per_block = _block_bytes(
        cfg, spec, args, dims, sequences=t.local_batch_size, kv_windows=kv_windows
    )
    tokens = t.local_batch_size * (t.seq_len // d.cp)
    _, loss, loss_line = _loss_bytes(cfg, args, tokens=tokens, tp=d.tp)
    total = args.n_layers * per_block + loss
    ac = cfg.activation_checkpoint.mode
    note = {"none": "", "full": ", full activation checkpointing"}.get(
        ac, f", {ac} checkpointing counted as none"
    )
    share = f"{t.seq_len // d.cp:,} tokens of each sequence" if d.cp > 1 else "whole sequences"
    return [
        f"  activations     ~{total / GIB:.2f} GiB per micro-batch ({t.local_batch_size} "
        f"sequence{'s' if t.local_batch_size > 1 else ''}, {share}: {args.n_layers} blocks x "
        f"{per_block / GIB:.3f} GiB + the "
        f"loss; estimate: flash-style attention{note})",
        loss_line,
    ]


def block_activation_bytes(spec, args, seq_len: int) -> int:  # noqa: ANN001
    """Bytes one block saves for backward per sequence, float32, one rank without TP: a
    meta-device forward of a one-block model, counting the tensors autograd keeps (weights
    and the s x s attention scores, which flash-style attention does not keep, left out).
    A mixture of experts works on token rows ([tokens or token slots, ...], made by gathers,
    not views of batch-first tensors): those count too."""
    probe = 7  # an odd batch no weight dimension equals: activations start with it
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(args, n_layers=1))
    for name in (*spec.input_modules, *spec.output_modules):
        setattr(model, name, None)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        scores = tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == seq_len
        batch_first = tensor.dim() >= 2 and tensor.shape[0] == probe and not scores
        token_rows = (
            tensor._base is None and tensor.dim() >= 1 and tensor.shape[0] % (probe * seq_len) == 0
        )
        if batch_first or token_rows:
            saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    hidden = torch.empty(probe, seq_len, args.dim, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(hidden)
    return sum(saved.values()) // probe


def _initialize_one_rank(parts, spec, args, cfg: JobConfig, *, rank: int) -> list[str]:  # noqa: ANN001
    """Allocate and initialize this (fake) rank's shards on the CPU; report the cost."""
    before = _rss_bytes()
    start = time.perf_counter()
    stats = {"elements": 0, "allocate_s": 0.0, "init_s": 0.0}
    for part in parts:
        for key, value in materialize(part, spec, args, "cpu", seed=cfg.training.seed).items():
            stats[key] += value
    seconds = time.perf_counter() - start
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    shard = local_bytes(params)
    peak_increase = max(_peak_rss_bytes() - before, 0)
    finite = all(
        torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in params
    )
    return [
        f"  init rank {rank:<6}{stats['elements']:,} elements ({shard / GIB:.3f} GiB) allocated "
        f"and initialized on the CPU in {seconds:.1f} s ({stats['allocate_s']:.1f} s allocation, "
        f"{stats['init_s']:.1f} s values)",
        f"  init memory     peak {peak_increase / GIB:.3f} GiB above the process before "
        f"allocation = {peak_increase / max(shard, 1):.2f} x the shard; values "
        f"{'all finite' if finite else 'NOT FINITE'}",
    ]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """The process's high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
