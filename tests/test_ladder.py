"""scripts/ladder.py: the law's fit recovers a known law, the plan and the resume of a ladder,
bad input (no runs to fit)."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import ladder  # noqa: E402

TRUE = ladder.Law(E=1.7, A=400.0, alpha=0.34, B=410.0, beta=0.28)
SIZES = (1e5, 3e5, 1e6, 3e6, 1e7)
TOKENS = (1e7, 3e7, 1e8)


def synthetic(noise: float, seed: int = 0) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    return [(n, d, TRUE.loss(n, d) * (1 + noise * rng.gauss(0, 1))) for n in SIZES for d in TOKENS]


def test_the_fit_recovers_a_known_law() -> None:
    law = ladder.fit(synthetic(0.0))
    assert law.alpha == pytest.approx(TRUE.alpha, abs=0.005)
    assert law.beta == pytest.approx(TRUE.beta, abs=0.005)
    assert law.E == pytest.approx(TRUE.E, rel=0.01)
    n_true, _ = TRUE.optimal(1e18)
    assert ladder.Law.optimal(law, 1e18)[0] == pytest.approx(n_true, rel=0.1)
    # With 0.2% noise on every loss the exponents stay within 0.02 and the law of N alone
    # (one token budget) finds its own exponent.
    noisy = ladder.fit(synthetic(0.002))
    assert abs(noisy.alpha - TRUE.alpha) < 0.02 and abs(noisy.beta - TRUE.beta) < 0.02
    at_one_budget = [(n, d, TRUE.loss(n, d)) for n, d, _ in synthetic(0.0) if d == TOKENS[-1]]
    simple = ladder.fit(at_one_budget, with_data=False)
    assert simple.alpha == pytest.approx(TRUE.alpha, abs=0.01)


def write_runs(folder: Path, points: list[tuple[float, float, float]]) -> None:
    for i, (n, d, loss) in enumerate(points):
        for lr, extra in ((1e-3, 0.0), (3e-3, 0.05)):  # the worse learning rate is ignored
            run = folder / ladder.run_name(f"{i}x1", d, lr)
            run.mkdir(parents=True)
            record = {"size": f"{i}x1", "tokens": d, "lr": lr, "params": n, "loss": loss + extra}
            (run / "ladder.json").write_text(json.dumps(record))


def test_fit_prints_the_law_the_optimum_and_plots(tmp_path, capsys) -> None:
    write_runs(tmp_path, synthetic(0.001))
    argv = ["fit", str(tmp_path), "--budget", "1e18", "--bootstrap", "8", "--at", "2e7", "3e8"]
    assert ladder.main(argv) == 0
    out = capsys.readouterr().out
    assert "compute-optimal at 1e+18 FLOPs" in out and "predicted loss" in out
    # A size and budget beyond the ladder's (2x its largest N, 3x its largest D).
    at = next(line for line in out.splitlines() if line.startswith("at N = 2e+07, D = 3e+08"))
    predicted = float(at.split("predicted loss ")[1].split()[0])
    assert predicted == pytest.approx(TRUE.loss(2e7, 3e8), rel=2e-3)
    assert (tmp_path / "fit.png").stat().st_size > 1000
    fitted = json.loads((tmp_path / "fit.json").read_text())["law"]
    assert abs(fitted["alpha"] - TRUE.alpha) < 0.03
    assert all(r["lr"] == 1e-3 for r in json.loads((tmp_path / "fit.json").read_text())["runs"])


def test_too_few_runs_to_fit_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    write_runs(tmp_path, synthetic(0.0)[:3])
    assert ladder.main(["fit", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ladder.py: 3 finished")


def test_a_finished_run_is_not_repeated_and_slurm_gets_an_array(tmp_path, capsys) -> None:
    out = tmp_path / "ladder"
    for size in ("64x2", "128x2"):
        run = out / ladder.run_name(size, 1e4, 1e-3)
        run.mkdir(parents=True)
        (run / "ladder.json").write_text("{}")
    config = str(REPO / "train_configs" / "debug_model.toml")
    argv = ["run", config, "--sizes", "64x2", "128x2", "--tokens", "1e4", "--out", str(out)]
    assert ladder.main(argv) == 0  # both done before: nothing trains
    assert capsys.readouterr().out.count("done before") == 2
    assert ladder.main([*argv, "--slurm"]) == 0
    script = (out / "ladder.slurm").read_text()
    assert "#SBATCH --array=0-1" in script
    runs = (out / "runs.txt").read_text().splitlines()
    assert len(runs) == 2 and "--model.dim 128" in runs[1] and "--training.steps 20" in runs[1]
    assert ladder.main(["run", config, "--sizes", "64by2", "--tokens", "1", "--out", str(out)]) == 2


def test_budgets_per_parameter_count_each_sizes_own_model(tmp_path, capsys) -> None:
    out = tmp_path / "ladder"
    config = str(REPO / "train_configs" / "debug_model.toml")
    argv = ["run", config, "--sizes", "64x2", "--tokens", "1x", "2x", "4096", "--out", str(out)]
    assert ladder.main([*argv, "--slurm"]) == 0
    runs = (out / "runs.txt").read_text().splitlines()
    # 631,104: the trainer's own count for this size (run.json of a 64x2 debug run); 512
    # tokens a step (batch 4 x 128).
    steps = [int(re.search(r"--training.steps (\d+)", run)[1]) for run in runs]
    assert steps == [round(631_104 / 512), round(2 * 631_104 / 512), 8]
    assert [run.split("--job.dump_folder ")[1].split()[0].rsplit("/", 1)[1] for run in runs] == [
        "64x2-1x-0.001",
        "64x2-2x-0.001",
        "64x2-4096-0.001",
    ]
    capsys.readouterr()
    assert ladder.main([*argv[:5], "1y", "--out", str(out)]) == 2
    assert ladder.main([*argv, "--set", "model.n_kv_heads", "3"]) == 2  # before any run
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ladder.py: token budget '1y'")
    assert err[1] == "ladder.py: size 64x2: model: n_heads 4 is not divisible by n_kv_heads 3"
    assert sorted(p.name for p in out.iterdir()) == ["ladder.slurm", "runs.txt"]


def test_the_law_of_n_alone_at_a_budget_per_parameter(tmp_path, capsys) -> None:
    for n in SIZES:
        for ratio in (5.0, 20.0):
            run = tmp_path / ladder.run_name(f"{n:g}x1", f"{ratio:g}x", 1e-3)
            run.mkdir()
            d = ratio * n * 1.001  # rounded to whole steps: the ratio is the budget's
            record = {"size": f"{n:g}x1", "tokens": d, "tokens_per_param": ratio, "lr": 1e-3}
            record |= {"params": n, "loss": TRUE.loss(n, d)}
            (run / "ladder.json").write_text(json.dumps(record))
    assert ladder.main(["fit", str(tmp_path), "--budget", "1e18", "--bootstrap", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("L(N) at"))
    assert line.startswith("L(N) at 20 tokens per parameter (5 runs)")  # the larger of equals
    assert (tmp_path / "fit.png").stat().st_size > 1000


def test_transfer_marks_the_best_learning_rate_of_each_width(tmp_path, capsys) -> None:
    for width, best in ((64, 1e-2), (128, 3e-3)):
        for lr in (3e-3, 1e-2):
            run = tmp_path / ladder.run_name(f"{width}x2", 1e4, lr)
            run.mkdir(parents=True)
            loss = 3.0 if lr == best else 3.5
            record = {"width": width, "depth": 2, "tokens": 1e4, "lr": lr, "loss": loss}
            (run / "ladder.json").write_text(json.dumps(record))
    assert ladder.main(["transfer", str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64x2")]
    assert rows == ["| 64x2 | 10000 | 3.5000 | **3.0000** | 0.01 |"]
    assert (tmp_path / "transfer.png").exists()
