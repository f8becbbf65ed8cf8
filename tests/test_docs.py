"""Docs that are generated from code must match it."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_config_reference_is_up_to_date() -> None:
    fresh = subprocess.run(
        [sys.executable, "scripts/config_reference.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert (REPO / "docs" / "config.md").read_text() == fresh, (
        "docs/config.md is stale: run python scripts/config_reference.py > docs/config.md"
    )
