"""Text sources, packing, data-parallel sharding, the validation split and exact resume."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titanlite.data import (
    DEFAULT_TOKENIZER_PATH,
    IGNORE_INDEX,
    DataSpec,
    Tokenizer,
    build_dataloader,
    load_tokenizer,
)
from titanlite.data import loader as loader_module
from titanlite.data.sources import in_validation, iter_texts, local_files
from titanlite.errors import UserError

WORDS = (
    "the union congress people nation law war peace treasury revenue army navy states "
    "citizens year government public duty trade commerce country liberty justice tax "
    "Café naïve 東京 😀 1790 2026 — “quoted” words and numbers 42 3.14"
).split()


DEFAULT_MIN_READ_CHARS = loader_module._MIN_READ_CHARS


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the Hugging Face Hub: a hub name must fail at once."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read the variables when imported, which may have happened already.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read ~1 K characters per round instead of 256 K, so that the small test corpora span
    many rounds (and saved states fall mid-epoch) as a real corpus does."""
    monkeypatch.setattr(loader_module, "_MIN_READ_CHARS", 1000)


def make_docs(n: int, seed: int = 0, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15)))
            for _ in range(rng.randint(1, max_words // 8))
        ]
        docs.append(f"Document {i}: " + "\n".join(lines))
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_folder(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 documents, one .txt file each (multi-file: the train order is shuffled per epoch)."""
    return write_folder(tmp_path_factory.mktemp("corpus") / "docs", make_docs(40))


def spec_for(path: Path, **overrides) -> DataSpec:
    fields = dict(dataset_path=str(path), seq_len=32, local_batch_size=8, validation_fraction=0.1)
    fields.update(overrides)
    return DataSpec(**fields)


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def stacked(batches) -> torch.Tensor:
    """Windows (inputs plus the last label: seq_len + 1 tokens) of a list of batches."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])


def reference_windows(tok: Tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    stream = [i for d in docs for i in tok.encode(d)]
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)


def doc_ids(tok: Tokenizer, tokens: torch.Tensor) -> set[int]:
    tokens = tokens[tokens >= 0]  # drop IGNORE_INDEX labels of a padded validation tail
    return {int(m) for m in re.findall(r"Document (\d+):", tok.decode(tokens.tolist()))}


# -- packing ---------------------------------------------------------------------------------


def test_windows_are_slices_of_the_bos_eos_stream(tok: Tokenizer, tmp_path: Path) -> None:
    docs = make_docs(12)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    spec = spec_for(path, validation_fraction=0.0, infinite=False, local_batch_size=4)
    batches = list(build_dataloader(tok, spec, 0, 1, split="train"))
    for x, y in batches:
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
        assert (y != IGNORE_INDEX).all()
    expected = reference_windows(tok, docs, 32)
    got = stacked(batches)
    # One finite pass: every full chunk of 4 windows, the partial last chunk dropped.
    assert got.shape[0] == expected.shape[0] // 4 * 4 > 0
    assert torch.equal(got, expected[: got.shape[0]])


def test_infinite_stream_continues_across_epochs(tok: Tokenizer, tmp_path: Path) -> None:
    docs = make_docs(5)
    spec = spec_for(write_jsonl(tmp_path / "d.jsonl", docs), validation_fraction=0.0)
    loader = build_dataloader(tok, spec, 0, 1, split="train")
    per_epoch = sum(len(tok.encode(d)) for d in docs)
    steps = 3 * per_epoch // (8 * 33) + 1
    got = stacked(take(loader, steps))
    expected = reference_windows(tok, docs * 4, 32)  # a single file keeps its order
    assert torch.equal(got, expected[: got.shape[0]])
    assert loader.state_dict()["epoch"] >= 2


def test_sotu_batches_and_resume(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "_MIN_READ_CHARS", DEFAULT_MIN_READ_CHARS)
    spec = DataSpec(seq_len=256, local_batch_size=8)
    loader = build_dataloader(tok, spec, 0, 1, split="train")
    batches = take(loader, 10)
    x, y = batches[0]
    assert x.shape == (8, 256) and torch.equal(x[:, 1:], y[:, :-1])
    assert x[0, 0] == tok.bos_id  # the stream starts with a document
    assert " the " in tok.decode(x[0].tolist())
    state = loader.state_dict()
    # Inside the first round read (about 64 K tokens): its start, and how far into it.
    assert state["epoch"] == 0 and state["skip"] == 10 * 8 * 257
    assert len(json.dumps(state)) < 1000  # no tokens in it: its size does not grow
    continuing = take(loader, 10)
    spec2 = DataSpec(seq_len=256, local_batch_size=4)
    ranks = [continue_from(state, tok, spec2, r, 2, 10) for r in range(2)]
    for step in range(10):
        union = torch.cat([ranks[r][step][0] for r in range(2)])
        assert torch.equal(union, continuing[step][0])


# -- data parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize("world,local", [(4, 2), (2, 4)])
def test_global_batch_is_independent_of_dp_degree(
    tok: Tokenizer, corpus: Path, world: int, local: int
) -> None:
    steps = 30
    single = take(build_dataloader(tok, spec_for(corpus), 0, 1, split="train"), steps)
    spec = spec_for(corpus, local_batch_size=local)
    shards = [
        take(build_dataloader(tok, spec, r, world, split="train"), steps) for r in range(world)
    ]
    for step in range(steps):
        for part in (0, 1):  # inputs, labels
            union = torch.cat([shards[r][step][part] for r in range(world)])
            assert torch.equal(union, single[step][part])
    # Ranks see different data.
    assert not torch.equal(shards[0][0][0], shards[1][0][0])


WORKER = """
import sys, torch
from titanlite.data import DEFAULT_TOKENIZER_PATH, DataSpec, build_dataloader, load_tokenizer
rank, world, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = DataSpec(dataset_path=path, seq_len=32, local_batch_size=8 // world, validation_fraction=0.1)
loader = build_dataloader(load_tokenizer(DEFAULT_TOKENIZER_PATH), spec, rank, world, split="train")
it = iter(loader)
torch.save([next(it) for _ in range(5)], out)
"""


@pytest.mark.slow
def test_ranks_in_separate_processes_share_the_global_batch(
    tok: Tokenizer, corpus: Path, tmp_path: Path
) -> None:
    """Two real processes (as under torchrun) together produce the one-process batches."""
    import subprocess
    import sys

    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", str(corpus), str(outs[r])])
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    shares = [torch.load(out) for out in outs]
    # (The subprocesses read in default-sized rounds, this one in small ones: no difference.)
    single = take(build_dataloader(tok, spec_for(corpus), 0, 1, split="train"), 5)
    for step in range(5):
        union = torch.cat([shares[0][step][0], shares[1][step][0]])
        assert torch.equal(union, single[step][0])


# -- exact resume ----------------------------------------------------------------------------


def continue_from(state, tok, spec, rank, world, n):
    loader = build_dataloader(tok, spec, rank, world, split="train")
    loader.load_state_dict(json.loads(json.dumps(state)))  # state is plain, JSON-able Python
    return take(loader, n)


def test_resume_mid_epoch_is_exact(tok: Tokenizer, corpus: Path) -> None:
    spec = spec_for(corpus)
    uninterrupted = take(build_dataloader(tok, spec, 0, 1, split="train"), 25)
    first = build_dataloader(tok, spec, 0, 1, split="train")
    take(first, 10)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["windows_consumed"] == 80
    resumed = continue_from(state, tok, spec, 0, 1, 15)
    assert torch.equal(stacked(resumed), stacked(uninterrupted[10:]))


def test_resume_across_epoch_boundary_is_exact(tok: Tokenizer, corpus: Path) -> None:
    spec = spec_for(corpus)
    loader = build_dataloader(tok, spec, 0, 1, split="train")
    it = iter(loader)
    states, batches = [], []
    while len(states) < 5 or states[-5]["epoch"] < 1:  # until a few steps into epoch 1
        batches.append(next(it))
        states.append(loader.state_dict())
    boundary = next(i for i, s in enumerate(states) if s["epoch"] == 1)
    extra = [next(it) for _ in range(40)]
    reference = batches + extra
    # Save just before, at, and after the epoch change: the continuation is always identical.
    for saved_at in (boundary - 2, boundary, boundary + 2):
        resumed = continue_from(states[saved_at], tok, spec, 0, 1, 20)
        assert torch.equal(stacked(resumed), stacked(reference[saved_at + 1 : saved_at + 21]))


def test_epochs_shuffle_file_order(tok: Tokenizer, corpus: Path) -> None:
    spec = spec_for(corpus, validation_fraction=0.0)
    epoch_tokens = sum(len(tok.encode(t)) for t in iter_texts(spec, "train"))
    batches = take(build_dataloader(tok, spec, 0, 1, split="train"), 3 * epoch_tokens // (8 * 33))
    text = tok.decode(stacked(batches).flatten().tolist())
    order = [int(m) for m in re.findall(r"Document (\d+):", text)]
    epoch0, epoch1 = order[:40], order[40:80]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1 and epoch0 != sorted(epoch0)


def test_read_ahead_thread_changes_nothing(tok: Tokenizer, corpus: Path) -> None:
    spec = spec_for(corpus)
    threaded = build_dataloader(tok, spec, 0, 1, split="train")
    inline = build_dataloader(tok, spec, 0, 1, split="train", prefetch=False)
    assert torch.equal(stacked(take(threaded, 20)), stacked(take(inline, 20)))
    assert threaded.state_dict() == inline.state_dict()
    resumed = build_dataloader(tok, spec, 0, 1, split="train", prefetch=False)
    resumed.load_state_dict(threaded.state_dict())
    assert torch.equal(stacked(take(resumed, 90)), stacked(take(threaded, 90)))


def test_dropped_loaders_leave_no_threads(tok: Tokenizer, corpus: Path) -> None:
    before = threading.active_count()
    for _ in range(3):
        take(build_dataloader(tok, spec_for(corpus), 0, 1, split="train"), 2)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_state_saved_at_one_rank_loads_at_two(tok: Tokenizer, corpus: Path) -> None:
    spec1 = spec_for(corpus)
    loader = build_dataloader(tok, spec1, 0, 1, split="train")
    take(loader, 7)
    state = loader.state_dict()
    continuing = take(loader, 12)
    spec2 = spec_for(corpus, local_batch_size=4)
    ranks = [continue_from(state, tok, spec2, r, 2, 12) for r in range(2)]
    for step in range(12):
        union = torch.cat([ranks[0][step][0], ranks[1][step][0]])
        assert torch.equal(union, continuing[step][0])
    # ... and back: a state saved by the two ranks (identical on both) loads at one rank.
    a = build_dataloader(tok, spec2, 0, 2, split="train")
    b = build_dataloader(tok, spec2, 1, 2, split="train")
    a.load_state_dict(state)
    b.load_state_dict(state)
    take(a, 5)
    take(b, 5)
    assert a.state_dict() == b.state_dict()
    back = continue_from(a.state_dict(), tok, spec1, 0, 1, 7)
    assert torch.equal(stacked(back), stacked(continuing[5:12]))


def test_state_mismatch_is_a_user_error(tok: Tokenizer, corpus: Path, tmp_path: Path) -> None:
    loader = build_dataloader(tok, spec_for(corpus), 0, 1, split="train")
    take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(UserError, match="seq_len was 32 when saved, now 64"):
        build_dataloader(tok, spec_for(corpus, seq_len=64), 0, 1, split="train").load_state_dict(
            state
        )
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(3))
    with pytest.raises(UserError, match="source was .*docs.* now .*other.jsonl"):
        build_dataloader(tok, spec_for(other), 0, 1, split="train").load_state_dict(state)
    with pytest.raises(UserError, match="different tokenizer"):
        build_dataloader(tok, spec_for(corpus), 0, 1, split="train").load_state_dict(
            {**state, "tokenizer": "0123456789abcdef"}
        )


# -- validation split ------------------------------------------------------------------------


def test_validation_split_is_disjoint_deterministic_and_finite(
    tok: Tokenizer, corpus: Path
) -> None:
    spec = spec_for(corpus, validation_fraction=0.25)
    train_docs = {int(t.split(":")[0].split()[1]) for t in iter_texts(spec, "train")}
    val_docs = {int(t.split(":")[0].split()[1]) for t in iter_texts(spec, "validation")}
    assert train_docs.isdisjoint(val_docs) and train_docs | val_docs == set(range(40))
    assert 3 <= len(val_docs) <= 20

    val = build_dataloader(tok, spec, 0, 1, split="validation")
    first_pass = list(val)  # finite
    assert first_pass and torch.equal(stacked(list(val)), stacked(first_pass))  # restarts
    fresh = list(build_dataloader(tok, spec, 0, 1, split="validation"))
    assert torch.equal(stacked(fresh), stacked(first_pass))  # deterministic
    assert doc_ids(tok, stacked(first_pass)) == val_docs

    train = build_dataloader(tok, spec, 0, 1, split="train")
    it = iter(train)
    seen: set[int] = set()
    while train.state_dict()["epoch"] == 0:
        seen |= doc_ids(tok, next(it)[0])
    assert seen <= train_docs and seen.isdisjoint(val_docs)


def test_validation_last_batch_is_padded_equally_on_all_ranks(tok: Tokenizer, corpus: Path) -> None:
    spec = spec_for(corpus, validation_fraction=0.25, local_batch_size=3)
    spec6 = spec_for(corpus, validation_fraction=0.25, local_batch_size=6)
    one = list(build_dataloader(tok, spec6, 0, 1, split="validation"))
    ranks = [list(build_dataloader(tok, spec, r, 2, split="validation")) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(one)  # no rank waits for the others
    for step in range(len(one)):
        assert torch.equal(torch.cat([ranks[0][step][1], ranks[1][step][1]]), one[step][1])
    last_labels = one[-1][1]
    assert (last_labels == IGNORE_INDEX).any()  # the tail is padded, not dropped
    assert all((y != IGNORE_INDEX).all() for _, y in one[:-1])
    real = torch.cat([y[y != IGNORE_INDEX] for _, y in one])
    stream = [i for t in iter_texts(spec, "validation") for i in tok.encode(t)]
    # Labels are tokens 1..seq_len of each 33-token window, the last window being partial.
    expected = [i for start in range(0, len(stream), 33) for i in stream[start + 1 : start + 33]]
    assert real.tolist() == expected


def test_validation_batches_kept_on_disk_come_back_for_the_same_key_only(
    tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a restarted trainer reads instead of rescanning (titanlite.data.held_out)."""
    from dataclasses import replace

    from titanlite.data import held_out

    source = write_folder(tmp_path / "docs", make_docs(12, seed=4))
    spec = spec_for(source, validation_fraction=0.25, local_batch_size=2)
    batches = list(build_dataloader(tok, spec, 1, 2, split="validation"))  # rank 1 of 2
    assert len(batches) >= 2
    key = held_out.batches_key(spec, tok.fingerprint, dp_rank=1, dp=2, steps=-1)
    path = tmp_path / "run" / "validation" / "dp1-of-2.pt"
    assert held_out.load(path, key) is None  # nothing kept yet
    held_out.save(path, key, batches)
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temporary file left
    back = held_out.load(path, key)
    assert back is not None and len(back) == len(batches)
    for (x, y), (a, b) in zip(back, batches, strict=True):
        assert torch.equal(x, a) and torch.equal(y, b)

    # Everything that determines the batches changes the key, and another key reads nothing.
    others = [
        held_out.batches_key(replace(spec, seq_len=16), tok.fingerprint, dp_rank=1, dp=2, steps=-1),
        held_out.batches_key(
            replace(spec, local_batch_size=3), tok.fingerprint, dp_rank=1, dp=2, steps=-1
        ),
        held_out.batches_key(
            replace(spec, validation_fraction=0.3), tok.fingerprint, dp_rank=1, dp=2, steps=-1
        ),
        held_out.batches_key(
            replace(spec, dataset_path=str(tmp_path)), tok.fingerprint, dp_rank=1, dp=2, steps=-1
        ),
        held_out.batches_key(spec, "0" * 16, dp_rank=1, dp=2, steps=-1),
        held_out.batches_key(spec, tok.fingerprint, dp_rank=0, dp=2, steps=-1),
        held_out.batches_key(spec, tok.fingerprint, dp_rank=1, dp=4, steps=-1),
        held_out.batches_key(spec, tok.fingerprint, dp_rank=1, dp=2, steps=3),
    ]
    assert len({key, *others}) == len(others) + 1
    assert held_out.load(path, others[0]) is None
    (source / "005.txt").write_text("another text, the same file name", encoding="utf-8")
    assert (
        held_out.batches_key(spec, tok.fingerprint, dp_rank=1, dp=2, steps=-1) != key
    )  # the data changed
    assert held_out.batches_key(spec, tok.fingerprint, dp_rank=1, dp=2, steps=-1) not in others

    # A damaged file is only a cache: ignored with a warning.
    path.write_bytes(path.read_bytes()[:200])
    with caplog.at_level("WARNING"):
        assert held_out.load(path, key) is None
    assert f"ignoring {path}" in caplog.text


def test_no_validation_split_when_fraction_is_zero(tok: Tokenizer, corpus: Path) -> None:
    with pytest.raises(UserError, match="validation_fraction is 0"):
        build_dataloader(tok, spec_for(corpus, validation_fraction=0.0), 0, 1, split="validation")


def test_hold_out_rule_is_pinned() -> None:
    # The rule is a hash of the text; pinned so that a code change cannot silently move
    # documents between the splits (which would make validation losses incomparable).
    flags = [in_validation(f"document {i}", 0.5) for i in range(8)]
    assert flags == [True, False, True, True, True, True, True, False]
    share = sum(in_validation(f"document {i}", 0.05) for i in range(10_000)) / 10_000
    assert 0.04 < share < 0.06
    assert not in_validation("anything", 0.0)


# -- local sources ---------------------------------------------------------------------------


def one_pass(tok: Tokenizer, path: Path, **overrides) -> torch.Tensor:
    fields = dict(validation_fraction=0.0, infinite=False, local_batch_size=1)
    spec = spec_for(path, **{**fields, **overrides})
    return stacked(list(build_dataloader(tok, spec, 0, 1, split="train")))


def test_jsonl_json_parquet_and_txt_give_the_same_stream(
    tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    # `datasets` sleeps 5 s after each finished parquet pass (apache/arrow#45214); not under test.
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    docs = make_docs(6)
    expected = one_pass(tok, write_jsonl(tmp_path / "d.jsonl", docs))
    assert torch.equal(expected, reference_windows(tok, docs, 32))
    (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in docs]))
    assert torch.equal(one_pass(tok, tmp_path / "d.json"), expected)
    pq.write_table(pa.table({"body": docs, "n": list(range(6))}), tmp_path / "d.parquet")
    assert torch.equal(one_pass(tok, tmp_path / "d.parquet", text_field="body"), expected)
    # A single .txt file: documents are separated by blank lines.
    paragraphs = [d.replace("\n", " ") for d in docs]
    (tmp_path / "d.txt").write_text("\n\n".join(paragraphs) + "\n")
    assert torch.equal(one_pass(tok, tmp_path / "d.txt"), reference_windows(tok, paragraphs, 32))


def test_folder_is_read_recursively_in_sorted_order(tok: Tokenizer, tmp_path: Path) -> None:
    docs = make_docs(9)
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "part2.jsonl", docs[6:])
    write_jsonl(tmp_path / "a.jsonl", docs[:3])
    (tmp_path / "a").mkdir()
    write_jsonl(tmp_path / "a" / "part1.jsonl", docs[3:6])
    (tmp_path / ".hidden").mkdir()
    write_jsonl(tmp_path / ".hidden" / "x.jsonl", ["not a document"])
    (tmp_path / "README.md").write_text("ignored")
    _, files = local_files(str(tmp_path))
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "a/part1.jsonl",
        "a.jsonl",
        "b/part2.jsonl",
    ]
    spec = spec_for(tmp_path, validation_fraction=0.0)
    assert sorted(iter_texts(spec, "train")) == sorted(docs)


def test_file_names_with_glob_characters_are_read_as_themselves(tmp_path: Path) -> None:
    """datasets takes each data file as a glob pattern: unescaped, "a[1].txt" read "a1.txt"
    a second time in its place, and "b*.txt" every b...txt."""
    texts = {"a[1].txt": "alpha", "a1.txt": "beta", "b*.txt": "gamma", "bX.txt": "delta"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text + "\n")
    spec = spec_for(tmp_path, validation_fraction=0.0)
    assert sorted(iter_texts(spec, "train")) == sorted(t + "\n" for t in texts.values())


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: p / "missing.jsonl", "missing.jsonl' does not exist"),
        (lambda p: (p / "d.csv").write_text("a,b") and p / "d.csv", "unsupported file type '.csv'"),
        (lambda p: (p / "README.md").write_text("x") and p, "folder with no .txt"),
        (
            lambda p: write_jsonl(p / "a.jsonl", ["x"]) and (p / "b.txt").write_text("y") and p,
            "mixes file types",
        ),
        # `datasets` fails on an empty JSON-lines file with a bare StopIteration.
        (lambda p: (p / "e.jsonl").write_text("") or p / "e.jsonl", "no documents in .*e.jsonl"),
        (
            lambda p: [(p / "a.jsonl").write_text("\n\n"), (p / "b.jsonl").touch()] and p,
            "no documents in .*: every file in it is empty",
        ),
    ],
    ids=["missing", "extension", "empty-folder", "mixed", "empty-file", "blank-files"],
)
def test_bad_dataset_path_is_a_user_error(tok, tmp_path: Path, setup, message: str) -> None:
    path = setup(tmp_path)
    with pytest.raises(UserError, match=message) as info:
        build_dataloader(tok, spec_for(path), 0, 1, split="train")
    assert "\n" not in str(info.value)


def test_missing_text_field_is_a_user_error(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(3), field="content")
    with pytest.raises(UserError, match="no field 'text' \\(fields: content, id\\)"):
        next(iter(build_dataloader(tok, spec_for(path), 0, 1, split="train")))
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "d.parquet")
    with pytest.raises(UserError, match="no field 'text'"):
        build_dataloader(tok, spec_for(tmp_path / "d.parquet"), 0, 1, split="train")


@pytest.mark.parametrize(
    "name,content",
    [
        ("bad.txt", b"caf\xe9 in latin-1\n\nsecond paragraph\n"),
        ("bad.jsonl", b'{"text": "a"}\n{oops\n'),
    ],
)
def test_unreadable_file_is_a_user_error(tok: Tokenizer, tmp_path: Path, name, content) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=f"dataset_path=.*{name}: cannot read the data") as info:
        next(iter(build_dataloader(tok, spec_for(tmp_path / name), 0, 1, split="train")))
    assert "\n" not in str(info.value)


def test_empty_corpus_is_a_user_error(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["", "  \n", ""])
    for infinite in (True, False):
        with pytest.raises(UserError, match="train split has no text"):
            next(
                iter(build_dataloader(tok, spec_for(path, infinite=infinite), 0, 1, split="train"))
            )


def test_bad_spec_values_are_user_errors() -> None:
    with pytest.raises(UserError, match="seq_len"):
        DataSpec(seq_len=0)
    with pytest.raises(UserError, match="validation_fraction"):
        DataSpec(validation_fraction=1.0)


def test_hub_dataset_offline_fails_fast_in_one_line(tok: Tokenizer) -> None:
    started = time.perf_counter()
    with pytest.raises(UserError, match="Hugging Face dataset 'no-such-org/no-such-set'") as info:
        build_dataloader(tok, DataSpec(dataset="no-such-org/no-such-set"), 0, 1, split="train")
    assert time.perf_counter() - started < 15  # the Hub's retries alone take longer
    assert "\n" not in str(info.value)


def test_saved_state_does_not_grow_with_the_data_parallel_degree(tok: Tokenizer, corpus: Path):
    """Rank 0 of 64 (a global chunk of 128 windows) saves a position of constant size, which
    one process resumes exactly; a format-1 state (position after the rounds read, plus the
    unused tokens) still loads."""
    one = spec_for(corpus, seq_len=16, local_batch_size=128)
    reference = stacked(take(build_dataloader(tok, one, 0, 1, split="train"), 8))
    wide = build_dataloader(
        tok, spec_for(corpus, seq_len=16, local_batch_size=2), 0, 64, split="train"
    )
    take(wide, 3)
    state = wide.state_dict()
    assert state["format"] == 2 and "tokens" not in state and len(json.dumps(state)) < 1000
    assert torch.equal(stacked(continue_from(state, tok, one, 0, 1, 5)), reference[3 * 128 :])

    # What an older titanlite saved at the same point.
    older = build_dataloader(tok, one, 0, 1, split="train")
    take(older, 3)
    legacy = {**older.state_dict(), "format": 1, "tokens": older._tokens.tolist()}
    position = older._position
    legacy.update(
        epoch=position.epoch,
        epoch_documents=position.epoch_documents,
        exhausted=position.exhausted,
        dataset_state=json.dumps(position.dataset_state) if position.dataset_state else "",
    )
    del legacy["skip"]
    resumed = build_dataloader(tok, one, 0, 1, split="train")
    resumed.load_state_dict(legacy)
    assert resumed.state_dict()["format"] == 1  # its tokens cannot be read again: kept
    assert torch.equal(stacked(take(resumed, 1)), reference[3 * 128 : 4 * 128])
    again = resumed.state_dict()
    assert torch.equal(stacked(continue_from(again, tok, one, 0, 1, 4)), reference[4 * 128 :])


# -- split by rank ---------------------------------------------------------------------------


def test_split_by_rank_reads_only_the_ranks_own_files(tok: Tokenizer, corpus: Path) -> None:
    """With split_by_rank each of 4 ranks reads a disjoint quarter of the 40 files (documents
    are one file each) and tokenizes about a quarter of the stream; its position resumes
    exactly, also across an epoch; another degree or mode is a one-line error."""
    spec = spec_for(corpus, split_by_rank=True, local_batch_size=2)
    per_rank_docs, read = [], []
    for rank in range(4):
        loader = build_dataloader(tok, spec, rank, 4, split="train")
        batches = take(loader, 6)
        per_rank_docs.append(doc_ids(tok, stacked(batches)))
        read.append(loader._tokens_read)
    for a in range(4):
        assert per_rank_docs[a] and all(d % 4 == a for d in per_rank_docs[a]), per_rank_docs
    whole = build_dataloader(tok, spec_for(corpus, local_batch_size=8), 0, 4, split="train")
    take(whole, 6)
    assert max(read) < 0.5 * whole._tokens_read, (read, whole._tokens_read)

    # Exact resume of rank 2 of 4, through a checkpoint-like round trip and an epoch change.
    loader = build_dataloader(tok, spec, 2, 4, split="train")
    reference = take(loader, 40)
    assert loader._position.epoch >= 1  # 40 batches cross the rank's epoch (10 files)
    first = build_dataloader(tok, spec, 2, 4, split="train")
    take(first, 7)
    state = first.state_dict()
    assert state["split_by_rank"] == 4 and set(state["ranks"]) == {"dp2"}
    assert state["ranks"]["dp2"].dtype == torch.uint8 and state["ranks"]["dp2"].numel() < 4000
    resumed = build_dataloader(tok, spec, 2, 4, split="train")
    resumed.load_state_dict(state)
    assert torch.equal(stacked(take(resumed, 33)), stacked(reference[7:]))

    for other, message in (
        (build_dataloader(tok, spec, 1, 2, split="train"), "saved per rank by 4 .* this run has 2"),
        (build_dataloader(tok, spec_for(corpus), 0, 4, split="train"), "resume with split_by_rank"),
    ):
        with pytest.raises(UserError, match=message) as info:
            other.load_state_dict(state)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="global stream; training.split_by_rank cannot"):
        build_dataloader(tok, spec, 0, 4, split="train").load_state_dict(whole.state_dict())
    with pytest.raises(UserError, match="has 40 files, fewer than the 64 data-parallel ranks"):
        build_dataloader(tok, spec, 0, 64, split="train")
    # Validation stays one global pass over the held-out documents of every file.
    v_split = stacked(take(build_dataloader(tok, spec, 1, 4, split="validation"), 2))
    v_global = stacked(
        take(
            build_dataloader(tok, spec_for(corpus, local_batch_size=2), 1, 4, split="validation"), 2
        )
    )
    assert torch.equal(v_split, v_global)
