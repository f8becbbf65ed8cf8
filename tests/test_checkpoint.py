"""Checkpoints with real processes: exact resume after kills, signals and layout changes,
retention, async saves, model-only export, and refusal of bad checkpoints.

One uninterrupted run per module is the baseline; every other run is compared with it by
the LAST metrics record per step (metrics.jsonl is append-only, so a resumed run repeats
the steps after its checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import train_scenarios
from conftest import REPO, subprocess_env
from pool import get_pool

from titanlite.checkpoint import integrity
from titanlite.checkpoint.checkpointer import Checkpointer, ModelIdentity
from titanlite.checkpoint.folders import complete_checkpoints, read_sidecar
from titanlite.config.job_config import Checkpoint as CheckpointConfig
from titanlite.errors import EXIT_PREEMPTED, Interrupted, Preempted, UserError
from titanlite.metrics.jsonl import read_metrics
from titanlite.runtime import stop_vote

pytestmark = pytest.mark.slow

CONFIG = str(REPO / "train_configs" / "debug_model.toml")
STEPS = 12
# Global batch 4 x 64 tokens, 2 layers: a few seconds per step on a busy 2-core machine.
SMALL = [
    "--training.steps",
    str(STEPS),
    "--checkpoint.interval",
    "4",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--training.local_batch_size",
    "4",
    "--training.seq_len",
    "64",
    "--model.n_layers",
    "2",
]
TIMEOUT = 600


# --------------------------------------------------------------------------- helpers
def trainer_cmd(out: Path, *args: str) -> list[str]:
    """One trainer process without torchrun (later arguments override earlier ones)."""
    return [
        sys.executable,
        "-m",
        "titanlite.train",
        "--job.config_file",
        CONFIG,
        *SMALL,
        "--job.dump_folder",
        str(out),
        *args,
    ]


def run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m titanlite.train ...` as one rank of the reused worker pool: the entry point
    itself (exit status, one-line errors), without a process start-up per run. The output is
    stdout and stderr together, in both fields."""
    pool = get_pool(1)
    argv = trainer_cmd(out, *args)[3:]  # what follows `python -m titanlite.train`
    status = pool.run(train_scenarios.main, argv=argv, timeout=TIMEOUT)[0]
    output = pool.last_output[0]
    return subprocess.CompletedProcess(argv, status, output, output)


class Started:
    """A trainer process whose output goes to files (no pipe to fill up while we poll)."""

    def __init__(self, out: Path, *args: str, launcher: bool = False, **env: str):
        """launcher: through ./run_train.sh (torchrun) instead of one plain process."""
        out.parent.mkdir(parents=True, exist_ok=True)
        self.log = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
        self._file = open(self.log, "w")  # noqa: SIM115 (closed in wait)
        cmd = (
            [str(REPO / "run_train.sh"), *SMALL, "--job.dump_folder", str(out), *args]
            if launcher
            else trainer_cmd(out, *args)
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=subprocess_env(out.parent, **env),
            stdout=self._file,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, to signal (or clean up) as one
        )

    def wait_until(
        self, what: str, condition: Callable[[], bool], timeout: float = TIMEOUT
    ) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"trainer exited ({self.proc.returncode}) before {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.01)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT)
        finally:
            self._file.close()
            with contextlib.suppress(ProcessLookupError):  # anything it left behind
                os.killpg(self.proc.pid, signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text()[-4000:]


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()  # being written right now
    return [json.loads(line) for line in lines if line.strip()]


def last_losses(out: Path) -> dict[int, float]:
    """Loss of each step as the run that continued logged it: the LAST record of the step
    (titanlite.metrics.jsonl; a line being written is skipped as malformed)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    return {step: r["loss"] for step, r in read_metrics(path).train.items() if "loss" in r}


def steps_since_last_resume(out: Path) -> list[int]:
    recs = records(out)
    starts = [i for i, r in enumerate(recs) if r.get("kind") == "resume"]
    first = starts[-1] + 1 if starts else 0
    return [r["step"] for r in recs[first:] if "loss" in r]


def step_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoint").iterdir())


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under folder with its size and mtime."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def copy_steps(src_run: Path, dst_run: Path, *steps: int) -> None:
    for step in steps:
        shutil.copytree(
            src_run / "checkpoint" / f"step-{step}", dst_run / "checkpoint" / f"step-{step}"
        )


def assert_same_losses(
    run: Path, baseline: dict[int, float], steps: range, rel: float = 0.0
) -> None:
    got = last_losses(run)
    for step in steps:
        assert step in got, f"step {step} missing from {run}: {sorted(got)}"
        a, b = baseline[step], got[step]
        if rel == 0.0:
            assert a == b, f"step {step}: baseline {a!r}, resumed {b!r}"
        else:
            assert abs(a - b) <= rel * abs(a), f"step {step}: baseline {a!r}, resumed {b!r}"


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


# --------------------------------------------------------------------------- the baseline
@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """12 uninterrupted steps, saving every 2 steps and keeping all (retention 0)."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    result = run(out, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0")
    assert_ok(result)
    losses = last_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return out, losses


def test_keep_latest_k_0_keeps_every_checkpoint(baseline: tuple[Path, dict]) -> None:
    out, _ = baseline
    assert step_dirs(out) == sorted(f"step-{s}" for s in range(2, STEPS + 1, 2))
    for s in range(2, STEPS + 1, 2):
        meta = read_sidecar(out / "checkpoint" / f"step-{s}")
        assert (
            meta["step"] == s
            and meta["states"]["train_state"]["step"] == s
            and not meta["model_only"]
        )


# --------------------------------------------------------------------------- kills
# A SIGKILL between saves and its exact resume is the first case below's (its kill comes at
# a save), test_interrupts' whole-job SIGKILL and test_tokens' token-folder kill.
SLOW_COMMIT = """
import os, time
_replace = os.replace
def _slow_replace(src, dst, *a, **k):
    if str(src).endswith(os.environ["TEST_SLOW_COMMIT"]):
        time.sleep(600)
    return _replace(src, dst, *a, **k)
os.replace = _slow_replace
"""


def test_kill_during_save_resumes_from_previous_and_retention(
    tmp_path: Path, baseline: tuple[Path, dict]
) -> None:
    """SIGKILL while step-8 is written (every shard and .metadata on disk, not yet renamed:
    the most complete a partial save gets) -> the next run resumes from step-4, replaces the
    partial folder, and keep_latest_k=2 leaves exactly the two newest checkpoints."""
    _, base = baseline
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_COMMIT)
    partial = out / "checkpoint" / "step-8.partial"
    keep2 = ("--checkpoint.keep_latest_k", "2")
    victim = Started(out, *keep2, PYTHONPATH=str(hook), TEST_SLOW_COMMIT="step-8.partial")
    victim.wait_until(
        "step-8.partial holds the metadata", lambda: (partial / ".metadata").is_file()
    )
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert step_dirs(out) == ["step-4", "step-8.partial"]
    assert any(partial.glob("*.distcp"))

    result = run(out, *keep2)
    assert_ok(result)
    assert "checkpoint/step-4" in result.stdout + result.stderr
    assert steps_since_last_resume(out) == list(range(5, STEPS + 1))
    assert_same_losses(out, base, range(1, STEPS + 1))
    assert step_dirs(out) == ["step-12", "step-8"]  # partial replaced, step-4 retired


STALL_SHARD = """
import io, os, time
_open = io.open
class _Stalled:
    def __init__(self, f):
        self._f, self._n = f, 0
    def write(self, b):
        n = self._f.write(b)
        self._n += n
        if self._n >= 1 << 20:  # a MiB of the shard is written: stop here, mid-write
            self._f.flush()
            _open(os.environ["TEST_STALLED"], "w").close()
            time.sleep(600)
        return n
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return self._f.__exit__(*exc)
def _stalling_open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    name = str(file)
    if "w" in mode and os.environ["TEST_STALL_SHARD"] in name and name.endswith(".distcp"):
        return _Stalled(f)
    return f
io.open = _stalling_open
"""


def test_kill_during_the_dcp_write_leaves_the_previous_checkpoint_untouched(
    tmp_path: Path,
) -> None:
    """SIGKILL while DCP writes step-8 (1 MiB into its shard file, no .metadata yet): step-4
    keeps every file as it was (size, mtime, checksums), and the next run resumes from it and
    replays steps 5-8 with the same losses. 8 steps: the kill comes during the last save."""
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL_SHARD)
    stalled = tmp_path / "stalled"
    eight = ("--training.steps", "8")
    victim = Started(
        out,
        *eight,
        PYTHONPATH=str(hook),
        TEST_STALL_SHARD="step-8.partial",
        TEST_STALLED=str(stalled),
    )
    victim.wait_until("step-8's shard is half-written", stalled.exists)
    step4, partial = out / "checkpoint" / "step-4", out / "checkpoint" / "step-8.partial"
    before = snapshot(step4)
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert step_dirs(out) == ["step-4", "step-8.partial"]
    assert (partial / "__0_0.distcp").stat().st_size >= 1 << 20
    assert not (partial / ".metadata").exists() and not (partial / "titanlite.json").exists()
    trained = last_losses(out)
    assert sorted(trained) == list(range(1, 9))

    result = run(out, *eight)
    assert_ok(result)
    assert "checkpoint/step-4" in result.stdout
    assert steps_since_last_resume(out) == [5, 6, 7, 8]
    assert last_losses(out) == trained  # steps 5-8 again, bit for bit
    assert snapshot(step4) == before and integrity.problems(step4, 1, 0, 1) == []
    assert step_dirs(out) == ["step-4", "step-8"]


# --------------------------------------------------------------------------- preemption
SLOW_WRITES = """
import io, os, time
_open = io.open
def _slow_open(file, mode="r", *args, **kwargs):
    if "w" in mode and os.environ["TEST_SLOW_WRITES"] in str(file) and ".distcp" in str(file):
        time.sleep(2)
    return _open(file, mode, *args, **kwargs)
io.open = _slow_open
"""


def test_sigusr1_during_an_async_save_loses_nothing(
    tmp_path: Path, baseline: tuple[Path, dict]
) -> None:
    """SIGUSR1 (SLURM's --signal=USR1 preemption notice; SIGTERM takes the same path:
    test_sigterm_through_run_train_exits_75) while the background save of step-4 is still
    writing (its shard files are slowed to 2 s each): the trainer finishes that save, saves
    the step it stops at, exits 75, and the resumed run loses no step and matches the
    baseline."""
    _, base = baseline
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_WRITES)
    partial = out / "checkpoint" / "step-4.partial"
    job = Started(
        out,
        "--checkpoint.async_mode",
        "async",
        PYTHONPATH=str(hook),
        TEST_SLOW_WRITES="step-4.partial",
    )
    job.wait_until("step-4 is being written", partial.is_dir)
    job.proc.send_signal(signal.SIGUSR1)  # while its writer waits 2 s to open the shard
    assert not (out / "checkpoint" / "step-4").exists()
    assert job.wait() == EXIT_PREEMPTED, job.output()
    stopped = max(last_losses(out))
    dirs = step_dirs(out)  # the slowed save, any later one, and the one at the stop
    assert 4 < stopped < STEPS and {"step-4", f"step-{stopped}"} <= set(dirs), dirs
    assert not [d for d in dirs if not d.startswith("step-") or "." in d], dirs
    result = run(out)
    assert_ok(result)
    assert steps_since_last_resume(out) == list(range(stopped + 1, STEPS + 1))
    assert_same_losses(out, base, range(1, STEPS + 1))


def test_a_checkpoint_without_its_sidecar_is_skipped_with_a_warning(
    tmp_path: Path, baseline: tuple[Path, dict]
) -> None:
    """A deleted titanlite.json makes step-8 incomplete: the run says so, resumes from step-4,
    replaces step-8 with a complete one and matches the baseline."""
    base_run, base = baseline
    out = tmp_path / "run"
    copy_steps(base_run, out, 4, 8)
    (out / "checkpoint" / "step-8" / "titanlite.json").unlink()
    result = run(out)
    assert_ok(result)
    assert "ignoring" in result.stdout and "step-8: not a complete checkpoint" in result.stdout
    assert steps_since_last_resume(out) == list(range(5, STEPS + 1))
    assert_same_losses(out, base, range(5, STEPS + 1))
    assert read_sidecar(out / "checkpoint" / "step-8")["step"] == 8


def test_a_stop_signal_during_start_up_says_so() -> None:
    """What a preemption signal during start-up ends the run with (exit 75: the launcher test
    below). The path is the Ctrl-C one, which test_interrupts runs end to end; only the vote's
    level and so the message differ."""
    vote = stop_vote.StopVote.__new__(stop_vote.StopVote)  # no signal handlers installed
    vote.level, vote.signal = stop_vote.PREEMPTED, 15
    error = vote.stopped(1, saved=False, startup=True)
    assert isinstance(error, Preempted)
    assert str(error) == "stopped during start-up on signal 15, before step 1; nothing new to save"
    vote.level = stop_vote.INTERRUPTED
    assert isinstance(vote.stopped(3, saved=True), Interrupted)


def test_sigterm_through_run_train_exits_75(tmp_path: Path) -> None:
    """SLURM preemption signals every process of the job step: run_train.sh, torchrun and
    the ranks. The ranks save; the launcher must exit with 75 too, or nothing requeues. One
    rank, made to go through torchrun: the launcher's side is the same for any rank count."""
    out = tmp_path / "run"
    job = Started(out, launcher=True, NGPU="1", TITANLITE_TORCHRUN="1")
    job.wait_until("step 2 is logged", lambda: max(last_losses(out), default=0) >= 2)
    os.killpg(job.proc.pid, signal.SIGTERM)
    status = job.proc.wait(timeout=TIMEOUT)
    # The ranks (their own process group under torchrun) may outlive a killed launcher.
    stopped = max(last_losses(out))
    saved = out / "checkpoint" / f"step-{stopped}"
    deadline = time.monotonic() + 120
    while not saved.is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
        stopped = max(last_losses(out))
        saved = out / "checkpoint" / f"step-{stopped}"
    job.wait()
    assert stopped < STEPS
    assert read_sidecar(saved)["step"] == stopped
    assert status == EXIT_PREEMPTED, (
        f"the ranks saved and exited 75 but run_train.sh exited {status}"
    )
    assert "stopped at step" in job.output().strip().splitlines()[-1]


# --------------------------------------------------------------------------- bad checkpoints
class Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil(marker)))


def _bytes_entry_pointing_at_a_pickle(ckpt: Path, marker: Path) -> None:
    """A .metadata made only of DCP's own (allow-listed) classes that declares one weight
    as a pickled object stored in a shard: DCP torch.load()s such entries unrestricted."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, trusted file
    key = "model.norm.weight"
    assert key in metadata.state_dict_metadata
    payload = pickle.dumps(Evil(marker))
    (ckpt / "__9_0.distcp").write_bytes(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _as_before_checksums(folder: Path) -> None:
    """Make a checkpoint look saved before checksums existed (no records, no count)."""
    for path in folder.glob("__*.sha256.json"):
        path.unlink()
    sidecar = folder / "titanlite.json"
    meta = json.loads(sidecar.read_text())
    del meta["checksum_ranks"]
    sidecar.write_text(json.dumps(meta))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


BAD = {
    # case: (steps to copy from the baseline, how to spoil them, extra arguments,
    #        words in the error)
    "load_step_missing": ((4, 8), None, ["--checkpoint.load_step", "7"], ["load_step", "step-7"]),
    "truncated_shard": (
        (4, 8),
        lambda c, m: os.truncate(c / "__0_0.distcp", (c / "__0_0.distcp").stat().st_size // 2),
        [],
        ["step-8", "damaged", "__0_0.distcp: truncated", "--checkpoint.load_step 4"],
    ),
    "garbage_shard": (
        (4, 8),
        lambda c, m: (c / "__0_0.distcp").write_bytes(
            os.urandom((c / "__0_0.distcp").stat().st_size)
        ),
        [],
        ["step-8", "__0_0.distcp: checksum mismatch", "previous complete checkpoint is step 4"],
    ),
    "flipped_byte": ((4, 8), lambda c, m: _flip_byte(c / "__0_0.distcp"), [], ["checksum"]),
    # A checkpoint from before checksums: DCP itself finds the damage.
    "truncated_unchecked": (
        (8,),
        lambda c, m: (
            _as_before_checksums(c)
            or os.truncate(c / "__0_0.distcp", (c / "__0_0.distcp").stat().st_size // 2)
        ),
        [],
        ["step-8", "unreadable"],
    ),
    "checksums_deleted": (
        (4, 8),
        lambda c, m: (c / "__0.sha256.json").unlink(),
        [],
        ["step-8", "__0.sha256.json: missing", "--checkpoint.load_step 4"],
    ),
    "code_in_metadata": ((8,), _malicious_metadata, [], ["step-8", "refusing", "system"]),
    "code_in_shard": ((8,), _bytes_entry_pointing_at_a_pickle, [], ["step-8"]),
    "other_model_shape": (
        (8,),
        None,
        ["--model.dim", "128"],
        ["step-8", "different model", "dim=256"],
    ),
    "other_seq_len": ((8,), None, ["--training.seq_len", "32"], ["step-8", "seq_len"]),
}


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_error_line_and_changes_nothing(
    tmp_path: Path, baseline: tuple[Path, dict], case: str
) -> None:
    base_run, _ = baseline
    steps, spoil, args, words = BAD[case]
    out = tmp_path / "run"
    copy_steps(base_run, out, *steps)
    latest = out / "checkpoint" / f"step-{max(steps)}"
    marker = tmp_path / "payload-ran"
    if spoil is not None:
        spoil(latest, marker)
    before = snapshot(out / "checkpoint")

    result = run(out, *args)
    after = snapshot(out / "checkpoint")
    if case != "code_in_shard":
        assert not marker.exists(), "the checkpoint's pickled payload ran"
    assert after == before
    if case == "other_seq_len":  # the data position is optional: skip it and the run goes on
        rerun = run(out, *args, "--checkpoint.exclude_from_loading", "dataloader")
        assert_ok(rerun)
        assert steps_since_last_resume(out) == list(range(9, STEPS + 1))
    assert not marker.exists(), "the checkpoint's pickled payload ran"
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    last = _error_line(result)
    assert last.startswith("titanlite: error: "), result.stderr[-4000:]
    assert str(out / "checkpoint") in last, last
    for word in words:
        assert word in last, (word, last)
    assert "Traceback" not in result.stderr


def test_fallback_to_previous_resumes_from_the_last_good_checkpoint(
    tmp_path: Path, baseline: tuple[Path, dict]
) -> None:
    """checkpoint.fallback_to_previous: the latest checkpoint (step-8) fails its checksum, the
    run warns, resumes from step-4, replaces step-8 with a good one and matches the baseline."""
    base_run, base = baseline
    out = tmp_path / "run"
    copy_steps(base_run, out, 4, 8)
    _flip_byte(out / "checkpoint" / "step-8" / "__0_0.distcp")
    result = run(out, "--checkpoint.fallback_to_previous", "true")
    assert_ok(result)
    warning = [line for line in result.stdout.splitlines() if "fallback_to_previous)" in line]
    assert len(warning) == 1 and "step-8" in warning[0] and "checksum mismatch" in warning[0]
    assert "loading step-4 instead" in warning[0], warning
    assert steps_since_last_resume(out) == list(range(5, STEPS + 1))
    assert_same_losses(out, base, range(5, STEPS + 1))
    assert integrity.problems(out / "checkpoint" / "step-8", 1, 0, 1) == []  # saved again


def test_retired_checkpoints_stop_being_checkpoints_before_their_files_go(
    tmp_path: Path, baseline: tuple[Path, dict]
) -> None:
    """Retention renames a checkpoint before deleting it, in the background: a killed
    deletion leaves a step-N.deleting folder, which is never resumed from (even when it holds
    every file of a newer step) and is removed by the next run."""
    base_run, base = baseline
    out = tmp_path / "run"
    copy_steps(base_run, out, 8, 12)
    (out / "checkpoint" / "step-12").rename(out / "checkpoint" / "step-12.deleting")
    result = run(out, "--checkpoint.keep_latest_k", "1")
    assert_ok(result)
    assert steps_since_last_resume(out) == list(range(9, STEPS + 1))  # from step-8
    assert_same_losses(out, base, range(9, STEPS + 1))
    assert step_dirs(out) == ["step-12"]  # step-8 retired, the leftover removed
    assert "removing" in result.stdout and "step-8" in result.stdout


def test_a_swap_killed_half_way_is_undone_at_start_up(tmp_path: Path) -> None:
    """Saving a step that exists (after a load_step rewind) moves the old folder aside as
    step-N.stale, then renames the new one in. Start-up puts a step-N.stale back when step-N is
    missing (killed between the renames: it is the only complete copy), deletes it when step-N
    is complete, and leaves it beside a step-N that is not complete (in-process, no launch)."""
    folder = tmp_path / "checkpoint"

    def fake(name: str, tag: str, complete: bool = True) -> None:
        path = folder / name
        path.mkdir(parents=True)
        (path / "tag").write_text(tag)
        (path / ".metadata").write_bytes(b"")
        if complete:
            (path / "titanlite.json").write_text("{}")

    fake("step-4.stale", "old 4")  # killed between the two renames
    fake("step-4.partial", "new 4")  # complete but never loaded; replaced by the next save
    fake("step-8", "new 8")  # killed after both renames
    fake("step-8.stale", "old 8")
    fake("step-8.stale.deleting", "a killed deletion", complete=False)
    fake("step-12", "damaged 12", complete=False)  # not from a swap: left for a person
    fake("step-12.stale", "old 12")
    ckpt = Checkpointer(
        {}, CheckpointConfig(), folder, ModelIdentity("llama3", {}), sidecar_fields={}, is_main=True
    )
    ckpt.close()  # waits for the background deletions
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step-12", "step-12.stale", "step-4", "step-4.partial", "step-8"], names
    assert [(folder / f"step-{s}" / "tag").read_text() for s in (4, 8)] == ["old 4", "new 8"]
    assert [s for s, _ in complete_checkpoints(folder)] == [4, 8]


class _Weights:
    """The smallest Stateful: one tensor."""

    def __init__(self) -> None:
        self.w = torch.arange(4.0)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"]


def test_rank_0_finishes_a_save_off_the_training_thread(tmp_path: Path) -> None:
    """save() returns once DCP has written the files; rank 0's finishing (tokenizer, sidecar,
    rename, retention) runs on a thread of its own, and until it ends the save is a .partial
    folder (what a kill then leaves). The next save waits for it; a preemption save
    (force_sync) is complete when it returns (in-process world of one; no launch)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    folder = tmp_path / "checkpoint"
    # Step 1's finishing, then step 2's (and any later one's): each held until released.
    # Step 2's is held too: once it ran, retention (keep_latest_k=1) could retire step 1
    # before the test read it (seen once on a busy machine).
    release, release_later = threading.Event(), threading.Event()
    finishers: list[threading.Thread] = []

    def write_files(path: Path) -> dict:  # the tokenizer copy
        finishers.append(threading.current_thread())
        (release if len(finishers) == 1 else release_later).wait(120)  # bounds a failing run
        return {}

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        ckpt = Checkpointer(
            {"model": _Weights()},
            CheckpointConfig(keep_latest_k=1),
            folder,
            ModelIdentity("llama3", {}),
            sidecar_fields={},
            is_main=True,
            write_files=write_files,
        )
        ckpt.save(1)
        assert not (folder / "step-1").exists(), "save() waited for rank 0's finishing"
        assert (folder / "step-1.partial" / ".metadata").is_file()
        deadline = time.monotonic() + 60
        while not finishers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finishers and finishers[0] is not threading.current_thread()
        ckpt.poll()  # does not wait either
        assert not (folder / "step-1").exists()
        release.set()
        ckpt.save(2)  # waits for step-1 first
        assert read_sidecar(folder / "step-1")["step"] == 1
        release_later.set()
        ckpt.save(3, force_sync=True)
        assert [s for s, _ in complete_checkpoints(folder)] == [3]  # 1 and 2 retired
        assert finishers[-1] is threading.current_thread()
        ckpt.close()
        assert step_dirs(folder.parent) == ["step-3"]
    finally:
        dist.destroy_process_group()


def test_missing_initial_load_path_is_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    missing = tmp_path / "nowhere" / "step-5"
    result = run(out, "--checkpoint.initial_load_path", str(missing))
    assert result.returncode == 2, result.stderr[-4000:]
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("titanlite: error: ") and str(missing) in last and "does not exist" in last
    )
    assert not missing.exists() and not (out / "checkpoint").exists()


def test_sidecar_that_is_not_an_object_is_a_user_error(tmp_path: Path) -> None:
    """titanlite.json holding valid JSON that is not an object (in-process; no launch)."""
    ckpt = tmp_path / "step-3"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "titanlite.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="step-3"):
        read_sidecar(ckpt)


# --------------------------------------------------------------------------- async, export, init
EXPORT = [
    "--checkpoint.async_mode",
    "async",
    "--checkpoint.last_save_model_only",
    "true",
    "--checkpoint.export_dtype",
    "bfloat16",
]


@pytest.fixture(scope="module")
def async_export_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async") / "run"
    assert_ok(run(out, *EXPORT))
    return out


def test_async_saves_do_not_change_training_and_resume_exactly(
    tmp_path: Path, baseline: tuple[Path, dict], async_export_run: Path
) -> None:
    _, base = baseline
    assert_same_losses(async_export_run, base, range(1, STEPS + 1))
    assert step_dirs(async_export_run) == ["step-12", "step-4", "step-8"]
    for s in (4, 8):
        meta = read_sidecar(async_export_run / "checkpoint" / f"step-{s}")
        assert meta["states"]["train_state"]["step"] == s and not meta["model_only"]
        # Written in the background, checksummed there too.
        assert integrity.recorded(async_export_run / "checkpoint" / f"step-{s}")

    out = tmp_path / "run"
    copy_steps(async_export_run, out, 8)
    result = run(out)  # sync resume of an async save
    assert_ok(result)
    assert steps_since_last_resume(out) == list(range(9, STEPS + 1))
    assert_same_losses(out, base, range(9, STEPS + 1))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def test_last_save_model_only_bfloat16_export(async_export_run: Path) -> None:
    ckpt = async_export_run / "checkpoint"
    meta = read_sidecar(ckpt / "step-12")
    assert meta["model_only"] is True and "optimizer_param_groups" not in meta
    metadata = pickle.loads((ckpt / "step-12" / ".metadata").read_bytes())  # trusted: ours
    dtypes = {str(m.properties.dtype) for m in metadata.state_dict_metadata.values()}
    assert dtypes == {"torch.bfloat16"}
    assert all(k.startswith("model.") for k in metadata.state_dict_metadata)
    # weights in 2 bytes vs weights + 2 AdamW moments in 4 bytes each: ~1/6
    assert _dir_bytes(ckpt / "step-12") < 0.25 * _dir_bytes(ckpt / "step-8")


def test_rerun_after_model_only_final_save_does_not_restart(
    tmp_path: Path, async_export_run: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(async_export_run, out)
    # The latest resumable state is step-8; asking for 8 steps must not train anything again.
    result = run(out, *EXPORT, "--training.steps", "8")
    assert_ok(result)
    assert steps_since_last_resume(out) == []
    assert "resumed from checkpoint at step 8" in result.stdout


def test_initial_load_path_loads_weights_and_starts_at_step_1(
    tmp_path: Path, baseline: tuple[Path, dict], async_export_run: Path
) -> None:
    """Fine-tune from the bf16 export: a fresh run (step 1, fresh optimizer and data) whose
    first loss is far below a randomly initialized model's."""
    _, base = baseline
    out = tmp_path / "run"
    source = async_export_run / "checkpoint" / "step-12"
    result = run(out, "--training.steps", "2", "--checkpoint.initial_load_path", str(source))
    assert_ok(result)
    assert "initialized from" in result.stdout + result.stderr
    recs = records(out)
    assert not any(r.get("kind") == "resume" for r in recs)
    losses = last_losses(out)
    assert sorted(losses) == [1, 2]
    assert losses[1] < base[1] - 0.5, (losses[1], base[1])
    assert abs(losses[1] - base[STEPS]) < 0.5, (losses[1], base[STEPS])


def test_verify_checkpoint_script_names_the_damaged_file(
    tmp_path: Path, baseline: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    """The damaged folder through the script as a user runs it (a process of its own: exit
    status and output); the other verdicts through its main() here, the same code without a
    process start-up each."""
    sys.path.insert(0, str(REPO / "scripts"))
    import verify_checkpoint

    base_run, _ = baseline
    run_dir = tmp_path / "run"
    copy_steps(base_run, run_dir, 4, 8)
    folder = run_dir / "checkpoint"

    def verify(path: Path) -> subprocess.CompletedProcess[str]:
        status = verify_checkpoint.main([str(path)])
        out = capsys.readouterr()
        return subprocess.CompletedProcess([str(path)], status, out.out, out.err)

    good = verify(folder)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count(": ok (") == 2 and "checksums" in good.stdout
    _flip_byte(folder / "step-8" / "__0_0.distcp")
    script = [sys.executable, str(REPO / "scripts" / "verify_checkpoint.py"), str(folder)]
    bad = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    lines = bad.stdout.splitlines()
    assert "step-8: DAMAGED: __0_0.distcp: checksum mismatch" in lines[0], lines
    assert "step-4: ok" in lines[1], lines
    assert verify(folder / "step-4").returncode == 0
    missing = verify(tmp_path / "nothing")
    assert missing.returncode == 2 and "no checkpoint there" in missing.stderr
