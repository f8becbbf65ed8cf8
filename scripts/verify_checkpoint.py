"""Check a titanlite checkpoint without loading it: every shard file against the size and
sha256 its rank recorded at save, the sidecar, and DCP's metadata (read with the allow-list).

    python scripts/verify_checkpoint.py FOLDER      # a step-N folder, or a checkpoint folder

A checkpoint folder (holding step-N folders) checks each complete one, newest first. Prints
one line per checkpoint; exits 0 when all are sound, 2 when any is not (or FOLDER is none).
It only reads, so it may run beside the training run that holds the folder (run.lock): a
checkpoint that run retires (keep_latest_k) while it is being checked is reported as retired,
not as damaged.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from titanlite.checkpoint import integrity
from titanlite.checkpoint.folders import SIDECAR, complete_checkpoints, read_sidecar
from titanlite.checkpoint.safe_reader import SafeFileSystemReader
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.runtime import run_lock


def check(folder: Path) -> list[str]:
    """Everything wrong with one step-N folder (empty: sound)."""
    found, ranks = [], None
    try:
        ranks = read_sidecar(folder).get("checksum_ranks")
    except UserError as e:
        found.append(str(e))
    try:
        SafeFileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unreadable or refused: both are findings
        found.append(f".metadata: unreadable ({e})")
    found += integrity.problems(folder, ranks)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    folder: Path = args.folder
    if (folder / SIDECAR).is_file() or (folder / ".metadata").is_file():
        targets = [folder]
    else:
        targets = [path for _, path in reversed(complete_checkpoints(folder))]
    if not targets:
        print(f"titanlite: error: {folder}: no checkpoint there", file=sys.stderr)
        return EXIT_USER_ERROR
    holder = run_lock.live_holder(folder)
    if holder is not None:
        print(f"titanlite: note: a run holds this folder ({holder.describe()})", file=sys.stderr)
    bad = 0
    for target in targets:
        started = time.perf_counter()
        found = check(target)
        if found and holder is not None and not target.exists():
            print(f"{target}: retired by the running run while it was checked")
            continue
        checked = "checksums" if integrity.recorded(target) else "no checksums recorded"
        if found:
            bad += 1
            print(
                f"{target}: DAMAGED: {found[0]}"
                + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
            )
        else:
            size = sum(p.stat().st_size for p in target.glob("*.distcp"))
            print(
                f"{target}: ok ({size / 2**20:,.1f} MiB, {checked}, "
                f"{time.perf_counter() - started:.1f} s)"
            )
    return EXIT_USER_ERROR if bad else 0


if __name__ == "__main__":
    sys.exit(main())
