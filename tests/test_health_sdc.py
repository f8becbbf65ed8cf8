"""Silent data corruption (titanlite/health/fingerprints.py): replicas that must hold identical
bytes compare fingerprints, and one flipped bit is found naming the rank and the tensor.

The fingerprint and the error line are checked in this process. The slow tests train a tiny
Llama a few real steps with titanlite's Trainer on a worker pool (tests/sdc_scenarios.py)
under DDP, HSDP and TP, then flip one bit of one rank's parameter or optimizer state; the
end-to-end test flips it inside a real run (a sitecustomize hook) and reads the exit status,
the error line and the checkpoint folders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_train
from pool import get_pool

from titanlite import errors
from titanlite.errors import EXIT_COMM_FAILURE
from titanlite.health.fingerprints import Finding, corruption_error, fingerprint

# ----- the fingerprint and the line (one process) ------------------------------------------


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, 32), (torch.bfloat16, 16)])
def test_every_single_flipped_bit_changes_the_fingerprint(dtype: torch.dtype, bits: int) -> None:
    torch.manual_seed(0)
    tensor = torch.randn(6, 5).to(dtype)
    clean = fingerprint(tensor)
    assert torch.equal(fingerprint(tensor.clone()), clean)  # the same bytes, the same numbers
    as_int = {32: torch.int32, 16: torch.int16}[bits]
    for element in (0, 17, 29):
        for bit in range(bits):
            bad = tensor.clone()
            flat = bad.view(as_int).view(-1)
            flat[element] ^= torch.tensor(1 << bit).to(as_int)
            assert not torch.equal(fingerprint(bad), clean), (element, bit)


def test_rows_swapped_change_the_fingerprint_and_zero_elements_have_one() -> None:
    tensor = torch.arange(12.0).view(3, 4)
    swapped = tensor[[1, 0, 2]]
    first, second = fingerprint(tensor), fingerprint(swapped)
    assert first[0] == second[0] and first[1] != second[1]  # the bit sums alone cannot see it
    assert fingerprint(torch.zeros(0, 3)).tolist() == [0, 0]
    assert fingerprint(torch.tensor(2.0)).shape == (2,)  # a scalar: one row


def test_the_line_names_the_odd_rank_its_host_and_the_tensor() -> None:
    hosts = {0: "a", 1: "b", 2: "a"}
    odd = Finding("layers.0.attention.wq.weight", (0, 1, 2), (1,), majority=True)
    more = Finding("optimizer state exp_avg of norm.weight", (0, 1, 2), (1,), majority=True)
    error = corruption_error(7, [odd, more], hosts)
    assert str(error) == (
        "silent data corruption at step 7: rank 1 (host b) differs from its replicas "
        "(ranks 0, 2) on layers.0.attention.wq.weight; 1 more tensor differ"
    )
    assert (error.step, error.ranks) == (7, (1,))
    assert error.tensors == ("layers.0.attention.wq.weight", more.tensor)
    assert isinstance(error, errors.SilentCorruption)  # what the entry point maps to exit 4
    two = Finding("norm.weight", (0, 1), (0, 1), majority=False)
    assert str(corruption_error(3, [two], {0: "a", 1: "a"})) == (
        "silent data corruption at step 3: ranks 0 and 1 (host a) disagree on norm.weight "
        "(no majority tells which is wrong)"
    )
    assert "ranks 0 (host a) and 1 (host b) disagree" in str(corruption_error(3, [two], hosts))


# ----- replicas after real steps (worker pool) ---------------------------------------------

WQ = "layers.0.attention.wq.weight"
W2 = "layers.1.feed_forward.w2.weight"


def run_scenario(world: int, tmp_path: Path, layout: list[str], flips: list[dict]) -> list[dict]:
    """Every rank's result of sdc_scenarios.replicas_after_training."""
    argv = [*layout, "--job.dump_folder", str(tmp_path / "run")]
    return get_pool(world).run("sdc_scenarios:replicas_after_training", argv=argv, flips=flips)


def same_on_every_rank(results: list[dict], flip: int) -> dict:
    """The error of flip number ``flip``: raised, and the same line, on every rank."""
    errors = [r["flips"][flip] for r in results]
    assert errors[0] is not None, "no SilentCorruption raised"
    assert all(e == errors[0] for e in errors), errors
    return errors[0]


@pytest.mark.slow
def test_three_replicas_name_exactly_the_rank_with_a_flipped_bit(tmp_path: Path) -> None:
    layout = ["--parallelism.data_parallel_replicate_degree", "3"]
    layout += ["--parallelism.data_parallel_shard_degree", "1"]
    flips = [
        {"rank": 1, "tensor": WQ},
        {"rank": 2, "tensor": W2, "state": "exp_avg"},
        {"rank": 0, "tensor": "norm.weight", "state": "exp_avg_sq", "bit": 30},
    ]
    results = run_scenario(3, tmp_path, layout, flips)
    # Clean: every parameter and both of its AdamW moments, over the three replicas.
    names = results[0]["plan"][(0, 1, 2)]
    assert len(names) == 3 * 21 and f"optimizer state exp_avg_sq of {W2}" in names
    assert [r["compared"] for r in results] == [63] * 3
    param = same_on_every_rank(results, 0)
    assert param["ranks"] == (1,) and param["tensors"] == (WQ,)
    assert "rank 1 (host " in param["line"] and f"(ranks 0, 2) on {WQ}" in param["line"]
    state = same_on_every_rank(results, 1)
    assert state["ranks"] == (2,) and state["tensors"] == (f"optimizer state exp_avg of {W2}",)
    assert same_on_every_rank(results, 2)["ranks"] == (0,)
    assert all(r["clean_again"] for r in results)


@pytest.mark.slow
def test_two_replicas_both_named(tmp_path: Path) -> None:
    layout = ["--parallelism.data_parallel_replicate_degree", "2"]
    layout += ["--parallelism.data_parallel_shard_degree", "1"]
    results = run_scenario(2, tmp_path, layout, [{"rank": 1, "tensor": WQ}])
    assert results[0]["compared"] == 63
    error = same_on_every_rank(results, 0)
    assert error["ranks"] == (0, 1)
    assert "at step 3: ranks 0 and 1 (host " in error["line"]
    assert f"disagree on {WQ} " in error["line"]


@pytest.mark.slow
def test_hsdp_compares_each_shard_with_its_replica_only(tmp_path: Path) -> None:
    """dp_replicate 2 x dp_shard 2: ranks 0 and 2 hold the same shards, 1 and 3 the others
    (read from the DTensors' placements); a bit of rank 3's optimizer state names 1 and 3,
    and ranks 0 and 2, which hold nothing it touched, stop at the same step."""
    layout = ["--parallelism.data_parallel_replicate_degree", "2"]
    layout += ["--parallelism.data_parallel_shard_degree", "2"]
    flips = [{"rank": 3, "tensor": W2, "state": "exp_avg"}]
    results = run_scenario(4, tmp_path, layout, flips)
    assert [sorted(r["plan"]) for r in results] == [[(0, 2)], [(1, 3)], [(0, 2)], [(1, 3)]]
    assert len(results[0]["plan"][(0, 2)]) == 63
    error = same_on_every_rank(results, 0)
    assert error["ranks"] == (1, 3) and error["tensors"] == (f"optimizer state exp_avg of {W2}",)
    assert all(r["clean_again"] for r in results)


@pytest.mark.slow
def test_tensor_parallel_ranks_compare_their_replicated_norms(tmp_path: Path) -> None:
    layout = ["--parallelism.tensor_parallel_degree", "2"]
    layout += ["--parallelism.data_parallel_shard_degree", "1"]
    norm = "layers.1.ffn_norm.weight"
    results = run_scenario(2, tmp_path, layout, [{"rank": 1, "tensor": norm}])
    names = results[0]["plan"][(0, 1)]
    norms = [f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attention", "ffn")]
    assert [n for n in names if not n.startswith("optimizer")] == [*norms, "norm.weight"]
    assert f"optimizer state exp_avg of {norm}" in names and WQ not in names
    error = same_on_every_rank(results, 0)
    assert error["ranks"] == (0, 1) and error["tensors"] == (norm,)


# ----- a real run (the trainer's integration, titanlite/health/monitor.py) -----------------

# On rank 1 only, right after step 3's update: one bit of its wq weight flipped.
FLIP_AFTER_STEP_3 = """
import importlib.util, os, sys
class _Wrap:
    def find_spec(self, name, path=None, target=None):
        if name != "titanlite.trainer" or os.environ.get("RANK") != "1":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            step = module.Trainer.train_step
            def flipping(trainer, *args, **kwargs):
                out = step(trainer, *args, **kwargs)
                if trainer.state.step == 3:
                    import torch
                    weights = dict(trainer.model.parts[0].named_parameters())
                    with torch.no_grad():
                        weights["layers.0.attention.wq.weight"].view(torch.int32).view(-1)[0] ^= 1
                return out
            module.Trainer.train_step = flipping
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Wrap())
"""


@pytest.mark.slow
def test_a_run_stops_with_exit_4_before_saving_the_corrupted_step(tmp_path: Path) -> None:
    """Checks every 2 steps, saves every 2: the bit flipped after step 3 is found at step 4,
    before its save; step-2 stays the latest checkpoint and the same command could resume."""
    from sdc_scenarios import TINY

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FLIP_AFTER_STEP_3)
    out = tmp_path / "run"
    result = run_train(
        tmp_path,
        "train_configs/debug_model.toml",
        *TINY,
        "--training.steps",
        "6",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--health.sdc_check_interval",
        "2",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(out),
        ngpu=2,
        PYTHONPATH=str(hook),
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_COMM_FAILURE, output[-3000:]
    assert "silent data corruption at step 4: ranks 0 and 1 (host " in output, output[-3000:]
    assert "layers.0.attention.wq.weight" in output
    saved = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert "step-2" in saved and not any(name.startswith("step-4") for name in saved), saved
