"""Starting a run from a Hugging Face folder or a titanlite checkpoint with no shape restated
(checkpoint.initial_load_path), and saving as a Hugging Face folder while training
(checkpoint.last_save_in_hf): family, shape and tokenizer from the folder, a named shape
that differs refused in one line, the first step's loss equal to transformers' under every
layout (each rank reading only its slices), and the saved folder loading in transformers with
titanlite's logits and greedy text."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import hf_scenarios
import pytest
import torch
from checkpoints import write_checkpoint
from conftest import run_train

from titanlite.assembly import build_model_args
from titanlite.config import load_config
from titanlite.data.build import build_training_data
from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from titanlite.errors import EXIT_USER_ERROR
from titanlite.interop.hf import save_hf
from titanlite.models import get
from titanlite.models.llama.args import LlamaArgs

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")


def titanlite_llama(**changes: object) -> torch.nn.Module:
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32)
    args = dataclasses.replace(args, **changes)
    torch.manual_seed(0)
    model = get("llama3").build(args)
    model.args = args
    return model


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """An HF Llama folder written by titanlite's exporter (no transformers needed)."""
    model = titanlite_llama()
    out = tmp_path / "hf"
    save_hf(
        model.state_dict(),
        get("llama3"),
        model.args,
        out,
        tokenizer=load_tokenizer(DEFAULT_TOKENIZER_PATH),
    )
    (out / "titanlite_export.json").unlink()  # as a folder from elsewhere
    return out


def config_of(tmp_path: Path, *argv: str) -> object:
    return load_config(["--job.config_file", str(hf_scenarios.config_file(tmp_path)), *argv])


def test_an_hf_folder_gives_family_shape_and_tokenizer(tmp_path: Path, hf_folder: Path) -> None:
    cfg = config_of(tmp_path, "--checkpoint.initial_load_path", str(hf_folder))
    assert (cfg.model.name, cfg.model.flavor) == ("from_checkpoint", "from_checkpoint")
    assert cfg.model.tokenizer_path == str(hf_folder)
    spec, args = build_model_args(cfg, load_tokenizer(cfg.model.tokenizer_path).vocab_size)
    assert spec.name == "llama3"
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (64, 2, 4, 2)
    assert args.max_seq_len == cfg.training.seq_len


def test_a_titanlite_checkpoint_gives_its_shape(tmp_path: Path) -> None:
    model = titanlite_llama(dim=96, n_heads=6, n_kv_heads=3)
    ckpt = write_checkpoint(tmp_path / "ckpt", model, step=5, model_name="llama3")
    cfg = config_of(tmp_path, "--checkpoint.initial_load_path", str(ckpt))
    _, args = build_model_args(cfg, 4096)
    assert dataclasses.replace(args, max_seq_len=0) == dataclasses.replace(
        model.args, max_seq_len=0
    )


def test_a_named_shape_that_differs_is_one_line(tmp_path: Path, hf_folder: Path) -> None:
    cfg = config_of(
        tmp_path,
        "--checkpoint.initial_load_path",
        str(hf_folder),
        "--model.name",
        "llama3",
        "--model.flavor",
        "debugmodel",
    )
    with pytest.raises(Exception, match="holds a different model: ") as caught:
        build_model_args(cfg, 4096)
    message = str(caught.value)
    assert "\n" not in message and "dim=64 (this run: 256)" in message


def test_torchtitan_initial_load_in_hf_carries_over() -> None:
    from titanlite.config.torchtitan import convert

    hf = {"initial_load_in_hf": True, "initial_load_path": "/hf/llama", "last_save_in_hf": True}
    conversion = convert({"checkpoint": hf})
    assert conversion.config["checkpoint"]["initial_load_path"] == "/hf/llama"
    assert conversion.config["checkpoint"]["last_save_in_hf"] is True
    assert not [n for n in conversion.blocking if n.key.startswith("checkpoint.")]
    dcp = convert({"checkpoint": {"initial_load_path": "/ckpt/step-10"}})
    assert [n.key for n in dcp.blocking] == ["checkpoint.initial_load_path"]


def test_qwen3_5_layer_types_are_the_explicit_list() -> None:
    adapter = get("qwen3_5").hf_adapter()
    args = adapter.from_hf_config(
        {
            "model_type": "qwen3_5_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 4096,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "full_attention"],
        }
    )
    assert [args.is_full_attention(i) for i in range(3)] == [False, True, True]
    again = adapter.from_hf_config(adapter.to_hf_config(args))
    assert again.layer_types == args.layer_types
    with pytest.raises(ValueError, match="layer_types must list 3"):
        dataclasses.replace(args, layer_types=["full_attention"]).check()


def test_gpt_oss_layer_types_are_the_explicit_list() -> None:
    """gpt-oss's per-layer windows: an HF list that is not the sliding-first alternation
    becomes model.layer_types (and is written back as it was); the alternation stays the
    flavors' window_pattern."""
    adapter = get("gpt_oss").hf_adapter()
    config = {
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 4096,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    }
    args = adapter.from_hf_config(config)
    assert args.layer_types == config["layer_types"]
    assert [args.layer_window(i) for i in range(3)] == [None, 8, 8]
    assert adapter.to_hf_config(args)["layer_types"] == config["layer_types"]
    alternating = ["sliding_attention", "full_attention", "sliding_attention"]
    plain = adapter.from_hf_config(config | {"layer_types": alternating})
    assert plain.layer_types == [] and plain.window_pattern == "LG"
    assert [plain.layer_window(i) for i in range(3)] == [8, None, 8]
    with pytest.raises(ValueError, match="layer_types must list 3"):
        dataclasses.replace(args, layer_types=["linear_attention"] * 3).check()


def test_deepseek_mtp_blocks_the_folder_lacks_are_left_out() -> None:
    from titanlite.models.deepseek_v3.args import DeepseekV3Args

    adapter = get("deepseek_v3").hf_adapter()
    args = DeepseekV3Args(n_layers=2, mtp_layers=1)
    assert adapter.fit_to_tensors(args, ["model.layers.1.mlp.gate.weight"]).mtp_layers == 0
    assert adapter.fit_to_tensors(args, ["model.layers.2.eh_proj.weight"]).mtp_layers == 1


@pytest.mark.slow
def test_bad_folders_exit_2_in_one_line(tmp_path: Path, hf_folder: Path) -> None:
    config = hf_scenarios.config_file(tmp_path / "cfg")
    broken = tmp_path / "broken"
    shutil.copytree(hf_folder, broken)
    (broken / "config.json").write_text("{ not json")
    truncated = tmp_path / "truncated"
    shutil.copytree(hf_folder, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    for folder, expected in [
        (tmp_path / "missing", "does not exist"),
        (broken, "is not valid JSON"),
        (truncated, "unreadable"),
    ]:
        result = run_train(
            tmp_path, str(config), "--checkpoint.initial_load_path", str(folder), timeout=300
        )
        lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert result.returncode == EXIT_USER_ERROR, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and expected in result.stderr, result.stderr
        assert len(lines) == 1, lines


# ----------------------------------------------------------------------- transformers' models
FAMILIES = ["llama3", "qwen3_moe", "qwen3_5", "deepseek_v3", "qwen3_5_moe", "gpt_oss"]
DP_SHARD, TP = "--parallelism.data_parallel_shard_degree", "--parallelism.tensor_parallel_degree"
PP, EP = "--parallelism.pipeline_parallel_degree", "--parallelism.expert_parallel_degree"
LAYOUTS = {
    "1 rank": (1, []),
    "fsdp 2 x tp 2": (4, [f"{DP_SHARD}=2", f"{TP}=2"]),
    "pp 2": (2, [f"{PP}=2", f"{DP_SHARD}=1"]),
    "ep 2": (2, [f"{DP_SHARD}=2", f"{EP}=2"]),
}
MOE = {"qwen3_moe", "deepseek_v3", "qwen3_5_moe", "gpt_oss"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, float]]:
    """Per family: its transformers-made folder and transformers' loss on the first batch."""
    pytest.importorskip("transformers")
    import hf_families

    root = tmp_path_factory.mktemp("hf_families")
    made = {}
    for family in FAMILIES:
        folder = hf_families.write_folder(family, root / family)
        cfg = config_of(root / f"{family}-cfg", "--checkpoint.initial_load_path", str(folder))
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        whole = dataclasses.replace(cfg.training, local_batch_size=4)  # the global batch
        loader = build_training_data(tokenizer, whole, cfg.validation, dp_rank=0, dp_world_size=1)
        inputs, labels = next(iter(loader.loader))
        made[family] = (folder, hf_families.loss_of(hf_families.load(folder), inputs, labels))
    return made


def first_loss(run: dict) -> float:
    return next(r["loss"] for r in run["records"] if r.get("step") == 1 and "loss" in r)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "layout"),
    [(f, lay) for f in FAMILIES for lay in LAYOUTS if lay != "ep 2" or f in MOE],
)
def test_first_loss_equals_transformers(
    tmp_path: Path, folders: dict, family: str, layout: str
) -> None:
    from pool import get_pool

    folder, expected = folders[family]
    world, argv = LAYOUTS[layout]
    config = hf_scenarios.config_file(tmp_path, local=4 if world == 1 or "pp" in layout else 2)
    run = get_pool(world).run(
        hf_scenarios.train,
        argv=[
            "--job.config_file",
            str(config),
            "--checkpoint.initial_load_path",
            str(folder),
            *argv,
        ],
    )[0]
    got = first_loss(run)
    print(f"{family} {layout}: {got} vs transformers' {expected}: {abs(got / expected - 1):.1e}")
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)


@pytest.mark.slow
def test_training_from_an_hf_folder_continues_and_resumes(tmp_path: Path, folders: dict) -> None:
    """The same command again resumes from the run's own checkpoint (not the folder): the
    resumed step 3 equals an uninterrupted run's (same schedule: 3 steps, stopped at 2)."""
    from pool import get_pool

    folder, _ = folders["qwen3_moe"]
    pool = get_pool(2)
    argv = ["--checkpoint.initial_load_path", str(folder), *LAYOUTS["ep 2"][1]]
    straight = hf_scenarios.config_file(tmp_path / "straight", steps=3)
    whole = pool.run(hf_scenarios.train, argv=["--job.config_file", str(straight), *argv])[0]
    cut = hf_scenarios.config_file(tmp_path / "cut", steps=3)
    pool.run(
        "train_scenarios:train_until_preempted",
        argv=["--job.config_file", str(cut), *argv],
        stop_at=2,
    )
    resumed = pool.run(hf_scenarios.train, argv=["--job.config_file", str(cut), *argv])[0]
    kinds = [r.get("kind") for r in resumed["records"]]
    assert "resume" in kinds
    step3 = [r["loss"] for r in resumed["records"] if r.get("step") == 3 and "loss" in r]
    expected = [r["loss"] for r in whole["records"] if r.get("step") == 3 and "loss" in r]
    assert step3 == expected and len(step3) == 1


@pytest.mark.slow
def test_last_save_in_hf_loads_in_transformers(tmp_path: Path, folders: dict) -> None:
    """dp_shard 2 x tp 2 writes step-N/hf (each rank its own file); transformers loads it
    with titanlite's logits and greedy text."""
    import hf_families
    from pool import get_pool

    from titanlite.interop.checkpoint_model import load_checkpoint_model
    from titanlite.models.generate import generate

    folder, _ = folders["llama3"]
    config = hf_scenarios.config_file(tmp_path)
    get_pool(4).run(
        hf_scenarios.train,
        argv=[
            "--job.config_file",
            str(config),
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.last_save_in_hf",
            *LAYOUTS["fsdp 2 x tp 2"][1],
        ],
    )
    step = tmp_path / "run" / "checkpoint" / "step-2"
    saved = step / "hf"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # more than one rank wrote
    ours = load_checkpoint_model(step).model
    theirs = hf_families.load(saved)
    x = torch.randint(4, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert (a - b).abs().max().item() <= 1e-5 * max(a.abs().max().item(), 1.0)
    prompt = x[0, :8].tolist()
    mine = generate(ours, prompt, 12, 64)
    with torch.no_grad():
        hf_text = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert hf_text[0, 8:].tolist() == mine


@pytest.mark.slow
def test_save_format_dcp_hf_writes_every_save_and_resumes(tmp_path: Path, folders: dict) -> None:
    """checkpoint.save_format = "dcp+hf" at 1 rank: every save holds step-N/hf, which
    transformers loads with titanlite's logits (<= 1e-5); a run stopped at step 2 resumes
    from the DCP part, its step 3 an uninterrupted (DCP-only) run's."""
    import hf_families
    from pool import get_pool

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    folder, _ = folders["llama3"]
    pool = get_pool(1)
    argv = ["--checkpoint.initial_load_path", str(folder)]
    straight = hf_scenarios.config_file(tmp_path / "straight", steps=3, local=4)
    whole = pool.run(hf_scenarios.train, argv=["--job.config_file", str(straight), *argv])[0]
    cut = hf_scenarios.config_file(tmp_path / "cut", steps=3, local=4)
    cut_argv = ["--job.config_file", str(cut), *argv, "--checkpoint.save_format", "dcp+hf"]
    pool.run("train_scenarios:train_until_preempted", argv=cut_argv, stop_at=2)
    resumed = pool.run(hf_scenarios.train, argv=cut_argv)[0]
    assert "resume" in [r.get("kind") for r in resumed["records"]]
    step3 = [r["loss"] for r in resumed["records"] if r.get("step") == 3 and "loss" in r]
    expected = [r["loss"] for r in whole["records"] if r.get("step") == 3 and "loss" in r]
    assert step3 == expected and len(step3) == 1

    saves = sorted((tmp_path / "cut" / "run" / "checkpoint").glob("step-*"))
    assert [s.name for s in saves] == ["step-1", "step-2", "step-3"]
    x = torch.randint(4, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    for step in saves:
        ours, theirs = load_checkpoint_model(step).model, hf_families.load(step / "hf")
        with torch.no_grad():
            a, b = ours(x), theirs(x).logits
        difference = (a - b).abs().max().item() / max(a.abs().max().item(), 1.0)
        print(f"dcp+hf {step.name}/hf: logits within {difference:.1e} of titanlite's")
        assert difference <= 1e-5, step.name
