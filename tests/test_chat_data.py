"""Chat data (titanlite/data/chat.py, chat_loader.py, chat_sources.py): conversations rendered
with an HF tokenizer's chat template give the ids transformers' apply_chat_template gives, the
loss covers exactly the assistant turns, bad records are counted, packing keeps conversations
apart, the position resumes exactly, and a datasets dataset (save_to_disk, parquet through
load_dataset) reads as the same JSONL does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO

# A ChatML-like template written for this test, with a BOS first.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer with care."},
        {"role": "user", "content": "What about the weather?"},
        {"role": "assistant", "content": "The weather answers numbers."},
        {"role": "user", "content": "And the user?"},
        {"role": "assistant", "content": "The user asks."},
    ],
    [{"role": "user", "content": "ünïcödé 🙂 asks"}, {"role": "assistant", "content": "care"}],
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained here, with im_start/im_end and a chat template in its config."""
    sys.path.insert(0, str(REPO / "scripts"))
    import train_tokenizer

    root = tmp_path_factory.mktemp("chat_bpe")
    (root / "corpus").mkdir()
    words = "the user asks and the assistant answers with care about weather numbers".split()
    for i in range(20):
        text = " ".join(words[(i * j + k) % len(words)] for j in range(5) for k in range(9))
        (root / "corpus" / f"{i}.txt").write_text(text)
    argv = ["--kind", "hf-bpe", "--dataset-path", str(root / "corpus"), "--vocab-size", "300"]
    assert train_tokenizer.main([*argv, "--out", str(root / "tok")]) == 0
    config_path = root / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return root / "tok"


def _transformers_ids(folder: Path, messages: list) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_ids_equal_transformers_and_the_loss_covers_the_assistant_turns(chat_tokenizer) -> None:
    pytest.importorskip("transformers")
    from titanlite.data.chat import TemplateRenderer, renderer
    from titanlite.data.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_tokenizer)
    render = renderer(tok)
    assert isinstance(render, TemplateRenderer)
    for messages in CONVERSATIONS:
        example = render.render(messages)
        assert example.ids == _transformers_ids(chat_tokenizer, messages)
        # The trained tokens, run by run, decode to exactly each assistant turn and its end.
        runs, current = [], []
        for token, trained in zip(example.ids, example.trained, strict=True):
            if trained:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        texts = [tok._tok.decode(run, skip_special_tokens=False) for run in runs]
        expected = [f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert texts == expected


def test_bad_records_are_refused_with_their_reason() -> None:
    from titanlite.data.chat import BadRecord, messages_of

    cases = {
        "not_a_conversation": [{"text": "x"}, {"messages": []}, {"messages": [{"role": "user"}]}],
        "unknown_role": [{"messages": [{"role": "wizard", "content": "x"}]}],
        "no_assistant_turn": [{"messages": [{"role": "user", "content": "x"}]}],
    }
    for reason, records in cases.items():
        for record in records:
            with pytest.raises(BadRecord) as e:
                messages_of(record)
            assert e.value.reason == reason
    pair = messages_of({"prompt": "hi", "completion": "hello"})
    assert pair == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _records(good: int = 24) -> list[dict]:
    """Conversations, then one record of each kind that is left out or truncated ({}: a line
    that is not JSON in a file)."""
    records = []
    for i in range(good):
        turns = [{"role": "user", "content": f"question {i} about the weather"}]
        turns.append({"role": "assistant", "content": "the answer is " + "care " * (i % 5)})
        records.append({"messages": turns})
    records.append({"prompt": "asks", "completion": "answers"})
    records.append({"messages": [{"role": "user", "content": "no reply"}]})
    records.append({"messages": [{"role": "robot", "content": "x"}]})
    records.append({})
    records.append({"messages": [{"role": "assistant", "content": "x " * 400}]})
    records.append({"messages": [{"role": "user", "content": "y " * 400}, CONVERSATIONS[1][1]]})
    return records


def _write_chat(path: Path, good: int = 24) -> Path:
    lines = [json.dumps(r) if r else "not json" for r in _records(good)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _loader(chat_tokenizer: Path, data: Path, **changes):
    from titanlite.data.chat_loader import ChatLoader
    from titanlite.data.spec import DataSpec
    from titanlite.data.tokenizer import load_tokenizer

    fields = dict(
        dataset_path=str(data),
        seq_len=127,
        local_batch_size=2,
        chat=True,
        document_mask=True,
        validation_fraction=0.0,
    )
    dp, split = changes.pop("dp", (0, 1)), changes.pop("split", "train")
    spec = DataSpec(**{**fields, **changes})
    return ChatLoader(load_tokenizer(chat_tokenizer), spec, *dp, split=split)


def test_packing_labels_bad_records_and_exact_resume(chat_tokenizer, tmp_path, caplog) -> None:
    import torch

    from titanlite.data.batches import IGNORE_INDEX
    from titanlite.data.documents import document_ids
    from titanlite.data.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_tokenizer)
    data = _write_chat(tmp_path / "chat.jsonl")
    with caplog.at_level("WARNING"):
        loader = _loader(chat_tokenizer, data)
    # The over-long assistant turn keeps its first tokens (truncated); the over-long user
    # turn leaves no assistant token in the window (too_long).
    report = loader.report
    assert "26 conversations, 4 left out" in report, report
    assert "not_a_conversation 1, unknown_role 1, no_assistant_turn 1, too_long 1" in report
    assert "1 truncated" in report and report in caplog.text
    inputs, labels = next(loader)
    assert inputs.shape == labels.shape == (2, 127)
    for row_inputs, row_labels in zip(inputs, labels, strict=True):
        docs = document_ids(row_inputs[None], tok.bos_id, tok.eos_id)[0]
        assert int(docs.max()) >= 2  # several conversations packed, each found by its BOS
        # Every target is an assistant's token, its end marker or newline: never a BOS, a
        # user's words or padding.
        targets = row_labels[row_labels != IGNORE_INDEX].tolist()
        text = tok._tok.decode(targets, skip_special_tokens=False)
        assert "question" not in text and "<|im_start|>" not in text and targets
    # Exact resume: a loader given the state after 3 batches gives the 4th and 5th batches.
    for _ in range(2):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(6)]  # crosses into the next epoch
    again = _loader(chat_tokenizer, data)
    again.load_state_dict(state)
    for a, b in zip(expected, [next(again) for _ in range(6)], strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Two data-parallel ranks take the rows of one process's global batch.
    whole = _loader(chat_tokenizer, data, local_batch_size=4)
    halves = [_loader(chat_tokenizer, data, dp=(r, 2)) for r in range(2)]
    first = next(whole)[0]
    assert torch.equal(first, torch.cat([next(h)[0] for h in halves]))


def test_the_shipped_sft_config_reads_conversations_with_the_builtin_template() -> None:
    from titanlite.config import load_config
    from titanlite.data.batches import IGNORE_INDEX
    from titanlite.data.build import build_training_data
    from titanlite.data.chat import BuiltinRenderer, renderer
    from titanlite.data.chat_loader import ChatLoader
    from titanlite.data.tokenizer import load_tokenizer

    cfg = load_config(["--job.config_file", str(REPO / "train_configs" / "debug_sft.toml")])
    tok = load_tokenizer(REPO / cfg.model.tokenizer_path)
    assert isinstance(renderer(tok), BuiltinRenderer)  # sentencepiece: no template of its own
    data = build_training_data(tok, cfg.training, cfg.validation, dp_rank=0, dp_world_size=1)
    assert isinstance(data.loader, ChatLoader)
    assert "360 conversations, 0 left out" in data.loader.describe()
    inputs, labels = next(data.loader)
    assert inputs.shape == (cfg.training.local_batch_size, cfg.training.seq_len)
    targets = labels[0][labels[0] != IGNORE_INDEX].tolist()
    text = tok.decode(targets)
    assert " is " in text and "What is" not in text  # answers trained, questions not


def test_unusable_chat_sources_and_positions_are_one_line_errors(chat_tokenizer, tmp_path) -> None:
    from titanlite.errors import UserError

    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(UserError, match="a .jsonl file or a folder of them"):
        _loader(chat_tokenizer, text)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(UserError, match="no conversation left to train on"):
        _loader(chat_tokenizer, empty)
    data = _write_chat(tmp_path / "chat.jsonl")
    state = _loader(chat_tokenizer, data).state_dict()
    with pytest.raises(UserError, match="belongs to other data.*seed"):
        _loader(chat_tokenizer, data, seed=1).load_state_dict(state)


def _save_dataset(records: list[dict], folder: Path, columns=("messages", "prompt", "completion")):
    """``records`` as a datasets Dataset (a column per key, None where a record has none),
    written by save_to_disk to ``folder``; returns the dataset."""
    from datasets import Dataset

    dataset = Dataset.from_dict({c: [r.get(c) for r in records] for c in columns})
    dataset.save_to_disk(str(folder))
    return dataset


def _same_batches(a, b, n: int) -> None:
    import torch

    for x, y in zip([next(a) for _ in range(n)], [next(b) for _ in range(n)], strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_a_datasets_source_reads_as_the_same_jsonl_does(chat_tokenizer, tmp_path) -> None:
    """save_to_disk folders and parquet read by load_dataset (as dataset_path, or as the
    dataset) give the JSONL file's counts and batches; their position resumes exactly; the
    held-out rows are never trained on."""
    pytest.importorskip("datasets")
    records = _records()
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = _save_dataset(records, tmp_path / "saved")
    (tmp_path / "parquet").mkdir()
    dataset.to_parquet(str(tmp_path / "parquet" / "part-0.parquet"))
    jsonl = _loader(chat_tokenizer, tmp_path / "chat.jsonl")
    sources = {
        "saved": _loader(chat_tokenizer, tmp_path / "saved"),
        "parquet": _loader(chat_tokenizer, tmp_path / "parquet"),
        "dataset": _loader(chat_tokenizer, "", dataset=str(tmp_path / "parquet")),
    }
    counts = jsonl.report.split(" (train): ")[1]
    assert counts.startswith("26 conversations, 4 left out (not_a_conversation 1, "), counts
    for name, loader in sources.items():
        assert loader.report.split(" (train): ")[1] == counts, name
        # The same examples in the same order: the same windows, masks and epochs.
        _same_batches(jsonl, loader, 8)
        jsonl = _loader(chat_tokenizer, tmp_path / "chat.jsonl")
    # Exact resume: a loader given the position after 3 batches goes on as the first did.
    first = sources["saved"]
    state = first.state_dict()
    again = _loader(chat_tokenizer, tmp_path / "saved")
    again.load_state_dict(state)
    assert again.describe() == first.describe()
    _same_batches(first, again, 6)
    assert first.epoch > state["epoch"]  # over the end of an epoch
    # Held out by a stable hash of each row: the two splits share no conversation.
    split = {
        s: _loader(chat_tokenizer, tmp_path / "saved", validation_fraction=0.3, split=s)
        for s in ("train", "validation")
    }
    kept = {s: {tuple(e.ids) for e in loader.examples} for s, loader in split.items()}
    assert kept["train"] and kept["validation"] and not kept["train"] & kept["validation"]
    assert len(kept["train"]) + len(kept["validation"]) == 26
    assert next(iter(split["validation"]))[0].shape == (2, 127)


def test_unusable_datasets_sources_are_one_line_errors(chat_tokenizer, tmp_path) -> None:
    pytest.importorskip("datasets")
    from datasets import Dataset, DatasetDict

    from titanlite.errors import UserError

    with pytest.raises(UserError, match=r"training.dataset_path '.*nowhere' does not exist"):
        _loader(chat_tokenizer, tmp_path / "nowhere")
    _save_dataset([{"text": "a document"}], tmp_path / "text", columns=("text",))
    with pytest.raises(UserError, match=r"rows need a messages column.*\(columns: text\)"):
        _loader(chat_tokenizer, tmp_path / "text")
    with pytest.raises(UserError, match=r"rows need a messages column.*\(columns: text\)"):
        _loader(chat_tokenizer, "", dataset=str(tmp_path / "text"))
    rows = Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    DatasetDict({"test": rows}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match=r"no train split \(splits: test\)"):
        _loader(chat_tokenizer, tmp_path / "dict")
    with pytest.raises(UserError, match="not from the sotu speeches"):
        _loader(chat_tokenizer, "", dataset="sotu")


@pytest.mark.slow
def test_a_run_on_an_unusable_datasets_source_stops_with_one_line(tmp_path) -> None:
    pytest.importorskip("datasets")
    import train_scenarios
    from pool import get_pool

    _save_dataset([{"text": "a document"}], tmp_path / "text", columns=("text",))
    config = str(REPO / "train_configs" / "debug_sft.toml")
    pool = get_pool(1)
    for path, words in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "text", "columns")):
        argv = ["--job.config_file", config, "--training.dataset_path", str(path)]
        (status,) = pool.run(train_scenarios.main, argv=[*argv, "--job.dump_folder", str(tmp_path)])
        output = pool.last_output[0]
        errors = [line for line in output.splitlines() if line.startswith("titanlite: error:")]
        assert status == 2, output[-3000:]
        assert len(errors) == 1 and words in errors[0], output[-3000:]
        assert "Traceback" not in output and "Error:" not in errors[0].split(":", 2)[2]
