"""μP scenarios for tests/test_mup.py, run on the reused worker pool (tests/pool.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def coord(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """scripts/coord_check.py's measurement in this worker (one process)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import coord_check

    return coord_check.coord_check(**kwargs)
