"""scripts/goodput.py: the goodput model's closed forms, its Monte-Carlo, and the command line."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("goodput", REPO / "scripts" / "goodput.py")
assert _spec is not None and _spec.loader is not None
goodput = importlib.util.module_from_spec(_spec)
sys.modules["goodput"] = goodput  # dataclasses look their module up while building Inputs
_spec.loader.exec_module(goodput)

Inputs = goodput.Inputs
STRATEGIES = ("full_restart", "replica_groups")
# Seconds between failures on 2,048 GPUs, from the Llama 3 numbers (419 in 54 days on 16,384).
MTBF_S = 54 * 86_400 * 16_384 / (419 * 2048)
NO_COSTS = Inputs(detect_s=0, restart_overhead_s=0, startup_s=0, save_s=0, pause_s=0)
NO_COSTS = replace(NO_COSTS, replace_s=0, heal_s=0)


def both_methods(p: Inputs, strategy: str, trials: int = 200) -> tuple[dict, dict]:
    return goodput.analytic(p, strategy), goodput.monte_carlo(p, strategy, trials=trials, seed=0)


def test_the_failure_rate_is_llama3s_per_gpu_rate_at_2048_gpus():
    assert Inputs().failures_per_s == pytest.approx(1 / MTBF_S, rel=1e-12)
    assert MTBF_S / 3600 == pytest.approx(24.74, abs=0.01)
    assert Inputs(gpus=4096, failure_scale=2).failures_per_s == pytest.approx(4 / MTBF_S)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_failures_every_gpu_hour_trains(strategy):
    p = Inputs(failure_scale=0, save_s=0)
    for result in both_methods(p, strategy):
        assert result["goodput_pct"] == 100.0
        assert result["failures"] == 0
        assert sum(result["gpu_hours_lost"].values()) == 0


def test_full_restart_matches_the_renewal_closed_form():
    # Restart overhead only, checkpoints every 30 minutes: cycles of an Exp(MTBF) up time, then
    # R down; what trained in a cycle is the up time less its age since the last checkpoint
    # (mean MTBF - T / (exp(T / MTBF) - 1)), so goodput = T / (expm1(T / MTBF) (MTBF + R)).
    p = replace(NO_COSTS, restart_overhead_s=300.0)
    interval, restart = 1800.0, 300.0
    expected = interval / (math.expm1(interval / MTBF_S) * (MTBF_S + restart))
    result = goodput.analytic(p, "full_restart")
    assert result["goodput_pct"] == pytest.approx(100 * expected, rel=1e-12)
    failures = p.days * 86_400 / (MTBF_S + restart)
    assert result["failures"] == pytest.approx(failures, rel=1e-12)
    hours = result["gpu_hours_lost"]
    assert hours["restart_overhead"] == pytest.approx(failures * 300 * 2048 / 3600, rel=1e-12)
    # Rare failures within one interval: the lost steps are close to half an interval each.
    assert hours["lost_steps"] / (failures * 2048 / 3600) == pytest.approx(900, rel=0.02)


def test_replica_groups_match_their_closed_forms():
    # A group out d seconds at rate 1 / (G MTBF) trains 1 / (1 + d / (G MTBF)) of the time.
    outage = replace(NO_COSTS, replace_s=900.0, heal_s=30.0)
    groups = 2048 // 8
    expected = 1 / (1 + 930 / (groups * MTBF_S))
    assert goodput.analytic(outage, "replica_groups")["goodput_pct"] == pytest.approx(
        100 * expected, rel=1e-12
    )
    # Only the survivors' pause: every failure costs the other 2,040 GPUs 10 s.
    pause = replace(NO_COSTS, pause_s=10.0)
    expected = 1 - 10 / MTBF_S * 2040 / 2048
    assert goodput.analytic(pause, "replica_groups")["goodput_pct"] == pytest.approx(
        100 * expected, rel=1e-12
    )


@pytest.mark.parametrize(
    "p, strategy",
    [
        (Inputs(restart_overhead_s=10 * 3600), "full_restart"),
        (Inputs(group_gpus=1024, replace_s=86_400), "replica_groups"),
    ],
    ids=["10-hour-restarts", "1-day-outages"],
)
def test_hardware_that_is_down_cannot_fail(p, strategy):
    # Long outages leave a third of the run's failures no running hardware to strike.
    exact, mc = both_methods(p, strategy, trials=300)
    unthinned = p.failures_per_s * p.days * 86_400
    assert exact["failures"] < 0.75 * unthinned
    assert mc["failures"] == pytest.approx(exact["failures"], rel=0.03)


class ScriptedRng:
    """Stands in for numpy's Generator in one run: the failures' gaps, groups and kind draws."""

    def __init__(self, gaps: list[float], groups: list[int], draws: list[float]) -> None:
        self.gaps, self.groups, self.draws = iter(gaps), iter(groups), iter(draws)

    def exponential(self, scale: float) -> float:
        return next(self.gaps)

    def integers(self, high: int) -> int:
        return next(self.groups)

    def random(self) -> float:
        return next(self.draws)


SCRIPTED = {"startup_s": 60.0, "pause_s": 10.0, "heal_s": 30.0}  # the timeline's round numbers


def test_one_scripted_timeline_is_charged_exactly():
    # Two groups of 8, half the failures full. The run ends 0.5 s into its 47th save after the
    # restart. t=1000: group 0 fails (out 60+5000+60+30 s). t=2000: a full failure, 199 s after
    # the first checkpoint (1801 s); it brings group 0 back at 2000 and the job at 2420.
    # t=5000: group 0 fails again (it is up since the restart); t=6000: group 1 too, with no
    # survivor to pause; t=7000 lands on group 0, still out: no failure. 5 s before the end:
    # group 1 once more.
    days = (2420 + 46 * 1801 + 1800.5) / 86_400
    p = Inputs(gpus=16, group_gpus=8, days=days, replace_s=5000.0, full_fraction=0.5, **SCRIPTED)
    gaps = [1000.0, 1000.0, 3000.0, 1000.0, 1000.0, days * 86_400 - 5 - 7000, 1e12]
    rng = ScriptedRng(gaps, groups=[0, 1, 0, 1, 0, 1, 0], draws=[0.9, 0.1, 0.9, 0.9, 0.9])
    failures, gpu_s = goodput._one_run(p, goodput._shape(p, "replica_groups"), rng)
    assert failures == 5
    assert gpu_s == pytest.approx(
        {
            "detect": 16 * 60 + 8 * (60 + 60 + 60 + 5),  # the restart; four outages, one cut
            "restart_overhead": 16 * 300,
            "startup": 16 * 60 + 8 * (60 + 60),  # the first outage was cut before its start-up
            "lost_steps": 16 * 199,
            "saves": 16 * (1 + 46.5),
            "pause": 8 * (10 + 10 + 5),  # one survivor, then none, then one cut by the end
            "replace": 8 * (940 + 5000 + 5000),
            "heal": 8 * (30 + 30),
        },
        rel=1e-9,
    )


def test_full_job_failures_cost_replica_groups_a_full_restart():
    everything = goodput.analytic(Inputs(full_fraction=1.0), "replica_groups")
    assert everything == goodput.analytic(Inputs(), "full_restart")
    assert goodput.monte_carlo(Inputs(full_fraction=1.0), "replica_groups", trials=50, seed=3) == (
        goodput.monte_carlo(Inputs(), "full_restart", trials=50, seed=3)
    )
    some = goodput.analytic(Inputs(full_fraction=0.3), "replica_groups")
    none = goodput.analytic(Inputs(), "replica_groups")
    assert everything["goodput_pct"] < some["goodput_pct"] < none["goodput_pct"]
    assert some["gpu_hours_lost"]["lost_steps"] > 0 and some["gpu_hours_lost"]["replace"] > 0


@pytest.mark.parametrize(
    "p",
    [Inputs(), Inputs(failure_scale=4, full_fraction=0.3), Inputs(group_gpus=1024)],
    ids=["defaults", "x4-with-full-failures", "two-groups"],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_monte_carlo_agrees_with_the_analytic_expectation(p, strategy):
    exact, mc = both_methods(p, strategy, trials=300)
    # Fixed seed, so no flake; the bound is what a correct simulation meets (|z| <= 2.1 seen
    # over seeds 0-3) with room, and far below what a missing or doubled cause would show.
    assert abs(mc["goodput_pct"] - exact["goodput_pct"]) <= 4 * mc["goodput_se_pct"]
    assert 0 < mc["goodput_se_pct"] < 0.05
    assert mc["failures"] == pytest.approx(exact["failures"], rel=0.03)
    for cause, hours in exact["gpu_hours_lost"].items():
        assert mc["gpu_hours_lost"][cause] == pytest.approx(hours, rel=0.05, abs=1e-9), cause


def test_replica_groups_beat_full_restart_with_the_defaults():
    restart, replica = (both_methods(Inputs(), k) for k in STRATEGIES)
    for method in (0, 1):
        assert replica[method]["goodput_pct"] > restart[method]["goodput_pct"] + 1.0
    # Losing one node no longer costs the whole job: nothing is redone, no requeue.
    hours = replica[0]["gpu_hours_lost"]
    assert hours["lost_steps"] == hours["restart_overhead"] == 0
    # Larger groups lose more per failure; as many groups as GPUs would be the ideal.
    small, large = (goodput.analytic(Inputs(group_gpus=g), "replica_groups") for g in (8, 1024))
    assert small["goodput_pct"] > large["goodput_pct"] > restart[0]["goodput_pct"]


def test_the_command_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "goodput.json", tmp_path / "goodput.png"
    argv = ["--trials", "20", "--heal-s", "45", "--json", str(out_json), "--plot", str(out_png)]
    assert goodput.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "heal_s=45" in stdout and "from titanlite's measurements" in stdout
    assert "| full_restart | analytic |" in stdout and "| replica_groups | monte_carlo |" in stdout
    assert "| GPUs per replica group |" in stdout and "| failure rate" in stdout
    body = json.loads(out_json.read_text())
    assert body["inputs"]["heal_s"] == 45 and body["trials"] == 20
    restart = body["results"]["full_restart"]
    assert f"| {restart['analytic']['goodput_pct']:.3f} |" in stdout
    assert list(body["sweeps"]["group_gpus"]) == [
        "8",
        "16",
        "32",
        "64",
        "128",
        "256",
        "512",
        "1024",
    ]
    assert list(body["sweeps"]["failure_scale"]) == ["0.5", "1.0", "2.0", "4.0"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json", "goodput.png"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group-gpus", "7"], "--group-gpus 7 must divide --gpus 2048"),
        (["--startup-s", "-1"], "must be >= 0"),
        (["--full-fraction", "1.5"], "--full-fraction must be in [0, 1]"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert goodput.main([*argv, "--json", str(tmp_path / "x.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
