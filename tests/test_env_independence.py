"""The suite does not depend on the environment it is started in: conftest pins what titanlite
and its libraries read (offline Hub and W&B, their caches, no launcher's world), whatever the
caller has set and from whatever folder pytest starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import PINNED_ENV, TEST_CACHE, UNSET_ENV, subprocess_env

# What a developer's shell or a CI job may well have set.
HOSTILE = {
    "WANDB_MODE": "disabled",
    "WANDB_API_KEY": "x" * 40,
    "HF_HUB_OFFLINE": "0",
    "HF_DATASETS_OFFLINE": "0",
    "TRANSFORMERS_OFFLINE": "0",
    "OMP_NUM_THREADS": "7",
    "CI": "true",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "3",
    "MASTER_ADDR": "10.11.12.13",
    "TITANLITE_ERROR_FILE": "/nonexistent/error.json",
    "NNODES": "4",
    "CONFIG_FILE": "/nonexistent/their.toml",
}


def test_tests_see_the_pinned_environment(tmp_path: Path) -> None:
    """True in every run of the suite, the hostile one below included."""
    assert {name: os.environ.get(name) for name in PINNED_ENV} == PINNED_ENV
    assert [name for name in UNSET_ENV if name in os.environ] == []
    # Libraries that read their variables once, at import, read the pinned values.
    import datasets.config
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
    assert Path(huggingface_hub.constants.HF_HOME) == TEST_CACHE / "huggingface"
    env = subprocess_env(tmp_path)  # what titanlite processes started by tests get
    assert {name: env[name] for name in PINNED_ENV} == PINNED_ENV
    assert env["OMP_NUM_THREADS"] == os.environ.get("TITANLITE_TEST_THREADS", "1")
    assert "TITANLITE_ERROR_FILE" not in env


def test_a_hostile_caller_environment_and_folder_change_nothing(tmp_path: Path) -> None:
    """pytest started from another folder, in an environment that sets W&B online-capable,
    the Hub reachable, caches elsewhere and a launcher's world: the tests see the same."""
    theirs = {**HOSTILE, "HF_HOME": str(tmp_path / "their-hf")}
    theirs["TITANLITE_CACHE_DIR"] = str(tmp_path / "their-cache")
    test = f"{Path(__file__).resolve()}::test_tests_see_the_pinned_environment"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={**os.environ, **theirs},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing in their caches
