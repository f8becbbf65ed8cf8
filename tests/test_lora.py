"""LoRA (model.converters = ["lora"], [lora]): frozen base weights with no optimizer state,
the same steps under fsdp 2 x tp 2, pp 2 and cp 2 as in one process, adapter factors split to
match the tensor-parallel style, adapters-only checkpoints that resume exactly, and an export
that merges the adapters into the weights."""

from __future__ import annotations

import pytest

SMALL = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "4",
    "--training.seq_len",
    "64",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--training.steps",
    "8",
    "--optimizer.lr",
    "1e-2",
    "--model.converters",
    "lora",
    "--lora.rank",
    "4",
]


def _train(world: int, argv: list[str]) -> dict:
    import lora_scenarios
    from pool import get_pool

    return get_pool(world).run(lora_scenarios.train_lora, argv=argv)[0]


def _losses(result: dict) -> list[dict]:
    return [r for r in result["run"]["records"] if "loss" in r]


def _check_frozen(result: dict) -> None:
    """Only adapters trained; the base weights bitwise unchanged; optimizer state for exactly
    the trainable parameters; the adapters moved."""
    trainable = result["trainable"]
    assert trainable and all(n.rpartition(".")[2] in ("lora_a", "lora_b") for n in trainable)
    assert len(trainable) == 2 * 2 * 7  # 2 layers x 7 linears x (A, B)
    for name, before in result["before"].items():
        same = bool((before == result["after"][name]).all())
        assert same == (name not in trainable), name
    for held, own, equal in result["states"]:
        assert equal and held == own > 0


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """8 steps in one process at the global batch of the layouts below, saving at step 4."""
    folder = tmp_path_factory.mktemp("lora_one")
    argv = [*SMALL, "--training.local_batch_size", "4", "--job.dump_folder", str(folder)]
    argv += ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    return {**_train(1, argv), "folder": folder, "argv": argv}


@pytest.mark.slow
def test_only_the_adapters_train_and_checkpoints_hold_them_and_resume_exactly(
    one_process: dict,
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    _check_frozen(one_process)
    step4 = one_process["folder"] / "checkpoint" / "step-4"
    saved = FileSystemReader(str(step4)).read_metadata().state_dict_metadata
    weights = sorted(k.split(".", 1)[1] for k in saved if k.startswith("model."))
    assert weights == sorted(one_process["trainable"])  # adapters only, no frozen weight
    resumed = _train(1, [*one_process["argv"], "--checkpoint.load_step", "4"])
    a = {r["step"]: r["loss"] for r in _losses(one_process)}
    b = {r["step"]: r["loss"] for r in _losses(resumed)[8:]}  # metrics.jsonl goes on
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[s] == b[s] for s in b), (a, b)
    for name in one_process["before"]:  # adapters as trained, the base back from the seed
        assert (one_process["after"][name] == resumed["after"][name]).all(), name


def _same_steps(one: dict, other: dict) -> tuple[float, float]:
    """The worst relative difference of loss and gradient norm over the steps; and of the
    trained adapters at the end (relative to each tensor's largest element)."""
    a, b = _losses(one), _losses(other)
    assert len(a) == len(b) == 8
    steps = max(
        abs(x[k] - y[k]) / max(abs(x[k]), 1e-30)
        for x, y in zip(a, b, strict=True)
        for k in ("loss", "grad_norm")
    )
    weights = max(
        float((x - y).abs().max() / x.abs().max())
        for x, y in ((one["after"][n], other["after"][n]) for n in one["trainable"])
    )
    return steps, weights


LAYOUTS = {  # name: world, arguments, local batch (global batch 4), the degrees above 1
    "fsdp 2 x tp 2": (
        4,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        "2",
        {"dp_shard": 2, "tp": 2},
    ),
    "pp 2": (2, ["--parallelism.pipeline_parallel_degree", "2"], "4", {"pp": 2}),
    # Each rank holds half of every sequence (2 chunks of 16 tokens), its adapters' gradients
    # averaged over cp.
    "cp 2": (2, ["--parallelism.context_parallel_degree", "2"], "4", {"cp": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_takes_the_steps_of_one_process(tmp_path, one_process: dict, layout: str) -> None:
    world, argv, local, degrees = LAYOUTS[layout]
    other = _train(
        world,
        [*SMALL, *argv, "--training.local_batch_size", local, "--job.dump_folder", str(tmp_path)],
    )
    used = other["run"]["info"]["parallel_degrees"]
    assert {k: v for k, v in used.items() if v > 1} == degrees
    _check_frozen(other)
    steps, weights = _same_steps(one_process, other)
    print(f"\nLoRA, {layout} vs one process, 8 steps: loss and grad norm {steps:.2e}, ", end="")
    print(f"adapters {weights:.2e} (max relative differences)")
    assert steps <= 1e-6
    # Adam divides each gradient by its own size, so a rounding difference in the tiny first
    # gradients of B (which starts at zero) moves an element by up to a step of lr.
    assert weights <= 1e-4


@pytest.mark.slow
def test_tensor_parallel_splits_the_factors_to_match_the_weight() -> None:
    import lora_scenarios
    from pool import get_pool

    result = get_pool(2).run(lora_scenarios.tp_factors)[0]
    print(f"\nLoRA factors at tp 2 vs unsplit: {result}")
    assert result["output"] <= 1e-6
    placements = {k: v[0] for k, v in result.items() if k != "output"}
    assert placements == {
        "0.lora_a": "R",  # column-wise: A whole, B split by output rows
        "0.lora_b": "S(0)",
        "1.lora_a": "S(1)",  # row-wise: A split by input columns, B whole
        "1.lora_b": "R",
    }
    assert all(v[1] <= 1e-6 for k, v in result.items() if k != "output")


@pytest.mark.slow
def test_merged_export_gives_transformers_the_lora_models_logits(tmp_path) -> None:
    """An HF folder (made by transformers) -> LoRA training from it -> adapters-only
    checkpoints (a resume reads the base from the folder again) -> convert_to_hf.py
    --merge-lora -> transformers computes titanlite's logits."""
    pytest.importorskip("transformers")
    import dataclasses
    import sys

    import hf_families
    import hf_scenarios
    import torch
    from conftest import REPO
    from pool import get_pool

    from titanlite.converters.lora import convert
    from titanlite.converters.lora_settings import LoraSettings
    from titanlite.interop.hf import load_hf
    from titanlite.interop.lora_merge import read_adapters

    base = hf_families.write_folder("llama3", tmp_path / "base")
    config = hf_scenarios.config_file(tmp_path / "run", steps=3, local=4)
    argv = ["--job.config_file", str(config), "--checkpoint.initial_load_path", str(base)]
    argv += ["--model.converters", "lora", "--lora.rank", "4", "--optimizer.lr", "1e-2"]
    first = get_pool(1).run(hf_scenarios.train, argv=argv)[0]
    # Resumed from step 2: the base comes back from the folder, the adapters from step-2.
    again = get_pool(1).run(hf_scenarios.train, argv=[*argv, "--checkpoint.load_step", "2"])[0]
    losses = [[r["loss"] for r in run["records"] if "loss" in r] for run in (first, again)]
    assert losses[1][-1] == losses[0][2]
    step = tmp_path / "run" / "run" / "checkpoint" / "step-3"
    out = tmp_path / "merged"
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_to_hf

    assert convert_to_hf.main([str(step), str(out)]) == 2  # adapters only: needs the flag
    assert convert_to_hf.main([str(step), str(out), "--merge-lora"]) == 0

    state, spec, args = load_hf(base)
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(args, tie_embeddings=False))
    convert(model, spec, LoraSettings(rank=4))
    model.to_empty(device="cpu")
    spec.init_buffers(model)
    adapters = read_adapters(step)
    assert all(bool(t.abs().sum()) for t in adapters.values())  # trained: B moved off zero
    model.load_state_dict({**state, **adapters})
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(tokens)
        theirs = hf_families.load(out)(tokens).logits
        before = hf_families.load(base)(tokens).logits
    worst = float((ours - theirs).abs().max())
    print(f"\nmerged LoRA export: transformers vs titanlite logits, max difference {worst:.2e}")
    assert worst <= 1e-5
    assert float((before - theirs).abs().max()) > 1e-4  # the adapters changed the model


def test_bad_lora_settings_are_one_line_each() -> None:
    import torch
    from train_scenarios import DEBUG_CONFIG

    from titanlite.checks import check
    from titanlite.config import load_config
    from titanlite.converters.lora import LoraLinear, convert
    from titanlite.converters.lora_settings import LoraSettings
    from titanlite.errors import UserError
    from titanlite.models import get

    bad = ["--model.converters", "lora", "--lora.rank", "0", "--lora.dropout", "1.5"]
    bad += ["--checkpoint.last_save_in_hf", "true"]
    with pytest.raises(UserError) as e:
        check(load_config(["--job.config_file", DEBUG_CONFIG, *bad]), 1)
    assert "lora.rank must be at least 1" in str(e.value)
    assert "lora.dropout must be in [0, 1)" in str(e.value)
    assert "--merge-lora" in str(e.value)
    spec = get("llama3")
    args = spec.make_args("debugmodel", 256, 64, {})
    with torch.device("meta"):
        model = spec.build(args)
    with pytest.raises(UserError, match="matches no linear"):
        convert(model, spec, LoraSettings(target_modules=["attention.nothing"]))
    assert convert(model, spec, LoraSettings(target_modules=["wq", "layers.0.*.w2"])) == 1 + len(
        model.layers
    )
    assert isinstance(model.layers["0"].feed_forward.w2, LoraLinear)
    assert not isinstance(model.layers["1"].feed_forward.w2, LoraLinear)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
