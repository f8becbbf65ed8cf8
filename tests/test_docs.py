"""Docs must match the code: the generated config reference, the tests they cite."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_config_reference_is_up_to_date() -> None:
    fresh = subprocess.run(
        [sys.executable, "scripts/config_reference.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (REPO / "docs" / "config.md").read_text() == fresh, (
        "docs/config.md is stale: run python scripts/config_reference.py > docs/config.md"
    )


def test_the_tests_the_docs_cite_exist() -> None:
    """README, BENCHMARKS and docs/ name tests as evidence (`test_file::test_name`, a name,
    or a prefix ending in "..."); each must still be a test file or a function in tests/."""
    import re

    names = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    for path in (REPO / "tests").glob("*.py"):
        names |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    missing = []
    for doc in [REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")]:
        prose = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)  # not code blocks
        for m in re.finditer(r"\b(test_\w+?)(\.py)?(\.\.\.)?(?!\w)", prose):
            name, _, prefix = m.groups()
            found = any(n.startswith(name) for n in names) if prefix else name in names
            if not found:
                missing.append(f"{doc.relative_to(REPO)}: {name}")
    assert not missing, f"docs cite tests that do not exist: {missing}"
