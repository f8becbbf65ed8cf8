"""Pre-tokenized token folders (issue 12, first part): writing, resuming, reading, verifying."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import train_scenarios
from conftest import REPO, subprocess_env
from pool import get_pool
from test_data import make_docs, write_jsonl

from titanlite.data import DEFAULT_TOKENIZER_PATH, DataSpec, Tokenizer, load_tokenizer
from titanlite.data.sources import in_split
from titanlite.data.tokens import META_NAME, TokenFolder, is_token_folder, pretokenize, verify
from titanlite.errors import UserError


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(60, seed=3)


@pytest.fixture()
def spec(tmp_path: Path, docs: list[str]) -> DataSpec:
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    return DataSpec(dataset_path=str(source), validation_fraction=0.1)


def expected(tok: Tokenizer, docs: list[str], split: str) -> np.ndarray:
    texts = [d for d in docs if d.strip() and in_split(d, split, 0.1)]
    return tok.encode_concat(texts).astype(np.int64)


def test_folder_holds_each_splits_token_stream_in_source_order(tmp_path, tok, docs, spec):
    out = tmp_path / "tokens"
    meta = pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    assert meta["complete"] and meta["dtype"] == "uint16" and is_token_folder(out)
    assert len(meta["splits"]["train"]["shards"]) > 2  # several shards, cut at documents
    for split in ("train", "validation"):
        want = expected(tok, docs, split)
        folder = TokenFolder(out, split)
        assert folder.num_tokens == want.size == meta["splits"][split]["tokens"] > 0
        assert np.array_equal(folder.read(0, want.size), want)
        # A read spanning a shard boundary.
        edge = int(folder.starts[1])
        assert np.array_equal(folder.read(edge - 7, 20), want[edge - 7 : edge + 13])
    assert sum(s["documents"] for s in meta["splits"].values()) == len(docs)
    assert "ok (train" in verify(out)


def test_an_interrupted_job_finishes_to_the_same_folder(tmp_path, tok, spec):
    whole = tmp_path / "whole"
    pretokenize(spec, tok, whole, shard_tokens=500, progress=False)

    class Interrupt(Exception):
        pass

    def stop_after_two(shards: int) -> None:
        if shards == 2:
            (cut / "train-00002.bin.tmp").write_bytes(b"half")  # a shard being written
            raise Interrupt

    cut = tmp_path / "cut"
    with pytest.raises(Interrupt):
        pretokenize(spec, tok, cut, shard_tokens=500, progress=False, after_shard=stop_after_two)
    with pytest.raises(UserError, match="did not finish"):
        TokenFolder(cut, "train")
    pretokenize(spec, tok, cut, shard_tokens=500, progress=False)
    assert not list(cut.glob("*.tmp"))
    assert json.loads((cut / META_NAME).read_text()) == json.loads((whole / META_NAME).read_text())


def test_bad_folders_are_one_line_errors(tmp_path, tok, spec):
    good = tmp_path / "good"
    pretokenize(spec, tok, good, shard_tokens=500, progress=False)

    def broken(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        return folder

    truncated = broken("truncated")
    shard = truncated / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated or corrupt shard"):
        TokenFolder(truncated, "train")

    missing = broken("missing")
    (missing / "train-00000.idx").unlink()
    with pytest.raises(UserError, match="missing from the token folder"):
        TokenFolder(missing, "train")

    flipped = broken("flipped")
    shard = flipped / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        verify(flipped)

    with pytest.raises(UserError, match="no tokens.json"):
        TokenFolder(tmp_path, "train")
    other = DataSpec(dataset_path=spec.dataset_path, validation_fraction=0.2)
    with pytest.raises(UserError, match="validation_fraction"):
        pretokenize(other, tok, good, progress=False)


def test_corrupt_metadata_and_out_of_vocabulary_ids_are_one_line_errors(tmp_path, tok, spec):
    good = tmp_path / "good"
    pretokenize(spec, tok, good, shard_tokens=500, progress=False)
    TokenFolder(good, "train").read(0, 100)  # intact: reads

    cut = tmp_path / "cut-json"
    shutil.copytree(good, cut)
    meta = cut / META_NAME
    meta.write_text(meta.read_text()[:-40])  # half-written tokens.json
    with pytest.raises(UserError, match=r"tokens.json: unreadable or corrupt \(") as raised:
        TokenFolder(cut, "train")
    assert "\n" not in str(raised.value)
    meta.write_text('{"format": 99}')
    with pytest.raises(UserError, match="not a titanlite token folder of format 1"):
        TokenFolder(cut, "train")

    # Same size and index, one id past the vocabulary (only --verify's checksums see it).
    wild = tmp_path / "wild"
    shutil.copytree(good, wild)
    shard = wild / "train-00000.bin"
    data = np.fromfile(shard, dtype=np.uint16)
    data[50] = tok.vocab_size + 3
    data.tofile(shard)
    folder = TokenFolder(wild, "train")
    folder.read(0, 50)  # the ids before it are fine
    message = f"token id {tok.vocab_size + 3} >= vocabulary size {tok.vocab_size} near token 40"
    with pytest.raises(UserError, match=message):
        folder.read(40, 20)


def test_an_empty_source_says_so(tmp_path, tok):
    source = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(UserError, match="no documents in"):
        pretokenize(DataSpec(dataset_path=str(source)), tok, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_window_permutation_is_a_bijection():
    from titanlite.data.token_loader import permute

    for n in (1, 2, 3, 7, 64, 1000, 4097):
        out = permute(np.arange(n), n, key=12345)
        assert sorted(out.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), np.arange(1000))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))


def test_loader_global_batches_and_resume_do_not_depend_on_the_layout(tmp_path, tok, spec):
    from titanlite.data import build_dataloader

    out = tmp_path / "tokens"
    pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    folder_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=8)
    one = build_dataloader(tok, folder_spec, 0, 1)
    steps = 12
    reference = [next(one)[0] for _ in range(steps)]
    four_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=2)
    ranks = [build_dataloader(tok, four_spec, r, 4) for r in range(4)]
    for step in range(5):
        got = torch.cat([next(r)[0] for r in ranks])
        assert torch.equal(got, reference[step])
    # Saved on 4 ranks after 5 steps, resumed on 2.
    two_spec = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=4)
    resumed = [build_dataloader(tok, two_spec, r, 2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(ranks[0].state_dict())
    for step in range(5, steps):
        assert torch.equal(torch.cat([next(r)[0] for r in resumed]), reference[step])
    # Windows are whole, shuffled pieces of the train stream.
    stream = TokenFolder(out, "train").read(0, TokenFolder(out, "train").num_tokens)
    first = reference[0][0].numpy()
    starts = [
        i for i in range(0, stream.size - 17, 17) if np.array_equal(stream[i : i + 16], first)
    ]
    assert starts and starts != [0]

    # Another tokenizer: one line naming both.
    other = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    other.fingerprint = "0" * 16
    with pytest.raises(UserError, match="another tokenizer"):
        build_dataloader(other, folder_spec, 0, 1)


def test_validation_pass_covers_the_held_out_tokens_once(tmp_path, tok, spec):
    from titanlite.data import IGNORE_INDEX, build_dataloader

    out = tmp_path / "tokens"
    pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    folder = TokenFolder(out, "validation")
    loader = build_dataloader(
        tok,
        DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=4),
        0,
        1,
        split="validation",
    )
    labels = torch.cat([lab.flatten() for _, lab in loader])
    real = labels[labels != IGNORE_INDEX]
    n = folder.num_tokens
    full = (n // 17) // 4 * 4  # windows in whole global batches of 4
    rest = n - full * 17
    tail = sum(min(17, rest - at) - 1 for at in range(0, rest - 1, 17))
    assert real.numel() == full * 16 + tail > 0
    assert torch.equal(real[:16], torch.from_numpy(folder.read(1, 16)))


# --------------------------------------------------------------------------- training on a folder
TRAIN_STEPS = 12
DEBUG_CONFIG = str(REPO / "train_configs" / "debug_model.toml")
# The tiny model of test_resume_layouts; global batch 4 x 64 tokens; validation twice.
TRAIN_ARGS = [
    "--training.steps",
    str(TRAIN_STEPS),
    "--checkpoint.interval",
    "4",
    "--metrics.log_freq",
    "1",
    "--training.seq_len",
    "64",
    "--model.n_layers",
    "2",
    "--validation.enable",
    "true",
    "--validation.freq",
    "6",
    "--validation.steps",
    "2",
]
PARITY_RTOL = 1e-6


@pytest.mark.slow
def test_a_truncated_shard_stops_a_trainer_process_with_one_error_line(tmp_path, tok, spec):
    """The trainer's entry point (`python -m titanlite.train`'s main, on a rank of the worker
    pool: its status and everything it printed) on a folder whose shard lost its last token:
    refused while building the loader, before the model; status 2."""
    folder = tmp_path / "tokens"
    pretokenize(spec, tok, folder, shard_tokens=500, progress=False)
    shard = folder / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    argv = [
        "--job.config_file",
        DEBUG_CONFIG,
        *TRAIN_ARGS,
        "--training.dataset_path",
        str(folder),
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    pool = get_pool(1)
    (status,) = pool.run(train_scenarios.main, argv=argv)
    output = pool.last_output[0]
    errors = [line for line in output.splitlines() if line.startswith("titanlite: error:")]
    assert status == 2, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    assert str(shard) in errors[0] and "truncated or corrupt shard" in errors[0], errors[0]
    assert "Traceback" not in output


@pytest.fixture(scope="module")
def sotu_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in corpus, pre-tokenized by the script exactly as README's two-step workflow."""
    out = tmp_path_factory.mktemp("sotu") / "tokens"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pretokenize.py"), DEBUG_CONFIG, "--out", str(out)],
        cwd=REPO,
        env=subprocess_env(out.parent),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens/s" in result.stderr  # the progress line
    return out


def train_on(folder: Path, out: Path, world: int, local_batch: int, *args: str) -> dict:
    """Train on the pool with dp_shard = world; rank 0's run (records, run.json)."""
    argv = [
        *TRAIN_ARGS,
        "--training.dataset_path",
        str(folder),
        "--job.dump_folder",
        str(out),
        "--training.local_batch_size",
        str(local_batch),
        *args,
    ]
    return get_pool(world).run(train_scenarios.train, argv=argv)[0]


def curves(run: dict) -> tuple[dict[int, float], dict[int, float]]:
    """(training loss by step, validation loss by step); the last record of a step wins."""
    records = run["records"]
    train = {r["step"]: r["loss"] for r in records if "loss" in r and r.get("kind") != "validation"}
    val = {r["step"]: r["val_loss"] for r in records if r.get("kind") == "validation"}
    return train, val


def worst_relative(want: dict[int, float], got: dict[int, float], steps: range) -> float:
    assert all(s in got for s in steps), f"steps {sorted(got)}, wanted {list(steps)}"
    return max(abs(want[s] - got[s]) / abs(want[s]) for s in steps)


@pytest.fixture(scope="module")
def one_process(sotu_tokens: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("one") / "run"
    run = train_on(sotu_tokens, out, 1, 4)
    train, val = curves(run)
    assert sorted(train) == list(range(1, TRAIN_STEPS + 1)) and sorted(val) == [6, 12]
    assert train[TRAIN_STEPS] < train[1]
    return {"out": out, "train": train, "val": val}


@pytest.mark.slow
def test_four_ranks_on_a_token_folder_match_one_process_and_resume_on_two(
    sotu_tokens: Path, one_process: dict, tmp_path: Path
) -> None:
    """dp_shard=4 (1 sequence each) against one process (4 sequences), training and
    validation loss; then the 4-rank checkpoint of step 8 resumes on 2 ranks."""
    four = train_on(sotu_tokens, tmp_path / "four", 4, 1)
    train, val = curves(four)
    assert four["info"]["parallel_degrees"]["dp_shard"] == 4
    worst = worst_relative(one_process["train"], train, range(1, TRAIN_STEPS + 1))
    assert worst <= PARITY_RTOL, f"training loss: worst relative difference {worst:.3g}"
    worst = worst_relative(one_process["val"], val, range(6, 13, 6))
    assert worst <= PARITY_RTOL, f"validation loss: worst relative difference {worst:.3g}"

    two = tmp_path / "two"
    shutil.copytree(tmp_path / "four" / "checkpoint" / "step-8", two / "checkpoint" / "step-8")
    resumed = train_on(sotu_tokens, two, 2, 2)
    kinds = [r.get("kind") for r in resumed["records"]]
    after = resumed["records"][kinds.index("resume") + 1 :]
    assert [r["step"] for r in after if "loss" in r] == list(range(9, TRAIN_STEPS + 1))
    train, _ = curves(resumed)
    worst = worst_relative(one_process["train"], train, range(9, TRAIN_STEPS + 1))
    assert worst <= PARITY_RTOL, f"resumed on 2 ranks: worst relative difference {worst:.3g}"


@pytest.mark.slow
def test_sigkilled_run_on_a_token_folder_resumes_exactly(
    sotu_tokens: Path, one_process: dict, tmp_path: Path
) -> None:
    """A real trainer process killed with SIGKILL once step-8 is saved; the resumed run (same
    layout) ends with the uninterrupted run's losses, bit for bit. The last save (step-12) is
    held before its completing rename, so however late the kill comes it is not complete."""
    from test_checkpoint import SLOW_COMMIT, Started, steps_since_last_resume

    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_COMMIT)
    args = (*TRAIN_ARGS, "--training.dataset_path", str(sotu_tokens))
    victim = Started(
        out,
        *args,
        "--training.local_batch_size",
        "4",
        PYTHONPATH=str(hook),
        TEST_SLOW_COMMIT=f"step-{TRAIN_STEPS}.partial",
    )
    victim.wait_until("step-8 is saved", lambda: (out / "checkpoint" / "step-8").is_dir())
    victim.proc.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert not (out / "checkpoint" / f"step-{TRAIN_STEPS}").exists()
    resumed = train_on(sotu_tokens, out, 1, 4)
    assert any(r.get("kind") == "resume" for r in resumed["records"])
    assert steps_since_last_resume(out) == list(range(9, TRAIN_STEPS + 1))
    assert curves(resumed)[0] == one_process["train"]


# --------------------------------------------------------------------------- mixtures
def test_interleaving_gives_each_dataset_its_share_of_every_prefix():
    from titanlite.data.mixture import Interleave

    for weights in ([0.7, 0.3], [5, 3, 1, 1], [1, 1, 1]):
        mix = Interleave(weights)
        received = [0] * len(weights)
        worst = 0.0
        for k in range(50_000):
            dataset, n = mix.locate(k)
            assert n == received[dataset]  # each dataset's windows are used in order
            received[dataset] += 1
            if k % 101 == 0:
                assert mix.counts(k + 1) == received  # the closed form matches
                worst = max(worst, mix.worst_deviation(k + 1))
        assert worst <= 1.0, (weights, worst)  # within one window of the weights, any prefix
        total = sum(weights)
        for got, w in zip(received, weights, strict=True):
            assert abs(got / 50_000 - w / total) < 1e-4


def test_the_worst_deviation_over_a_run_is_the_worst_of_every_prefix(monkeypatch):
    """worst_deviation_upto(k) (the run's figure, from the rule's period) against the brute
    force over every prefix; at 2^-6 weight units the period is 64 windows, so k up to 3,000
    crosses it dozens of times."""
    from titanlite.data import mixture

    for units in (1 << 6, 1 << 20):
        monkeypatch.setattr(mixture, "_WEIGHT_DENOMINATOR", units)
        for weights in ([0.7, 0.3], [5, 3, 1, 1], [1, 1, 1], [0.9, 0.05, 0.05]):
            mix = mixture.Interleave(weights)
            worst = 0.0
            for k in range(3_000):
                worst = max(worst, mix.worst_deviation(k))
                if k % 37 == 0 or k == 2_999:
                    assert mix.worst_deviation_upto(k) == pytest.approx(worst, abs=1e-9), (k, units)
            assert mix.worst_deviation_upto(10**12) <= 1.0  # any run length: one pass of <= U
    # The deviation at the end can be 0 while the run strayed: 10 periods of 64 windows.
    monkeypatch.setattr(mixture, "_WEIGHT_DENOMINATOR", 1 << 6)
    mix = mixture.Interleave([0.7, 0.3])
    assert mix.worst_deviation(640) == 0 < mix.worst_deviation_upto(640)


@pytest.fixture()
def two_folders(tmp_path: Path, tok: Tokenizer) -> tuple[Path, Path]:
    out = []
    for name, seed, docs in (("a", 11, 80), ("b", 12, 6)):  # b is small: it wraps epochs
        source = write_jsonl(tmp_path / f"{name}.jsonl", make_docs(docs, seed=seed))
        spec = DataSpec(dataset_path=str(source), validation_fraction=0.1)
        pretokenize(spec, tok, tmp_path / name, shard_tokens=700, progress=False)
        out.append(tmp_path / name)
    return out[0], out[1]


def test_mixture_batches_follow_the_weights_for_any_layout(tok, two_folders):
    from titanlite.data.mixture import MixtureLoader, Part

    seq = 16

    def windows(folder: Path) -> set[tuple[int, ...]]:
        stream = TokenFolder(folder, "train").read(0, TokenFolder(folder, "train").num_tokens)
        return {tuple(stream[i : i + seq + 1]) for i in range(0, stream.size - seq, seq + 1)}

    def parts(batch: int, weights=(0.75, 0.25)) -> list[Part]:
        return [
            Part(f.name, w, DataSpec(dataset_path=str(f), seq_len=seq, local_batch_size=batch))
            for f, w in zip(two_folders, weights, strict=True)
        ]

    one = MixtureLoader(tok, parts(8), 0, 1)
    steps = 40  # 320 windows, 80 of them b's: more than b has, so it starts a new epoch
    reference = []
    for _ in range(steps):
        inputs, labels = next(one)
        reference.append(torch.cat([inputs, labels[:, -1:]], dim=1))
    rows = torch.cat(reference)
    a, b = windows(two_folders[0]), windows(two_folders[1])
    assert rows.shape[0] * 0.25 > len(b)
    source = [(tuple(r.tolist()) in a, tuple(r.tolist()) in b) for r in rows]
    assert all(x != y for x, y in source)  # every window is a whole window of one folder
    share_a = sum(x for x, _ in source) / len(source)
    assert abs(share_a - 0.75) <= 1 / len(source)
    assert one.realized() == {"a": share_a, "b": 1 - share_a}

    # Four ranks give the same global batches; their state resumes on two ranks.
    ranks = [MixtureLoader(tok, parts(2), r, 4) for r in range(4)]
    for step in range(15):
        got = torch.cat([torch.cat([i, lab[:, -1:]], 1) for i, lab in map(next, ranks)])
        assert torch.equal(got, reference[step])
    state = ranks[0].state_dict()
    resumed = [MixtureLoader(tok, parts(4), r, 2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(15, steps):
        got = torch.cat([torch.cat([i, lab[:, -1:]], 1) for i, lab in map(next, resumed)])
        assert torch.equal(got, reference[step])
    # Other weights are another run: refused, naming what changed.
    with pytest.raises(UserError, match="weights"):
        MixtureLoader(tok, parts(8, (0.5, 0.5)), 0, 1).load_state_dict(state)


def test_mixture_config_and_its_errors(tmp_path, two_folders):
    from titanlite.checks import check
    from titanlite.config import ConfigError, load_config, to_toml

    a, b = two_folders
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[[training.datasets]]\npath = "{a}"\nweight = 3\n\n'
        f'[[training.datasets]]\npath = "{b}"\nname = "bee"\n'
    )
    cfg = load_config(["--job.config_file", str(toml)])
    assert [(e.path, e.weight, e.name) for e in cfg.training.datasets] == [
        (str(a), 3.0, ""),
        (str(b), 1.0, "bee"),
    ]
    again = tmp_path / "resolved.toml"
    again.write_text(to_toml(cfg))  # what a run writes to config.toml reads back the same
    assert load_config(["--job.config_file", str(again)]).training.datasets == cfg.training.datasets
    cli = load_config([f"--training.datasets={a}:0.7,{b}"]).training.datasets
    assert [(e.path, e.weight) for e in cli] == [(str(a), 0.7), (str(b), 1.0)]

    bad = tmp_path / "bad.toml"
    bad.write_text(f'[[training.datasets]]\npath = "{a}"\nwieght = 2\n')
    with pytest.raises(ConfigError, match="wieght.*did you mean 'weight'"):
        load_config(["--job.config_file", str(bad)])
    with pytest.raises(ConfigError, match=r"datasets\[1\].weight: must be > 0"):
        load_config([f"--training.datasets={a},{b}:0"])
    with pytest.raises(ConfigError, match="two entries are named 'a'"):
        load_config([f"--training.datasets={a},{a}"])
    text = write_jsonl(tmp_path / "t.jsonl", ["some text"])
    with pytest.raises(UserError, match=r"datasets\[1\].path: .* is not a pre-tokenized folder"):
        check(load_config([f"--training.datasets={a},{text.parent}"]), 1)


@pytest.mark.slow
def test_training_on_a_mixture_reports_each_datasets_validation_loss(
    sotu_tokens: Path, tmp_path: Path, tok: Tokenizer
) -> None:
    source = write_jsonl(tmp_path / "synthetic.jsonl", make_docs(400, seed=5))
    synthetic = tmp_path / "synthetic"
    pretokenize(DataSpec(dataset_path=str(source)), tok, synthetic, progress=False)
    argv = [
        *TRAIN_ARGS,
        "--training.steps",
        "6",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.local_batch_size",
        "4",
        f"--training.datasets={sotu_tokens}:3,{synthetic}",
    ]
    pool = get_pool(1)
    run = pool.run(train_scenarios.train, argv=argv)[0]
    (record,) = [r for r in run["records"] if r.get("kind") == "validation"]
    assert record["step"] == 6
    parts = {"tokens": record["val_loss_tokens"], "synthetic": record["val_loss_synthetic"]}
    assert parts["synthetic"] != parts["tokens"]
    assert min(parts.values()) < record["val_loss"] < max(parts.values())
    logs = "\n".join(pool.last_logs[0])
    assert "data mixture after 24 windows: tokens 75.00% (weight 75.00%)" in logs, logs[-2000:]
    assert "now, at most 0.50 over the run" in logs, logs[-2000:]  # weights 3:1, every prefix


@pytest.mark.slow
def test_later_validation_passes_reuse_the_first_passes_batches(tmp_path: Path) -> None:
    """The text stream finds held-out documents by scanning the corpus: only the first pass
    does; the second (same weights) gives the identical loss from the kept batches, and so
    does a restarted trainer, from the batches each rank kept in the dump folder."""
    argv = [
        *TRAIN_ARGS,
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--validation.steps",
        "3",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ]
    pool = get_pool(2)
    first, second = pool.run(train_scenarios.validate_twice, argv=argv)[0]
    assert first["val_loss"] == second["val_loss"] and first["val_tokens"] == 3 * 4 * 64
    logs = pool.last_logs[0]
    assert sum("kept for later passes" in line for line in logs) == 1, logs
    assert sum("data: first validation batch" in line for line in logs) == 1, logs
    # A restart in the same dump folder reads each rank's kept batches from disk: no scan.
    assert sorted(p.name for p in (tmp_path / "run" / "validation").iterdir()) == [
        "dp0-of-2.pt",
        "dp1-of-2.pt",
    ]
    restarted = pool.run(train_scenarios.validate_twice, argv=argv)[0]
    assert [r["val_loss"] for r in restarted[-2:]] == [first["val_loss"]] * 2
    logs = pool.last_logs[0]
    assert sum("3 batches read from" in line for line in logs) == 1, logs
    assert not any("data: first validation batch" in line for line in logs), logs
    # Over the cache's size (here: 2 of the 3 batches), every pass reads them again.
    small = 2 * 2 * 64 * 8 * 2  # two batches of 2 x 64 int64 inputs and labels
    again = pool.run(train_scenarios.validate_twice, argv=argv, cache_bytes=small)[0]
    assert again[-2]["val_loss"] == again[-1]["val_loss"] == first["val_loss"]  # appended
    logs = pool.last_logs[0]
    assert sum("over the 0 MiB cache" in line for line in logs) == 1, logs  # found once
    assert sum("data: first validation batch" in line for line in logs) == 2, logs


def test_another_holdout_fraction_is_a_warning_not_a_new_split(tmp_path, tok, spec, caplog):
    from titanlite.data import build_dataloader

    out = tmp_path / "tokens"
    pretokenize(spec, tok, out, shard_tokens=500, progress=False)
    other = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=2, validation_fraction=0.3)
    with caplog.at_level("WARNING"):
        build_dataloader(tok, other, 0, 1)
    assert "made at validation_fraction 0.1" in caplog.text and "0.3 does not change" in caplog.text
    caplog.clear()
    same = DataSpec(dataset_path=str(out), seq_len=16, local_batch_size=2, validation_fraction=0.1)
    with caplog.at_level("WARNING"):
        build_dataloader(tok, same, 0, 1)
    assert "validation_fraction" not in caplog.text


# --------------------------------------------------------------------------- split by rank


@pytest.mark.slow  # a process start or a pool run: not for the fast subset
def test_text_stream_split_by_rank_resumes_exactly_at_the_same_degree_only(tmp_path: Path):
    """training.split_by_rank on the built-in corpus, 2 ranks: the step-4 checkpoint (each
    rank's own position in DCP) resumes bit for bit; on 1 rank it is a one-line error, exit 2."""
    args = [
        *TRAIN_ARGS,
        "--training.split_by_rank",
        "true",
        "--training.steps",
        "8",
        "--validation.enable",
        "false",
        "--training.local_batch_size",
        "2",
    ]
    pool = get_pool(2)
    full = pool.run(train_scenarios.train, argv=[*args, "--job.dump_folder", str(tmp_path / "a")])
    losses, _ = curves(full[0])
    assert sorted(losses) == list(range(1, 9))
    again = tmp_path / "b" / "checkpoint" / "step-4"
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-4", again)
    sidecar = json.loads((again / "titanlite.json").read_text())
    assert sidecar["states"]["dataloader"] == {"format": 2, "split_by_rank": 2}
    resumed, _ = curves(
        pool.run(train_scenarios.train, argv=[*args, "--job.dump_folder", str(tmp_path / "b")])[0]
    )
    assert {s: resumed[s] for s in range(5, 9)} == {s: losses[s] for s in range(5, 9)}

    shutil.rmtree(tmp_path / "b" / "checkpoint" / "step-8")
    one = get_pool(1)
    status = one.run(
        train_scenarios.main,
        argv=[*args, "--job.config_file", DEBUG_CONFIG, "--job.dump_folder", str(tmp_path / "b")],
    )
    message = [line for line in one.last_output[0].splitlines() if "saved per rank" in line]
    assert status == [2] and len(message) == 1, one.last_output[0][-3000:]
    assert "by 2 data-parallel ranks (training.split_by_rank), this run has 1" in message[0]
