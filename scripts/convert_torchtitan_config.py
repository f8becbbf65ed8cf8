"""Convert a TorchTitan v0.2.x TOML config into a titanlite config.

    python scripts/convert_torchtitan_config.py llama3_8b.toml train_configs/my_8b.toml [--force]

Every TorchTitan key titanlite ignores is printed on stderr and listed as a comment at the top
of OUT. A setting titanlite cannot honour (pipeline or context parallelism, float8, MoE models,
...) stops the conversion: nothing is written and the exit status is 2. docs/config.md ("TorchTitan
v0.2 configs") has the key-by-key table. OUT is written atomically and never overwritten
without --force.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from titanlite.config.job_config import JobConfig
from titanlite.config.parse import apply_toml, read_toml
from titanlite.config.render import toml_value
from titanlite.config.torchtitan import Conversion, convert, looks_like_torchtitan
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.files import atomic_write

PROG = "convert_torchtitan_config"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="TorchTitan TOML config to read")
    parser.add_argument("out", type=Path, help="titanlite TOML config to write")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    return parser.parse_args(argv)


def render(conv: Conversion, source: Path) -> str:
    """OUT's text: a header naming the source and the ignored keys, then the sections."""
    lines = [f"# Converted from the TorchTitan config {source} by scripts/{PROG}.py."]
    if conv.dropped:
        lines.append("# TorchTitan keys titanlite ignores:")
        lines += [f"#   {note.line()}" for note in conv.dropped]
    for section, table in conv.config.items():
        lines += ["", f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(line.replace("\n", " ") for line in lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    try:
        atomic_write(path, text)
    except OSError as e:
        raise UserError(f"cannot write {str(path)!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    data = read_toml(str(args.source))
    if not looks_like_torchtitan(data):
        raise UserError(
            f"{str(args.source)!r} does not look like a TorchTitan config (it names no key only"
            " TorchTitan has, such as model.hf_assets_path); a titanlite config needs no conversion"
        )
    if args.out.is_dir():
        raise UserError(f"{str(args.out)!r} is a folder; give the file to write")
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    conv = convert(data)
    for line in conv.report_lines():
        print(line, file=sys.stderr)
    if conv.blocking:
        raise UserError(
            f"{len(conv.blocking)} setting(s) marked blocking above cannot be honoured by"
            f" titanlite; change them in {str(args.source)!r} and convert again (nothing written)"
        )
    apply_toml(JobConfig(), conv.config, str(args.out))  # a converter bug if this raises
    write_atomically(args.out, render(conv, args.source))
    print(f"wrote {args.out} ({len(conv.mapped)} keys mapped, {len(conv.dropped)} ignored)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"{PROG}: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
