"""Scenarios that train with titanlite's real Trainer on every rank of a worker pool
(tests/pool.py): the same code path as ./run_train.sh after the launcher, without paying a
process start-up per run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titanlite.config import load_config
from titanlite.downstream.tasks import encode_pair
from titanlite.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def read_run(folder: Path) -> dict[str, Any]:
    """metrics.jsonl records (in order) and run.json of a run folder."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {
        "records": [json.loads(line) for line in lines],
        "info": json.loads((folder / "run.json").read_text()),
    }


def main(rank: int, world: int, argv: list[str]) -> int:
    """`python -m titanlite.train ARGV` in this rank: the exit status (its output goes to the
    pool's captured output). It ends by destroying the default group. Alone in its world, this
    rank then makes a new one at once, as titanlite itself makes a one-process group (a store
    in memory), and the pool goes on with the same worker; with several ranks the pool
    restarts (a fresh worker imports titanlite and its data libraries again: about a second of
    CPU per rank)."""
    import torch.distributed as dist

    from titanlite.train import main as train_main

    status = train_main(argv)
    if world == 1 and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return status


def train(rank: int, world: int, argv: list[str]) -> dict[str, Any] | None:
    """Train as `./run_train.sh train_configs/debug_model.toml ARGV` would (later arguments
    win); rank 0 returns what the run wrote (read_run), the others None."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return read_run(Path(cfg.job.dump_folder)) if rank == 0 else None


def train_until_preempted(rank: int, world: int, argv: list[str], stop_at: int) -> str:
    """Train as `train` does, then stop at step ``stop_at`` as a preempted run does: every rank
    votes to stop there (as after a SIGTERM), the step is saved and the run ends (Preempted).
    The schedule and data are those of the whole run, cut short. Returns Preempted's line."""
    import signal

    from titanlite.errors import Preempted
    from titanlite.runtime.stop_vote import PREEMPTED

    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    vote, read = trainer.vote, trainer.vote.read

    def read_stopping_at() -> tuple[bool, bool]:
        stop, timed_save = read()  # the real vote still settles (an all-reduce in flight)
        if trainer.state.step == stop_at:
            vote.signal, vote.level = signal.SIGTERM, PREEMPTED
            return True, timed_save
        return stop, timed_save

    vote.read = read_stopping_at
    try:
        trainer.train()
    except Preempted as stopped:
        return str(stopped)
    finally:
        trainer.close()
    raise AssertionError(f"the run was not stopped at step {stop_at}")


def on_pool(world: int, argv: list[str]) -> dict[str, Any]:
    """``train`` with ARGV on ``world`` ranks of the reused worker pool (tests/pool.py):
    rank 0's result, what the run wrote."""
    from pool import get_pool

    return get_pool(world).run(train, argv=argv)[0]


def by_step(records: list[dict]) -> dict[int, dict]:
    """A run's training records by step (resume and validation records left out)."""
    return {r["step"]: r for r in records if "kind" not in r}


def logits_of(trainer: Trainer, output: torch.Tensor) -> torch.Tensor:
    """A one-process model's logits from its output: under the fused loss (the default) the
    output is the final hidden states, which the deferred head's weight projects here."""
    weight = trainer.model.head_weight()
    return output if weight is None else output @ weight.t()


def train_then_score(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """One process: train (its eval scores the tasks at the last step), then score each
    task file's rows directly from the trained model (a plain forward, log_softmax): per
    question, each choice's (or the target's) summed log-likelihood and whether every one of
    its tokens is the most likely one there."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        trainer.train()
        model, tok = trainer.model.modules[0], trainer.tokenizer
        direct = {}
        with torch.no_grad():
            for task in cfg.eval.tasks:
                rows = [json.loads(line) for line in Path(task).read_text().splitlines()]
                scored = direct[Path(task).stem] = []
                for row in rows:
                    per_choice = []
                    for choice in row.get("choices", [row.get("target")]):
                        context, ids = encode_pair(tok, row["context"], choice)
                        tokens = torch.tensor([context + ids])
                        logits = logits_of(trainer, model(tokens[:, :-1]))
                        logp = torch.log_softmax(logits.double(), -1)[0]
                        at = len(context) - 1
                        ll = sum(float(logp[at + i, t]) for i, t in enumerate(ids))
                        greedy = all(int(logp[at + i].argmax()) == t for i, t in enumerate(ids))
                        per_choice.append((ll, greedy))
                    scored.append(per_choice)
    finally:
        trainer.close()
    return {**read_run(Path(cfg.job.dump_folder)), "direct": direct}


def initial_weights(rank: int, world: int, argv: list[str]) -> dict[str, torch.Tensor] | None:
    """The full (gathered) initial parameters of the configured layout, on rank 0."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, "--checkpoint.enable=false", *argv])
    trainer = Trainer(cfg)
    try:
        weights = {}
        for part in trainer.model.parts:
            for name, p in part.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                weights[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()
    finally:
        trainer.close()
    return weights if rank == 0 else None


def rng_after_resume(rank: int, world: int, argv: list[str]) -> list[float]:
    """Build a Trainer that resumes from the run's checkpoint (without training further)
    and draw from the global generator: what the restored per-rank RNG state gives."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    torch.manual_seed(1234 + rank)  # anything but the restored state
    trainer = Trainer(cfg)
    try:
        assert trainer.state.step > 0, "nothing was resumed"
        return torch.rand(3).tolist()
    finally:
        trainer.close()


def train_with_rank_seeds(rank: int, world: int, argv: list[str]) -> list[float]:
    """Train with a different global-generator state on each rank, then draw from it: the
    numbers that follow the state the last checkpoint saved (nothing draws after it)."""
    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    try:
        torch.manual_seed(100 + rank)
        trainer.train()
        return torch.rand(3).tolist()
    finally:
        trainer.close()


def validate_twice(
    rank: int, world: int, argv: list[str], cache_bytes: int | None = None
) -> list[dict] | None:
    """Two validation passes on the initial weights (``cache_bytes``: another size of the
    kept-batches cache); rank 0 returns both records."""
    import titanlite.training.validate as validate_module

    cfg = load_config(["--job.config_file", DEBUG_CONFIG, "--checkpoint.enable=false", *argv])
    trainer = Trainer(cfg)
    default = validate_module.VALIDATION_CACHE_BYTES
    if cache_bytes is not None:
        validate_module.VALIDATION_CACHE_BYTES = cache_bytes
    try:
        for _ in range(2):
            trainer.validator.validate(trainer.model, trainer.state.step, trainer.metrics)
    finally:
        validate_module.VALIDATION_CACHE_BYTES = default
        trainer.close()
    if rank != 0:
        return None
    lines = (Path(cfg.job.dump_folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "validation"]


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value into Python (item, int(), float(), bool(),
    tolist): on a GPU each is a device-to-host synchronization. Each entry is (the read,
    where: the innermost titanlite function, else the innermost torch module)."""

    READS = frozenset({"item", "__int__", "__float__", "__bool__", "__index__", "tolist"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append((name, _call_site()))
        return func(*args, **(kwargs or {}))


# Frames that only pass a call on: this module's wrappers and torch's dispatch plumbing.
_PLUMBING = (
    "train_scenarios",
    "torch.overrides",
    "torch.distributed.c10d_logger",
    "torch.distributed.distributed_c10d",
    "torch.utils._python_dispatch",
)


def _call_site() -> str:
    """Who made the call: "titanlite.MODULE.FUNCTION", or "torch.MODULE" for torch's own
    code (FSDP, DTensor, the optimizers), skipping the frames that only pass it on."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_PLUMBING):
            if module.startswith("titanlite."):
                return f"{module}.{frame.f_code.co_name}"
            return module
        frame = frame.f_back
    return "?"


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "gather",
    "scatter",
    "reduce",
    "monitored_barrier",
)


def step_work(
    rank: int, world: int, argv: list[str], steps: list[int]
) -> dict[int, dict[str, list]] | None:
    """Train as `train` does while recording what each training step in ``steps`` (all of
    it: data, the step, the checks after it) asks of the host and the network: host reads of
    tensor values, torch.distributed calls (with async_op) and functional collectives
    (DTensor, tensor parallelism). Rank 0 returns the lists by step."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    cfg = load_config(["--job.config_file", DEBUG_CONFIG, *argv])
    trainer = Trainer(cfg)
    recorded: dict[int, dict[str, list]] = {}
    # While a step is recorded: (its step, its lists, the two modes recording it).
    current: list[tuple[int, dict[str, list], Any, Any] | None] = [None]
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    depth = [0]

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            # torch.distributed's functions re-dispatch through torch-function modes (our
            # _HostReads): count the outermost call only.
            if current[0] is not None and depth[0] == 0:
                current[0][1]["calls"].append(
                    (name, bool(kwargs.get("async_op", False)), _call_site())
                )
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    class Functional(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self, into: list[str]) -> None:
            super().__init__()
            self.into = into

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.namespace in ("c10d", "_c10d_functional") or func.__name__.startswith(
                "_local_scalar_dense"
            ):
                self.into.append(f"{func.namespace}.{func.__name__.split('.')[0]}")
            return func(*args, **(kwargs or {}))

    def start(step: int) -> None:
        reads = _HostReads()
        lists = {"reads": reads.reads, "calls": [], "functional": []}
        dispatch = Functional(lists["functional"])
        recorded[step] = lists
        current[0] = (step, lists, reads, dispatch)
        reads.__enter__()
        dispatch.__enter__()

    def stop() -> None:
        _, _, reads, dispatch = current[0]
        current[0] = None
        dispatch.__exit__(None, None, None)
        reads.__exit__(None, None, None)

    batches = trainer.train_iter

    class Watch:
        def __next__(self):  # noqa: ANN204 - called once per micro-batch, first thing in a step
            step = trainer.state.step
            if current[0] is not None and current[0][0] != step:  # the recorded step ended
                stop()
            if current[0] is None and step in steps and step not in recorded:
                start(step)
            return next(batches)

    trainer.train_iter = Watch()
    for module in (dist, distributed_c10d):
        for name, fn in originals.items():
            if hasattr(module, name):
                setattr(module, name, counted(name, fn))
    try:
        trainer.train()
    finally:
        if current[0] is not None:  # a recorded step never ended (it raised, or was the last)
            stop()
        for module in (dist, distributed_c10d):
            for name, fn in originals.items():
                if hasattr(module, name):
                    setattr(module, name, fn)
        trainer.close()
    return recorded if rank == 0 else None
