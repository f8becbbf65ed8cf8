"""scripts/eval_harness.py, the lm-evaluation-harness bridge: lm-eval's scores of an exported
checkpoint equal titanlite's own (the in-loop evaluator's record and a plain forward of the
model on each row), the temporary export is removed whatever happens, and bad input is one
line and exit status 2, with lm-eval installed or not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import train_scenarios
from conftest import REPO, subprocess_env
from pool import get_pool
from test_evaluation import QUESTIONS, SMALL, eval_record, write_task

from titanlite.downstream import harness
from titanlite.errors import EXIT_USER_ERROR

sys.path.insert(0, str(REPO / "scripts"))
import eval_harness  # noqa: E402


def task_yaml(folder: Path, rows: Path, name: str = "tiny_task") -> Path:
    """An lm-eval multiple-choice task over a titanlite task file (context, choices, label);
    the datasets library's cache of it stays in ``folder``, whatever HF_HOME says."""
    path = folder / f"{name}.yaml"
    path.write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files: {{test: {json.dumps(str(rows))}}}\n"
        f"  cache_dir: {json.dumps(str(folder / 'datasets-cache'))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: context\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        'target_delimiter: ""\n'  # the choices carry their own leading space
        "metric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
    )
    return path


def sidecar_only_checkpoint(folder: Path) -> Path:
    """A folder that passes the script's first, quick look at a checkpoint (the files a
    complete one has); nothing reads its tensors before the checks these tests make."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "titanlite.json").write_text(json.dumps({"format": 1, "step": 1}))
    return folder


def assert_one_line_error(status: int, out: str, err: str, message: str) -> None:
    assert status == EXIT_USER_ERROR, err
    assert err.startswith("eval_harness: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not re.search(r"\w+(Error|Exception)\b|Traceback", err), err
    assert out == ""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """Two training steps of the smallest model with the in-loop evaluator scoring the
    task at step 2, the checkpoint of that step, and each row's log-likelihood from a plain
    forward of the trained model (tests/train_scenarios.py)."""
    folder = tmp_path_factory.mktemp("harness")
    rows = write_task(folder, QUESTIONS)
    argv = [
        *SMALL,
        "--eval.tasks",
        str(rows),
        "--job.dump_folder",
        str(folder / "run"),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
    ]
    run = get_pool(1).run(train_scenarios.train_then_score, argv=argv)[0]
    return {**run, "rows": rows, "checkpoint": folder / "run" / "checkpoint" / "step-2"}


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the script's temporary export goes (to check that it is removed; libraries may
    put their own folders there too: torch's inductor cache, when they import it)."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.slow
def test_harness_scores_equal_titanlites(trained, tmp_path, scratch, capsys) -> None:
    """Each choice's log-likelihood under lm-eval's "hf" model on the exported checkpoint is
    the plain forward's within 1e-5; acc and acc_norm equal the in-loop evaluator's, and the
    right choices' mean log-likelihood its ``ll``."""
    pytest.importorskip("lm_eval")
    out = tmp_path / "results.json"
    argv = [
        str(trained["checkpoint"]),
        "--tasks",
        str(task_yaml(tmp_path, trained["rows"])),
        "--output",
        str(out),
        "--log-samples",
        "--batch-size",
        "4",
        "--device",
        "cpu",
    ]
    assert eval_harness.main(argv) == 0
    results = json.loads(out.read_text())
    samples = sorted(results["samples"]["tiny_task"], key=lambda s: s["doc_id"])
    harness_ll = [[float(resp[0][0]) for resp in s["resps"]] for s in samples]
    direct = [[ll for ll, _ in choices] for choices in trained["direct"]["tiny_task"]]
    assert [len(q) for q in harness_ll] == [len(q["choices"]) for q in QUESTIONS]
    difference = max(
        abs(h - d)
        for hs, ds in zip(harness_ll, direct, strict=True)
        for h, d in zip(hs, ds, strict=True)
    )
    with capsys.disabled():
        print(f"\nlargest log-likelihood difference: {difference:.2e}")
    assert difference < 1e-5

    record, scores = eval_record(trained), results["results"]["tiny_task"]
    assert scores["acc,none"] == record["eval_tiny_task_acc"]
    assert scores["acc_norm,none"] == record["eval_tiny_task_acc_norm"]
    right = [lls[q["label"]] for lls, q in zip(harness_ll, QUESTIONS, strict=True)]
    assert sum(right) / len(right) == pytest.approx(record["eval_tiny_task_ll"], rel=1e-5)

    assert results["titanlite"] == {
        "checkpoint": str(trained["checkpoint"].resolve()),
        "step": 2,
        "weights": "model",
        "dtype": "float32",
        "device": "cpu",
    }
    shown = capsys.readouterr().out
    assert re.search(r"\|tiny_task\s*\|.*\|acc\s*\|", shown), shown
    assert list(scratch.glob("titanlite-harness-*")) == []  # the export is gone


@pytest.mark.slow
def test_the_export_is_removed_on_error_and_kept_with_keep_hf(
    trained, tmp_path, scratch, monkeypatch
) -> None:
    pytest.importorskip("lm_eval")

    def fails(*args, **kwargs):
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(harness, "evaluate", fails)
    argv = [str(trained["checkpoint"]), "--tasks", str(task_yaml(tmp_path, trained["rows"]))]
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        eval_harness.main(argv)
    assert list(scratch.glob("titanlite-harness-*")) == []
    kept = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        eval_harness.main([*argv, "--keep-hf", str(kept)])
    assert (kept / "config.json").is_file() and (kept / "model.safetensors").is_file()


def bad_task_files(folder: Path) -> dict[str, Path]:
    folder.mkdir()
    (folder / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    (folder / "settings.yaml").write_text("output_type: multiple_choice\n")
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / "ok.yaml").write_text("task: ok\n")
    (tasks / "bad.yaml").write_text("task: bad\n  indented: wrongly\n")
    return {
        "broken": folder / "broken.yaml",
        "no_task": folder / "settings.yaml",
        "folder": tasks,
        "missing": folder / "missing.yaml",
    }


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_checkpoint", "checkpoint folder"),
        ("partial_checkpoint", "is not a complete titanlite checkpoint"),
        ("missing", "task file 'TASKS/missing.yaml' does not exist"),
        ("broken", "broken.yaml' is not valid YAML at line 3"),
        ("no_task", "settings.yaml' defines no task"),
        ("folder", "tasks/bad.yaml' is not valid YAML at line 2"),
        ("device", "--device 'gpu0' is not a torch device"),
        ("output", "--output 'TASKS/none/r.json' is in no existing folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message) -> None:
    """Checked before lm-eval is imported: these need no lm-eval installed."""
    files = bad_task_files(tmp_path / "tasks")
    checkpoint = sidecar_only_checkpoint(tmp_path / "step-1")
    argv = [str(checkpoint), "--tasks", str(files.get(case, files["no_task"]))]
    if case == "missing_checkpoint":
        argv[0] = str(tmp_path / "step-9")
        message = f"checkpoint folder {str(tmp_path / 'step-9')!r} does not exist"
    elif case == "partial_checkpoint":
        (checkpoint / "titanlite.json").unlink()
    elif case == "device":
        argv += ["--device", "gpu0"]
    elif case == "output":
        argv += ["--output", str(tmp_path / "tasks" / "none" / "r.json")]
    status = eval_harness.main(argv)
    captured = capsys.readouterr()
    expected = message.replace("TASKS", str(tmp_path / "tasks"))
    assert_one_line_error(status, captured.out, captured.err, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown", "--tasks: unknown task 'tiny_tsak'; did you mean 'tiny_task'?"),
        ("no_data", "Unable to find"),
    ],
)
def test_bad_tasks_lm_eval_finds_are_one_line_and_exit_2(tmp_path, capsys, case, message) -> None:
    """An unknown name (after indexing lm-eval's own tasks too) and a task whose data file
    is missing: refused before the export."""
    pytest.importorskip("lm_eval")
    checkpoint = sidecar_only_checkpoint(tmp_path / "step-1")
    yaml_path = task_yaml(tmp_path, tmp_path / "absent.jsonl")
    tasks = ["--tasks", str(yaml_path)]
    if case == "unknown":
        tasks = ["--include-path", str(tmp_path), "--tasks", "tiny_tsak"]
    status = eval_harness.main([str(checkpoint), *tasks])
    captured = capsys.readouterr()
    assert_one_line_error(status, captured.out, captured.err, message)


@pytest.mark.slow
def test_without_lm_eval_one_line_names_the_install_command(tmp_path) -> None:
    """A real process in which `import lm_eval` fails, as where it is not installed."""
    shim = tmp_path / "shim" / "lm_eval"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n"
    )
    checkpoint = sidecar_only_checkpoint(tmp_path / "step-1")
    task = task_yaml(tmp_path, write_task(tmp_path, QUESTIONS))
    # The shim first; then this checkout's titanlite, whatever an installed one says.
    env = subprocess_env(tmp_path, PYTHONPATH=f"{shim.parent}:{REPO}")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "eval_harness.py"),
            str(checkpoint),
            "--tasks",
            str(task),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert_one_line_error(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        "eval_harness: error: lm-eval is not installed: pip install 'lm-eval[hf]>=0.4.13'",
    )
