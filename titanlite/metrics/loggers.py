"""Throughput, MFU and memory; the console, metrics.jsonl and wandb loggers.

MFU is honest on any hardware: a table of dense peak FLOP/s covers known GPUs; anything
else (every CPU, unknown GPUs) is measured once by a matmul benchmark in the training dtype
and cached, and run.json records which.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanlite.files import atomic_write
from titanlite.metrics import memory_timeline

logger = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s from vendor data sheets, by a substring of the device name.
# float32 entries assume TF32 matmuls, which titanlite enables on CUDA.
GPU_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989.5e12, torch.float32: 494.7e12},
    "H100 PCIe": {torch.bfloat16: 756.0e12, torch.float32: 378.0e12},
    "H100": {torch.bfloat16: 989.5e12, torch.float32: 494.7e12},
    "A100": {torch.bfloat16: 312.0e12, torch.float32: 156.0e12},
    "L40S": {torch.bfloat16: 362.1e12, torch.float32: 183.2e12},
    "A10G": {torch.bfloat16: 70.0e12, torch.float32: 35.0e12},
}


def peak_cache_file() -> Path:
    """TITANLITE_CACHE_DIR, else $XDG_CACHE_HOME/titanlite, else ~/.cache/titanlite."""
    folder = os.environ.get("TITANLITE_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "titanlite")
    return Path(folder) / "peak_flops.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"{platform.processor() or platform.machine()} cpu"


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, max_size: int = 4096) -> float:
    """Best-of-several FLOP/s of a square matrix product: what this device really delivers.

    The size doubles from 256 until one matmul takes about 50 ms, so a dtype the hardware
    barely supports (bf16 on a CPU without AVX-512) costs a fraction of a second, not minutes.
    Each size is run once untimed first: the first call pays for starting threads and
    choosing kernels, and timing it stopped the growth at a size far below the real peak.
    """

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        # linear (a @ b.T) as the model's layers call it: on CPUs without native bf16,
        # torch.mm in bf16 takes a slow path that linear (oneDNN) does not (an order of
        # magnitude apart; BENCHMARKS.md).
        torch.nn.functional.linear(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    size = 256
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        warmup = timed(a, b)
        if warmup > 0.5:  # too slow to repeat (an emulated dtype): one more run is enough
            return 2 * size**3 / min(warmup, timed(a, b))
        best = min(timed(a, b) for _ in range(3))
        if best > 0.05 or size >= max_size:
            # More tries at the final size: on a shared machine the best of a few is the
            # nearest to what the hardware can do.
            best = min([best] + [timed(a, b) for _ in range(4)])
            return 2 * size**3 / best
        size *= 2


def _peak_cache_key(device: torch.device, dtype: torch.dtype) -> str:
    # The version tag retires entries measured by an older method.
    return f"{device_name(device)}|{dtype}|{torch.get_num_threads()} threads|v3"


def _read_peak_cache(path: Path) -> dict[str, float]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_peak_cache(path: Path, cached: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cached, indent=1))
    except OSError as e:  # a read-only home only costs a re-measurement next time
        logger.warning("could not update the peak FLOP/s cache %s: %s", path, e)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained: 'table: NAME' or 'measured ...')."""
    name = device_name(device)
    if device.type == "cuda":
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name and dtype in table:
                return table[dtype], f"table: {key}"
    cache_key = _peak_cache_key(device, dtype)
    path = peak_cache_file()
    cached = _read_peak_cache(path)
    if cache_key in cached:
        return float(cached[cache_key]), f"measured (cached) {cache_key}"
    flops = measure_matmul_flops(device, dtype)
    cached[cache_key] = flops
    _write_peak_cache(path, cached)
    return flops, f"measured {cache_key}"


def forget_peak_flops(device: torch.device, dtype: torch.dtype) -> None:
    """Drop a cached measurement (one taken on a busy machine), so the next run measures."""
    path = peak_cache_file()
    cached = _read_peak_cache(path)
    if cached.pop(_peak_cache_key(device, dtype), None) is not None:
        _write_peak_cache(path, cached)


def memory_peak_gib(device: torch.device) -> float:
    """Peak memory: allocated tensors on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return memory_timeline.process_peak() / 2**30  # (ru_maxrss, across the timeline's resets)


def cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """On CUDA: reserved memory (what the allocator holds) and how often it had to free
    its cache and retry a failed allocation (a sign of fragmentation). Empty elsewhere."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "mem_reserved_peak_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "cuda_ooms": stats.get("num_ooms", 0),
    }


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Writes each logged step to metrics.jsonl, the console and (optionally) wandb and
    TensorBoard.

    Only the main rank writes; other ranks get a logger whose calls do nothing.
    """

    def __init__(
        self,
        dump_folder: Path,
        enabled: bool,
        wandb_settings: dict[str, Any] | None = None,
        tensorboard_folder: Path | None = None,
    ):
        self.enabled = enabled
        self._file = None
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        # Appending keeps the history of a resumed run in one file.
        self._file = open(dump_folder / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if wandb_settings is not None:
            self._wandb = _start_wandb(dump_folder, wandb_settings)
        if tensorboard_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(tensorboard_folder))
            logger.info("tensorboard: writing to %s", tensorboard_folder)

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        if console:
            sys.stdout.write(console + "\n")
            sys.stdout.flush()
        if self._wandb is not None:
            step = record.get("step")
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if self._tensorboard is not None and "step" in record:
            # Tags group by record kind: train/loss, validation/val_loss, startup/total_s.
            kind = record.get("kind", "train")
            for key, value in record.items():
                if key in ("step", "time", "kind") or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"{kind}/{key}", value, record["step"])

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def wandb_mode() -> str:
    """WANDB_MODE when set; otherwise online with credentials, offline without."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.path.expanduser("~")) / ".netrc"
    try:
        if "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def _start_wandb(dump_folder: Path, settings: dict[str, Any]):  # noqa: ANN202
    import wandb

    mode = wandb_mode()
    run = wandb.init(
        project=settings.get("project"),
        name=settings.get("name") or None,
        config=settings.get("config"),
        dir=str(dump_folder),
        mode=mode,
    )
    logger.info("wandb: mode %s, run folder %s", mode, getattr(run, "dir", "?"))
    return run


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (a DTensor counts only its local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def model_state_bytes(
    parts: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> dict[str, int]:
    """Exact bytes of parameters, gradients and optimizer state held by this rank."""
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    state = [
        v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(v for v in state if v.ndim > 0),
    }
