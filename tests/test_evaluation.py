"""Downstream evaluation in the loop ([eval]): task files, the built-in task, the scores
against a direct computation, and the same scores under every layout."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import train_scenarios
from conftest import REPO
from pool import get_pool

from titanlite.downstream import builtin
from titanlite.downstream.evaluator import accuracies
from titanlite.downstream.tasks import Question, Task, encode_pair, read_task
from titanlite.errors import UserError

sys.path.insert(0, str(REPO / "scripts"))
import make_eval_task  # noqa: E402

QUESTIONS = [
    {
        "context": "The United States of America",
        "choices": [" is a nation.", " blue fish"],
        "label": 0,
    },
    {
        "context": "We must work together",
        "choices": [" for peace", " of", " cat cat cat"],
        "label": 0,
    },
    {"context": "Congress", "choices": [" shall", " banana"], "label": 1},
    {"context": "In this year", "choices": [" the economy grew", " grew economy the"], "label": 0},
    {"context": "My fellow", "choices": [" citizens", " apples", " the"], "label": 0},
]


COMPLETIONS = [
    {"context": "The United States", "target": " of America"},
    {"context": "My fellow", "target": " citizens"},
    {"context": "the the the the the the", "target": " the the"},
    {"context": "Congress shall", "target": " make no law"},
]


def write_task(folder: Path, rows: list[dict], name: str = "tiny_task") -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "tiny_task.jsonl:2: not a JSON object"),
        ('{"context": "a", "choices": [" b", " c"]}', "tiny_task.jsonl:2: missing label"),
        ('{"context": "a", "choices": [" b"], "label": 0}', "two or more non-empty strings"),
        ('{"context": "a", "choices": [" b", " c"], "label": 2}', "label 2 is not an index"),
        ('{"context": 3, "choices": [" b", " c"], "label": 0}', "context must be a string"),
    ],
)
def test_a_bad_task_line_is_one_error_naming_file_and_line(tmp_path, line, expected) -> None:
    path = tmp_path / "tiny_task.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + line + "\n")
    with pytest.raises(UserError, match=expected):
        read_task(path)


def test_a_task_file_that_is_not_text_is_one_error(tmp_path) -> None:
    path = tmp_path / "binary.jsonl"
    path.write_bytes(json.dumps(QUESTIONS[0]).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(UserError, match="binary.jsonl is not UTF-8 text"):  # was a traceback
        read_task(path)


def test_bad_eval_settings_are_refused_before_the_run_writes_anything(tmp_path, capsys) -> None:
    """A bad task file and each bad number, a line each, from the checks every launch runs
    first; an earlier run's files in the folder are left as they were (they were rewritten
    before the trainer read the tasks)."""
    from titanlite import preflight

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.toml").write_text("the earlier run's\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [" b", " c"], "label": 5}\n')
    rc = preflight.main(
        [
            "--eval.enable",
            "true",
            "--eval.tasks",
            f"sotu_word_order,{bad}",
            "--eval.limit",
            "-1",
            "--eval.freq",
            "0",
            "--job.dump_folder",
            str(folder),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "titanlite: error: eval.freq: must be at least 1, got 0",
        "titanlite: error: eval.limit: must be at least 0, got -1",
        f"titanlite: error: {bad}:1: label 5 is not an index of the 2 choices",
    ], err
    assert sorted(p.name for p in folder.iterdir()) == ["config.toml"]
    assert (folder / "config.toml").read_text() == "the earlier run's\n"


def test_a_completion_line_and_a_mixed_file(tmp_path) -> None:
    task = read_task(write_task(tmp_path, COMPLETIONS, "c"))
    assert task.completion and task.questions[0] == Question(
        "The United States", (" of America",), 0, True
    )
    with pytest.raises(UserError, match="mixes multiple-choice and completion lines"):
        read_task(write_task(tmp_path, [QUESTIONS[0], COMPLETIONS[0]], "mixed"))
    with pytest.raises(UserError, match="target must be a non-empty string"):
        read_task(write_task(tmp_path, [{"context": "a", "target": ""}], "empty"))


def test_task_files_read_and_accuracies() -> None:
    task = Task("t", (Question("c", (" a", " bb"), 1), Question("c", (" a", " bb", " c"), 0)))
    # log-likelihoods: q1 prefers " a" in sum but " bb" per character; q2 prefers " a"
    acc, acc_norm = accuracies(task, [-3.0, -4.0, -1.0, -9.0, -9.0])
    assert (acc, acc_norm) == (0.5, 1.0)


@pytest.mark.parametrize("name", builtin.NAMES)
def test_the_builtin_tasks_are_fixed_and_drawn_from_held_out_speeches(name) -> None:
    first, again = builtin.build(name, 0.05, 50), builtin.build(name, 0.05, 50)
    assert first == again and len(first.questions) == 50
    assert all(len(q.choices) == 4 and 0 <= q.label < 4 for q in first.questions)
    labels = {q.label for q in first.questions}
    assert len(labels) > 1  # the right answer is not always in one place
    for q in first.questions:
        right = q.choices[q.label]
        wrong = [c for i, c in enumerate(q.choices) if i != q.label]
        assert right not in wrong
        if name == "sotu_word_order":  # the same words in other orders
            assert all(sorted(c.split()) == sorted(right.split()) for c in wrong)
    with pytest.raises(UserError, match="needs held-out speeches"):
        builtin.build(name, 0.0, 10)


SMALL = (
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--model.multiple_of",
    "32",
    "--training.seq_len",
    "64",
    "--training.steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--training.local_batch_size",
    "8",
    "--eval.enable",
    "true",
    "--eval.freq",
    "2",
    "--eval.batch_size",
    "3",
)


def eval_record(run: dict) -> dict:
    (record,) = [r for r in run["records"] if r.get("kind") == "eval"]
    return record


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict, str]:
    """One process, 2 steps, its eval at step 2 and a checkpoint of that step."""
    folder = tmp_path_factory.mktemp("eval")
    tasks = f"{write_task(folder, QUESTIONS)},{write_task(folder, COMPLETIONS, 'tiny_completion')}"
    argv = [
        *SMALL,
        "--eval.tasks",
        tasks,
        "--job.dump_folder",
        str(folder / "run"),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
    ]
    run = get_pool(1).run(train_scenarios.train_then_score, argv=argv)[0]
    return {**run, "checkpoint": folder / "run" / "checkpoint" / "step-2"}, tasks


@pytest.mark.slow
def test_scores_equal_a_direct_computation(one_process) -> None:
    """The evaluator's log-likelihoods are those of a plain forward of the trained model on
    each (context, choice) row: log_softmax, summed over the choice's tokens."""
    run, _ = one_process
    record = eval_record(run)
    direct = run["direct"]["tiny_task"]  # per question: each choice's (log-likelihood, greedy)
    right = [choices[q["label"]][0] for choices, q in zip(direct, QUESTIONS, strict=True)]
    assert record["eval_tiny_task_ll"] == pytest.approx(sum(right) / len(right), rel=1e-6)
    task = Task(
        "t", tuple(Question(q["context"], tuple(q["choices"]), q["label"]) for q in QUESTIONS)
    )
    acc, acc_norm = accuracies(task, [ll for choices in direct for ll, _ in choices])
    assert (record["eval_tiny_task_acc"], record["eval_tiny_task_acc_norm"]) == (acc, acc_norm)
    completions = [c for (c,) in run["direct"]["tiny_completion"]]
    mean_ll = sum(ll for ll, _ in completions) / len(completions)
    assert record["eval_tiny_completion_ll"] == pytest.approx(mean_ll, rel=1e-6)
    exact = sum(greedy for _, greedy in completions) / len(completions)
    assert record["eval_tiny_completion_exact_match"] == exact
    assert math.isfinite(record["eval_seconds"])


LAYOUTS = {
    # Tensor parallelism is the pipeline layout's; here the scoring batch split over dp ranks.
    "dp_shard=2": (
        2,
        ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
    ),
    "cp=2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "pp=2 x tp=2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
        ],
    ),
}


@pytest.mark.slow
def test_scores_equal_transformers_on_the_exported_model(one_process, tmp_path) -> None:
    """The checkpoint of the scored step, exported to Hugging Face and loaded by transformers'
    LlamaForCausalLM: its log-likelihoods of the same rows are the evaluator's within 1e-5."""
    transformers = pytest.importorskip("transformers")
    import convert_to_hf

    from titanlite.data import DEFAULT_TOKENIZER_PATH, load_tokenizer

    run, _ = one_process
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(run["checkpoint"]), str(out)]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = load_tokenizer(DEFAULT_TOKENIZER_PATH)

    def log_likelihood(context: str, continuation: str) -> float:
        ctx, ids = encode_pair(tok, context, continuation)
        with torch.no_grad():
            logits = hf(torch.tensor([ctx + ids])[:, :-1]).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(ids))

    right = [log_likelihood(q["context"], q["choices"][q["label"]]) for q in QUESTIONS]
    targets = [log_likelihood(c["context"], c["target"]) for c in COMPLETIONS]
    record = eval_record(run)
    print(
        "relative differences:",
        abs(record["eval_tiny_task_ll"] / (sum(right) / len(right)) - 1),
        abs(record["eval_tiny_completion_ll"] / (sum(targets) / len(targets)) - 1),
    )
    assert record["eval_tiny_task_ll"] == pytest.approx(sum(right) / len(right), rel=1e-5)
    assert record["eval_tiny_completion_ll"] == pytest.approx(sum(targets) / len(targets), rel=1e-5)


MEASURED: dict[str, float] = {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_scores_under_every_layout(layout, one_process, tmp_path) -> None:
    base, tasks = one_process
    ngpu, args = LAYOUTS[layout]
    argv = [*SMALL, "--eval.tasks", tasks, "--job.dump_folder", str(tmp_path / "run"), *args]
    run = get_pool(ngpu).run(train_scenarios.train, argv=argv)[0]
    got, expected = eval_record(run), eval_record(base)
    difference = abs(got["eval_tiny_task_ll"] - expected["eval_tiny_task_ll"])
    MEASURED[layout] = difference / abs(expected["eval_tiny_task_ll"])
    (tmp_path.parent / "eval_parity.json").write_text(json.dumps(MEASURED))
    assert got["eval_tiny_task_ll"] == pytest.approx(expected["eval_tiny_task_ll"], rel=1e-5)
    assert got["eval_tiny_completion_ll"] == pytest.approx(
        expected["eval_tiny_completion_ll"], rel=1e-5
    )
    for key in (
        "eval_tiny_task_acc",
        "eval_tiny_task_acc_norm",
        "eval_tiny_completion_exact_match",
    ):
        assert got[key] == expected[key], key
    assert torch.isfinite(torch.tensor(got["eval_tiny_task_ll"]))


# --- scripts/make_eval_task.py ------------------------------------------------------------------

RAW = {
    "hellaswag": {
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "ctx": "",
        "endings": [
            "starts pulling up roofing.",
            "is holding a rubik's cube.",
            "is using wrap.",
            "is ripping level tiles off.",
        ],
        "label": "3",
    },
    "arc": {
        "question": "Which gas do plants take in?",
        "choices": {"text": ["oxygen", "carbon dioxide"], "label": ["A", "B"]},
        "answerKey": "B",
    },
    "piqa": {
        "goal": "Dry wet shoes",
        "sol1": "Fill them with newspaper.",
        "sol2": "Fill them with water.",
        "label": 0,
    },
    "mmlu": {
        "question": "2 + 2 = ?",
        "choices": ["3", "4", "5", "6"],
        "answer": 1,
        "subject": "math",
    },
}
EXPECTED = {
    "hellaswag": {
        "context": "A man is sitting on a roof. He",
        "choices": [
            " starts pulling up roofing.",
            " is holding a rubik's cube.",
            " is using wrap.",
            " is ripping level tiles off.",
        ],
        "label": 3,
    },
    "arc": {
        "context": "Question: Which gas do plants take in?\nAnswer:",
        "choices": [" oxygen", " carbon dioxide"],
        "label": 1,
    },
    "piqa": {
        "context": "Question: Dry wet shoes\nAnswer:",
        "choices": [" Fill them with newspaper.", " Fill them with water."],
        "label": 0,
    },
    "mmlu": {
        "context": "2 + 2 = ?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:",
        "choices": [" A", " B", " C", " D"],
        "label": 1,
    },
}


@pytest.mark.parametrize("fmt", list(RAW))
def test_make_eval_task_converts_a_local_copy(fmt, tmp_path) -> None:
    source = tmp_path / f"{fmt}.jsonl"
    source.write_text(json.dumps(RAW[fmt]) + "\n" + json.dumps(RAW[fmt]) + "\n")
    out = tmp_path / "task.jsonl"
    assert make_eval_task.main([fmt, str(source), str(out), "--limit", "1"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [EXPECTED[fmt]]
    task = read_task(out)  # and titanlite reads what it wrote
    assert task.questions[0].label == EXPECTED[fmt]["label"]


def test_make_eval_task_refuses_a_row_missing_a_field(tmp_path, capsys) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"goal": "x", "sol1": "a", "label": 0}) + "\n")
    out = tmp_path / "task.jsonl"
    out.write_text("kept\n")
    assert make_eval_task.main(["piqa", str(source), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["make_eval_task: error: row 1: no field 'sol2', which the piqa format needs"]
    assert out.read_text() == "kept\n"  # nothing overwritten
