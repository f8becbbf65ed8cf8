"""Shared fixtures: how tests start titanlite the way a user does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = Path(tempfile.gettempdir()) / f"titanlite-test-cache-{os.getuid()}"

# No test depends on the caller's environment: what titanlite and the libraries it uses read
# from it is pinned (pytest_configure below), for pytest's process and every process it starts,
# before a test module imports them (huggingface_hub and datasets read theirs at import).
PINNED_ENV = {
    # Never the network: the Hub is refused at once, W&B writes offline runs (tests read them).
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    # The Hugging Face caches (datasets writes one for local files too) and titanlite's own
    # (the matmul peak that tests measure on a busy machine) stay out of the user's.
    "HF_HOME": str(TEST_CACHE / "huggingface"),
    "TITANLITE_CACHE_DIR": str(TEST_CACHE),
}
UNSET_ENV = (
    # A launcher's world (a shell inside torchrun or a SLURM job) is not the tests' world, and
    # run_train.sh's settings are the ones each test passes.
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "NGPU",
    "NNODES",
    "RDZV_ENDPOINT",
    "RDZV_ID",
    "MAX_RESTARTS",
    "LOG_RANK",
    "CONFIG_FILE",
    "TITANLITE_TORCHRUN",
    # Cache locations that would override HF_HOME's, and W&B credentials and folders.
    "HF_DATASETS_CACHE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "WANDB_API_KEY",
    "WANDB_DIR",
    "WANDB_CACHE_DIR",
    "WANDB_CONFIG_DIR",
    "WANDB_DATA_DIR",
    # titanlite's launcher and debugging variables.
    "TITANLITE_ERROR_FILE",
    "TITANLITE_LAUNCH_TIME",
    "TITANLITE_CUDA_SYNC_CHECK",
    "TITANLITE_INTERRUPT_PIDS",
    "TITANLITE_LAUNCHER_PID",
    "TITANLITE_REQUEUE",
    "TITANLITE_RESIGNAL_S",
    "TITANLITE_SRUN_WAIT",
)


def pytest_configure(config: pytest.Config) -> None:
    """Pin the environment, before pytest imports any test module. (A hook, not code at
    import: the pool's workers import this module too, and their RANK is theirs.)"""
    for name in UNSET_ENV:
        os.environ.pop(name, None)
    os.environ.update(PINNED_ENV)
    # The tests in this process run tiny tensors, one intra-op thread each, as the processes
    # they start do (subprocess_env): two pytest workers share two cores, and threads that
    # spin while the other worker holds a core made the fast subset 1.5x slower (153 s
    # against 100 s, measured beside two training runs). Through the variable torch reads at
    # import, so that a pytest that imports no torch (test_env_independence's) does not.
    threads = os.environ.get("TITANLITE_TEST_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = threads
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def subprocess_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a titanlite subprocess: this interpreter, no network, caches in tmp."""
    env = dict(os.environ)
    env.update(
        PINNED_ENV,  # whatever a test has changed in this process
        TITANLITE_PYTHON=sys.executable,
        WANDB_DIR=str(tmp_path),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        PYTHONUNBUFFERED="1",
        # One intra-op thread per process: the suite runs many processes at once on few
        # cores, and OpenMP threads that spin while others hold the cores slow a run up to
        # tenfold (the quick start took over 600 s so, against 78 s alone).
        OMP_NUM_THREADS=env.get("TITANLITE_TEST_THREADS", "1"),
    )
    env.pop("TITANLITE_ERROR_FILE", None)
    env.update(extra)
    return env


# Every training step after step 3 of a run that started at step 1 (not one resumed, as
# after a torchrun restart or a SLURM requeue) takes 0.5 s more: Trainer.train_step wrapped as
# titanlite.trainer is imported (sitecustomize).
SLOW_STEPS = """
import importlib.util, sys, time
class _Wrap:
    def find_spec(self, name, path=None, target=None):
        if name != "titanlite.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            step, first = module.Trainer.train_step, []
            def slow(trainer, *args, **kwargs):
                first[:] = first or [trainer.state.step]  # the first step this process trains
                out = step(trainer, *args, **kwargs)
                if first[0] == 1 and trainer.state.step > 3:
                    time.sleep(0.5)
                return out
            module.Trainer.train_step = slow
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Wrap())
"""


def slow_steps(folder: Path) -> dict[str, str]:
    """Environment for a run whose steps after step 3 take 0.5 s more (SLOW_STEPS), so that
    what a test does once it saw step 3 (a signal, a kill, a second launch) happens mid-run
    however late this busy machine gets to it: the steps left took about a second."""
    hook = folder / "slow-steps"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SLOW_STEPS)
    return {"PYTHONPATH": str(hook)}


def run_train(
    tmp_path: Path, *args: str, ngpu: int = 1, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    """./run_train.sh ARGS with NGPU processes; output captured. On a timeout the whole
    process group (torchrun and its ranks) is killed, not just the shell."""
    cmd = [str(REPO / "run_train.sh"), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=subprocess_env(tmp_path, NGPU=str(ngpu), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def read_metrics(folder: Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) from a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r.get("kind") != "validation"]
    val = [r for r in lines if r.get("kind") == "validation"]
    return train, val


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session", autouse=True)
def _stop_worker_pools() -> Iterator[None]:
    """Stop tests/pool.py's worker processes when the session ends (if any test used them)."""
    yield
    pool = sys.modules.get("pool")
    if pool is not None and hasattr(pool, "shutdown_pools"):
        pool.shutdown_pools()


@pytest.fixture(scope="module")
def eight_rank_pool_stops_with_the_module() -> Iterator[None]:
    """For the modules that train on 8 ranks (test_parity, test_pipeline): their pool stops
    when the module ends (tests/pool.py close_pool) instead of idling through the session."""
    yield
    pool = sys.modules.get("pool")
    if pool is not None:
        pool.close_pool(8)


# The longest files (measured with --durations, BENCHMARKS.md "Test suite"), longest first.
# scripts/test.sh runs two xdist workers that take whole files in collection order
# (--dist loadfile --no-loadscope-reorder): started first, these run side by side with the
# short files filling in after them, instead of meeting at the end. The SLURM file leads: it
# is the longest in wall time but mostly waits (for its jobs, SLURM's requeue, the daemons),
# so the other worker's pool files use the cores meanwhile; it takes no second file until
# two of its four tests are left.
LONGEST_FIRST = (
    "test_cluster.py",
    "test_ft_recovery.py",
    "test_hf_start.py",
    "test_ft_parity.py",
    "test_ft.py",
    "test_pipeline.py",
    "test_train_e2e.py",
    "test_parity.py",
    "test_checkpoint.py",
    "test_reliability.py",
    "test_resume_layouts.py",
    "test_moe.py",
    "test_observability.py",
    "test_tokens.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept
