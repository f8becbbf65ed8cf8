"""Hang dumps: the text one rank writes when it hangs, and the one line naming who is missing.

A dump (``DUMP_FOLDER/health/hang-<step>/rank-<r>.txt``) is a header of ``key=value`` lines
(rank, host, pid, step, times), the rank's collective record (``record.format_lines``) and
the Python stacks of all its threads. ``diagnose`` reads the dumps of one hang and names the
rank(s) that never entered the collective the others wait in (a rank's count of a group's
collectives is below the waited one's sequence number), or that wrote no dump (stopped, or
gone with its node). Plain Python over files: tests write dumps of their own.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DUMP_NAME = re.compile(r"rank-(\d+)\.txt")
WRITTEN_WINDOW_S = 30.0
"""Dumps of one hang are written within the timeout plus this of each other (each rank at its
own last progress plus the timeout); older ones come from an earlier attempt."""


@dataclass
class Dump:
    """One rank's dump, parsed."""

    rank: int
    header: dict[str, str]
    entries: list[dict[str, str]] = field(default_factory=list)
    entered: dict[str, int] = field(default_factory=dict)  # channel -> collectives entered
    folder: Path | None = None

    @property
    def written(self) -> float:
        return float(self.header.get("written", "0"))

    def waiting(self) -> list[dict[str, str]]:
        """The entries a thread of this rank is blocked in, oldest first."""
        return [e for e in self.entries if e.get("state") == "waiting"]


def attempt_tag() -> str:
    """The same for every rank of one launch attempt (torchrun's run id, restart count and
    store): a dump with another tag is left over from an earlier attempt."""
    env = os.environ
    return (
        f"{env.get('TORCHELASTIC_RUN_ID', '-')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        f"{env.get('MASTER_ADDR', '-')}:{env.get('MASTER_PORT', '-')}"
    )


def dump_text(header: dict[str, Any], record_lines: list[str]) -> str:
    """A dump: the header, the collective record, then every thread's Python stack."""
    lines = ["titanlite hang dump", *(f"{k}={v}" for k, v in header.items())]
    lines += ["== collectives ==", *record_lines, "== python stacks ==", *python_stacks()]
    return "\n".join(lines) + "\n"


def python_stacks() -> list[str]:
    """Every thread's stack, the main thread first."""
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    lines = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda i: i[0] != main):
        thread = threads.get(ident)
        name = thread.name if thread is not None else "?"
        lines.append(f"thread {name} (ident {ident}{', main' if ident == main else ''}):")
        lines += ["  " + line for line in "".join(traceback.format_stack(frame)).splitlines()]
    return lines


def main_thread_place() -> str:
    """Where the main thread is: its innermost frame outside torch and this package (the code
    that called the collective, or that never got to one), as ``path:line in function``."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "-"
    stack = traceback.extract_stack(frame)
    ignored = (f"{os.sep}torch{os.sep}", f"health{os.sep}record", "contextlib.py")
    ours = [f for f in stack if not any(part in f.filename for part in ignored)] or stack
    place = ours[-1]
    return f"{_short(place.filename)}:{place.lineno} in {place.name}"


def _short(path: str) -> str:
    """The path from ``titanlite/`` on, or from inside site-packages."""
    ours, theirs = f"{os.sep}titanlite{os.sep}", f"site-packages{os.sep}"
    if ours in path:
        return path[path.rindex(ours) + 1 :]
    if theirs in path:
        return path[path.rindex(theirs) + len(theirs) :]
    return path


def read_dump(path: Path) -> Dump:
    rank = int(DUMP_NAME.fullmatch(path.name).group(1))  # type: ignore[union-attr]
    dump = Dump(rank, {}, folder=path.parent)
    section = "header"
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("== "):
            section = line.strip("= ")
        elif section == "header" and "=" in line:
            key, _, value = line.partition("=")
            dump.header[key] = value
        elif section == "collectives" and line.startswith("  ") and "=" in line:
            fields = dict(part.partition("=")[::2] for part in line.split())
            if "state" in fields:
                dump.entries.append(fields)
            elif "entered" in fields:
                dump.entered[fields["channel"]] = int(fields["entered"])
    return dump


def _read_all(folder: Path) -> list[Dump]:
    """The readable dumps in ``folder`` (one cut short or not a dump is passed over)."""
    dumps = []
    for path in sorted(folder.glob("rank-*.txt")):
        if DUMP_NAME.fullmatch(path.name):
            try:
                dumps.append(read_dump(path))
            except (OSError, ValueError):
                continue
    return dumps


def dumped_ranks(folder: Path, since: float) -> list[int]:
    """The ranks with a dump in ``folder`` written since ``since`` (from names and times)."""
    ranks = []
    for path in folder.glob("rank-*.txt"):
        match = DUMP_NAME.fullmatch(path.name)
        try:
            if match and path.stat().st_mtime >= since:
                ranks.append(int(match.group(1)))
        except OSError:  # replaced meanwhile
            continue
    return sorted(ranks)


def read_dumps(folder: Path, *, window_s: float | None = None) -> dict[int, Dump]:
    """The dumps of the hang in ``folder``, by rank: its own, and for a rank that wrote none
    there, one in a sibling ``hang-*`` folder (a rank that hung a step earlier or later);
    only those of the same attempt written within ``window_s`` of the newest in ``folder``
    (default: the timeout plus WRITTEN_WINDOW_S)."""
    here = _read_all(folder)
    if not here:
        return {}
    anchor = max(here, key=lambda d: d.written)
    if window_s is None:
        window_s = float(anchor.header.get("timeout_s", "0")) + WRITTEN_WINDOW_S
    siblings = sorted(folder.parent.glob("hang-*"))
    others = [d for sibling in siblings if sibling != folder for d in _read_all(sibling)]
    found: dict[int, Dump] = {}
    for dump in here + others:  # this folder's first: a rank's dump here wins
        same = dump.header.get("attempt") == anchor.header.get("attempt")
        if same and abs(dump.written - anchor.written) <= window_s and dump.rank not in found:
            found[dump.rank] = dump
    return found


def diagnose(folder: Path | str, *, window_s: float | None = None) -> str:
    """One line: the step, the rank(s) the others wait for and the collective they wait in,
    and where the dumps are."""
    folder = Path(folder)
    dumps = read_dumps(folder, window_s=window_s)
    where = f"(dumps in {folder}{os.sep})"
    if not dumps:
        return f"hang: no dumps in {folder} {where}"
    first = dumps[min(dumps)]
    step = first.header.get("step", "?")
    world = max(int(d.header.get("world_size", "0")) for d in dumps.values())
    findings, named = _findings(dumps)
    silent = [r for r in range(world) if r not in dumps and r not in named]
    if silent:
        findings.append(f"no dump from {_ranks(silent)} (stopped or gone)")
    return f"hang at step {step}: {'; '.join(findings)} {where}"


def _findings(dumps: dict[int, Dump]) -> tuple[list[str], set[int]]:
    """What the line says (before the ranks that wrote no dump and are not in it), and the
    ranks without a dump it names."""
    waits: dict[tuple[str, int], dict[str, Any]] = {}
    for dump in dumps.values():
        for entry in dump.waiting():
            key = (entry["channel"], int(entry["seq"]))
            wait = waits.setdefault(
                key, {"ops": {}, "start": float(entry["start"]), "entry": entry}
            )
            wait["ops"][dump.rank] = entry["op"]
            wait["start"] = min(wait["start"], float(entry["start"]))
    if not waits:
        places = [f"rank {r} is at {d.header.get('where', '-')}" for r, d in sorted(dumps.items())]
        return ["no rank waits in a recorded collective; " + ", ".join(places[:8])], set()
    ranked = []
    for (channel, seq), wait in waits.items():
        members = _members(channel, wait["entry"])
        absent = [r for r in members if r not in dumps]
        never = _never(dumps, members, wait["ops"], channel=channel, seq=seq)
        ranked.append((not (absent or never), -len(wait["ops"]), wait["start"], channel, seq))
    _, _, _, channel, seq = min(ranked)  # one that names someone, most waiters, oldest
    wait = waits[(channel, seq)]
    entry, waiters = wait["entry"], sorted(wait["ops"])
    members = _members(channel, entry)
    absent = [r for r in members if r not in dumps]
    never = _never(dumps, members, wait["ops"], channel=channel, seq=seq)
    verb = "waits" if len(waiters) == 1 else "wait"
    what = f"{entry['op']} #{seq} of ranks {_list(members)}"
    missed = f"never entered {what}, in which {_ranks(waiters)} {verb}"
    if _is_p2p(channel):  # point to point: #seq counts the messages from src to dst
        src, dst = _ends(channel)
        if waiters == [dst]:
            what = f"{entry['op']} #{seq} from {'any rank' if src is None else f'rank {src}'}"
            missed = f"never sent message #{seq} to rank {dst}, which waits in {entry['op']}"
        else:
            what = f"{entry['op']} #{seq} to rank {dst}"
            missed = f"never received message #{seq} from rank {src}, which waits in {entry['op']}"
    found = []
    if never:
        hosts = ", ".join(f"{r} (host {dumps[r].header.get('host', '?')})" for r in never[:8])
        more = f" and {len(never) - 8} more" if len(never) > 8 else ""
        found.append(f"{'rank' if len(never) == 1 else 'ranks'} {hosts}{more} {missed}")
        found += [_place(r, dumps[r]) for r in never[:4]]
    if absent:
        gone = f"{_ranks(absent)} wrote no dump (stopped or gone)"
        found.append(gone if never else f"{gone} and {_ranks(waiters)} {verb} in {what}")
    if not found:
        ops = set(wait["ops"].values())
        if len(ops) > 1:
            each = ", ".join(f"rank {r} {op}" for r, op in sorted(wait["ops"].items())[:8])
            found.append(f"the ranks of collective #{seq} of {_list(members)} disagree: {each}")
        else:
            found.append(
                f"every rank of {what} entered it and waits (a network fault, or a "
                "collective slower than health.hang_timeout_s)"
            )
    return found, set(absent)


def _never(
    dumps: dict[int, Dump], members: list[int], waiters: dict, *, channel: str, seq: int
) -> list[int]:
    """The members with a dump that had not entered collective ``seq`` of ``channel``."""
    return [
        r
        for r in members
        if r in dumps and r not in waiters and dumps[r].entered.get(channel, 0) < seq
    ]


def _place(rank: int, dump: Dump) -> str:
    own = dump.waiting()
    if own:
        e = own[0]
        ranks = _list([int(r) for r in e["ranks"].split(",") if r])
        return f"rank {rank} waits in {e['op']} #{e['seq']} of ranks {ranks}"
    return f"rank {rank} is at {dump.header.get('where', '-')}"


def _is_p2p(channel: str) -> bool:
    return "->" in channel


def _ends(channel: str) -> tuple[int | None, int | None]:
    """(src, dst) of a P2P channel ``group:src->dst`` (src "any": a receive from any rank)."""
    src, _, dst = channel.rpartition(":")[2].partition("->")
    return (int(src) if src.isdigit() else None, int(dst) if dst.isdigit() else None)


def _members(channel: str, entry: dict[str, str]) -> list[int]:
    """A group's ranks; for a P2P channel, its known ends."""
    if _is_p2p(channel):
        return [r for r in _ends(channel) if r is not None]
    return [int(r) for r in entry["ranks"].split(",") if r]


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}{more}"


def _list(ranks: list[int]) -> str:
    if len(ranks) <= 16:
        return f"[{', '.join(map(str, ranks))}]"
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"
