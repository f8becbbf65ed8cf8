"""TorchTitan v0.2 configs: detection, conversion to titanlite keys, the blocking settings, the
converter script's exit statuses and files, and the docs table (all torch-free and fast)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from titanlite.assembly import build_model_args
from titanlite.config import ConfigError, JobConfig, load_config
from titanlite.config.parse import apply_toml, tomllib
from titanlite.config.torchtitan import (
    Conversion,
    convert,
    looks_like_torchtitan,
    mapping,
    mapping_table_markdown,
)
from titanlite.models import REGISTRY

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "convert_torchtitan_config.py"
TRAIN_CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))

# Laid out like TorchTitan's llama3 debug_model.toml (same sections and keys, values of our own).
TT_DEBUG = """
[job]
dump_folder = "./runs/tt_debug"
description = "small llama for a smoke test"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "traces"
profile_freq = 20
enable_memory_snapshot = false
save_memory_snapshot_folder = "snapshots"

[metrics]
log_freq = 2
disable_color_printing = true
enable_tensorboard = false
save_tb_folder = "board"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./assets/debug_tokenizer"  # a folder with tokenizer.json
# converters = ["quantize.linear.float8"]

[optimizer]
name = "AdamW"
lr = 1e-3
eps = 1e-7

[lr_scheduler]
warmup_steps = 3
decay_ratio = 0.5
decay_type = "cosine"
min_lr_factor = 0.05

[training]
local_batch_size = 4
seq_len = 512
max_norm = 0.5
steps = 30
dataset = "c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "never"
tensor_parallel_degree = 2
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
context_parallel_degree = 1

[checkpoint]
enable = true
folder = "ckpt"
interval = 15
last_save_model_only = false
export_dtype = "bfloat16"
async_mode = "async_with_pinned_mem"

[activation_checkpoint]
mode = "selective"
selective_ac_option = '3'

[compile]
enable = true
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output"]

[validation]
enable = true
dataset = "c4_validation"
freq = 10
steps = 4
"""

# Laid out like TorchTitan's llama3_8b.toml.
TT_8B = """
# a multi-node preset
[job]
dump_folder = "./runs/tt_8b"
description = "llama 3 8B pretraining"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 50

[metrics]
log_freq = 5
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "/models/Llama-3.1-8B"

[optimizer]
name = "AdamW"
lr = 2e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 100

[training]
local_batch_size = 2
seq_len = 4096
max_norm = 1.0
steps = 2000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1
tensor_parallel_degree = 4
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = true
folder = "checkpoint"
interval = 250
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled"

[compile]
enable = false
components = ["model", "loss"]

[activation_checkpoint]
mode = "full"
selective_ac_option = "op"

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 250
steps = 100
"""


def parsed(text: str) -> dict:
    return tomllib.loads(text)


def converted(text: str) -> Conversion:
    conv = convert(parsed(text))
    apply_toml(JobConfig(), conv.config, "converted")  # every key exists with the right type
    return conv


def dropped_keys(conv: Conversion) -> set[str]:
    return {note.key for note in conv.dropped}


def blocking_keys(conv: Conversion) -> set[str]:
    return {note.key for note in conv.blocking}


# --- conversion -------------------------------------------------------------------------------


def test_debug_model_converts() -> None:
    conv = converted(TT_DEBUG)
    c = conv.config
    assert conv.blocking == []
    assert c["job"] == {
        "dump_folder": "./runs/tt_debug",
        "description": "small llama for a smoke test",
    }
    # TorchTitan's debugmodel shape, and its 2048-row embedding since a tokenizer is named
    assert c["model"] == {
        "name": "llama3",
        "flavor": "debugmodel",
        "tokenizer_path": "./assets/debug_tokenizer",
        "vocab_size": 2048,
        "n_layers": 6,
        "n_heads": 16,
        "n_kv_heads": 16,
        "multiple_of": 256,
    }
    assert c["optimizer"] == {"name": "AdamW", "lr": 1e-3, "eps": 1e-7}
    assert c["lr_scheduler"] == {
        "warmup_steps": 3,
        "decay_ratio": 0.5,
        "decay_type": "cosine",
        "min_lr_factor": 0.05,
    }
    t = c["training"]
    assert (t["steps"], t["local_batch_size"], t["seq_len"], t["max_norm"]) == (30, 4, 512, 0.5)
    assert t["dataset"] == "sotu" and "dataset_path" not in t
    assert t["mixed_precision_param"] == "bfloat16"  # TorchTitan's default, unlike titanlite's
    p = c["parallelism"]
    assert (p["tensor_parallel_degree"], p["data_parallel_shard_degree"]) == (2, -1)
    assert p["fsdp_reshard_after_forward"] == "never"
    assert (p["pipeline_parallel_degree"], p["pipeline_parallel_schedule"]) == (1, "1F1B")
    assert c["checkpoint"] == {
        "enable": True,
        "folder": "ckpt",
        "interval": 15,
        "keep_latest_k": 10,  # TorchTitan's default
        "async_mode": "async",
        "last_save_model_only": False,
        "export_dtype": "bfloat16",
    }
    assert c["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "3"}
    assert c["compile"] == {"enable": True}
    assert c["metrics"] == {
        "log_freq": 2,
        "enable_wandb": False,
        "enable_tensorboard": False,
        "tensorboard_folder": "board",
    }
    assert c["profiling"]["save_traces_folder"] == "traces"
    assert c["validation"] == {"enable": True, "freq": 10, "steps": 4}
    # the degrees at 1, the float8 settings without converters: accepted silently; TorchTitan
    # would validate with its default batch 8 x 2048, titanlite uses the training shape
    assert dropped_keys(conv) == {
        "training.dataset",
        "compile.components",
        "validation.dataset",
        "validation.local_batch_size",
        "validation.seq_len",
    }
    assert ("model.hf_assets_path", "model.tokenizer_path") in conv.mapped
    assert ("metrics.save_tb_folder", "metrics.tensorboard_folder") in conv.mapped


def test_8b_converts() -> None:
    conv = converted(TT_8B)
    c = conv.config
    assert conv.blocking == [] and conv.dropped == []
    assert c["model"] == {
        "name": "llama3",
        "flavor": "8B",
        "tokenizer_path": "/models/Llama-3.1-8B",
        "vocab_size": 128256,
    }
    assert c["optimizer"]["lr"] == 2e-4 and c["lr_scheduler"] == {"warmup_steps": 100}
    t = c["training"]
    assert (t["steps"], t["local_batch_size"], t["seq_len"]) == (2000, 2, 4096)
    assert (t["dataset"], t["dataset_config"]) == ("allenai/c4", "en")
    assert c["parallelism"] == {
        "data_parallel_replicate_degree": 2,
        "data_parallel_shard_degree": -1,
        "tensor_parallel_degree": 4,
        "context_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "pipeline_parallel_first_stage_less_layers": 1,  # TorchTitan's defaults
        "pipeline_parallel_last_stage_less_layers": 1,
    }
    assert c["checkpoint"]["interval"] == 250 and c["checkpoint"]["last_save_model_only"] is True
    assert c["activation_checkpoint"] == {"mode": "full", "selective_ac_option": "op"}
    assert c["metrics"]["enable_tensorboard"] is True
    assert c["profiling"] == {
        "enable_profiling": True,
        "profile_freq": 50,
        "save_traces_folder": "profile_trace",
    }


def test_renamed_keys_and_defaults() -> None:
    conv = converted(
        '[model]\nhf_assets_path = "hf"\ntokenizer_path = "old/tok"\n[debug]\nseed = 7\n'
        'deterministic = true\n[comm]\nmode = "fake_backend"\n[checkpoint]\n'
        'exclude_from_loading = "optimizer,dataloader"\n'
    )
    c = conv.config
    assert c["model"]["tokenizer_path"] == "old/tok"  # the deprecated key wins, as in TorchTitan
    assert c["training"]["seed"] == 7 and c["training"]["deterministic"] is True
    assert c["job"] == {"dry_run": True}
    assert c["checkpoint"]["exclude_from_loading"] == ["optimizer", "dataloader"]
    assert c["checkpoint"]["enable"] is False  # TorchTitan's default when unset
    assert c["activation_checkpoint"] == {"mode": "selective"}
    assert conv.blocking == []


def test_without_tokenizer_the_vocabulary_follows_titanlite_default() -> None:
    conv = converted('[model]\nname = "qwen3"\nflavor = "debugmodel"\n[job]\nprint_config = true\n')
    assert "vocab_size" not in conv.config["model"] and "tokenizer_path" not in conv.config["model"]
    assert conv.config["model"]["head_dim"] == 128
    assert {"model.hf_assets_path", "job.print_config"} <= dropped_keys(conv)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (
            '[parallelism]\npipeline_parallel_schedule = "DualPipeV"\n',
            "parallelism.pipeline_parallel_schedule",
        ),
        (
            "[checkpoint]\ninitial_load_in_hf_quantized = true\n",
            "checkpoint.initial_load_in_hf_quantized",
        ),
        ('[model]\nname = "llama4"\nflavor = "17bx16e"\n', "model.name"),
        ('[model]\nname = "deepseek_v3"\nflavor = "1T"\n', "model.flavor"),
        ('[model]\nname = "qwen3"\nflavor = "72B"\n', "model.flavor"),
        ('[model]\nconverters = ["quantize.linear.mx"]\n', "model.converters"),
        ('[optimizer]\nname = "Adam"\n', "optimizer.name"),
        ('[checkpoint]\ninitial_load_path = "/ckpt/step-100"\n', "checkpoint.initial_load_path"),
        ('[experimental]\ncustom_import = "my.module"\n', "experimental.custom_import"),
        ('[training]\ndataset = "my_registered_set"\n', "training.dataset"),
    ],
)
def test_blocking(text: str, key: str) -> None:
    conv = converted(text)
    assert key in blocking_keys(conv)
    assert any(line.startswith(f"blocking: {key} = ") for line in conv.report_lines())


# TorchTitan v0.2's qwen3 MoE flavors (torchtitan/models/qwen3/__init__.py): the model each
# must become. All route softmax top-k renormalized, with no shared expert, and balance by a
# routing bias moved 1e-3 a step (load_balance_coeff) without an auxiliary loss.
TT_QWEN3_MOE = {
    "debugmodel_moe": (
        "debugmodel",
        {
            "dim": 256,
            "n_layers": 8,
            "n_heads": 16,
            "n_kv_heads": 8,
            "head_dim": 128,
            "num_experts": 64,
            "top_k": 8,
            "moe_hidden_dim": 768,
            "rope_theta": 1e6,
            "tie_embeddings": False,
            "vocab_size": 2048,
        },
    ),
    "30B-A3B": (
        "30B-A3B",
        {
            "dim": 2048,
            "n_layers": 48,
            "n_heads": 32,
            "n_kv_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "top_k": 8,
            "moe_hidden_dim": 768,
            "rope_theta": 1e6,
            "tie_embeddings": False,
            "vocab_size": 151936,
        },
    ),
    "235B-A22B": (
        "235B-A22B",
        {
            "dim": 4096,
            "n_layers": 94,
            "n_heads": 64,
            "n_kv_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "top_k": 8,
            "moe_hidden_dim": 1536,
            "rope_theta": 5e6,
            "tie_embeddings": False,
            "vocab_size": 151936,
        },
    ),
}
TT_MOE_ROUTING = {
    "score_func": "softmax",
    "norm_topk": True,
    "shared_experts": 0,
    "norm_eps": 1e-6,
    "aux_loss_coef": 0.0,
    "bias_update_rate": 1e-3,
}


@pytest.mark.parametrize("tt_flavor", list(TT_QWEN3_MOE))
def test_qwen3_moe_flavors_convert_to_qwen3_moe_with_torchtitan_shape(tt_flavor: str) -> None:
    flavor, shape = TT_QWEN3_MOE[tt_flavor]
    text = f'[model]\nname = "qwen3"\nflavor = "{tt_flavor}"\nhf_assets_path = "tok"\n'
    conv = converted(text)
    assert conv.blocking == [] and "model.flavor" not in dropped_keys(conv)
    model = dict(conv.config["model"])
    assert (model.pop("name"), model.pop("flavor"), model.pop("tokenizer_path")) == (
        "qwen3_moe",
        flavor,
        "tok",
    )
    vocab_size = model.pop("vocab_size")
    args = REGISTRY["qwen3_moe"].make_args(flavor, vocab_size, 4096, model)
    built = {key: getattr(args, key) for key in {**shape, **TT_MOE_ROUTING}}
    assert built == {**shape, **TT_MOE_ROUTING}


# TorchTitan v0.2's deepseek_v3 flavors (torchtitan/models/deepseek_v3/__init__.py): the
# shape each must become, and the RoPE it trains with at training.seq_len (YaRN x40 past 4096).
TT_DSV3 = {
    "debugmodel": (
        "debugmodel",
        {
            "dim": 256,
            "n_layers": 6,
            "n_heads": 16,
            "q_lora_rank": 0,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "dense_hidden_dim": 1024,
            "first_k_dense": 1,
            "num_experts": 8,
            "top_k": 3,
            "moe_hidden_dim": 256,
            "shared_experts": 2,
            "score_func": "softmax",
            "norm_topk": False,
            "n_groups": 1,
            "route_scale": 1.0,
            "tie_embeddings": False,
            "rope_mscale_all_dim": 0.7,
            "vocab_size": 2048,
        },
    ),
    "16B": (
        "16B",
        {
            "dim": 2048,
            "n_layers": 27,
            "n_heads": 16,
            "q_lora_rank": 0,
            "dense_hidden_dim": 10944,
            "num_experts": 64,
            "top_k": 6,
            "moe_hidden_dim": 1408,
            "shared_experts": 2,
            "score_func": "softmax",
            "norm_topk": False,
            "n_groups": 1,
            "rope_mscale_all_dim": 0.7,
            "vocab_size": 102400,
        },
    ),
    "236B": (
        "671B",
        {
            "dim": 5120,
            "n_layers": 60,
            "n_heads": 128,
            "q_lora_rank": 1536,
            "dense_hidden_dim": 12288,
            "first_k_dense": 1,
            "num_experts": 160,
            "top_k": 6,
            "moe_hidden_dim": 1536,
            "shared_experts": 2,
            "score_func": "softmax",
            "norm_topk": False,
            "n_groups": 8,
            "topk_groups": 3,
            "route_scale": 16.0,
            "rope_mscale_all_dim": 1.0,
            "vocab_size": 102400,
        },
    ),
    "671B": (
        "671B",
        {
            "dim": 7168,
            "n_layers": 61,
            "n_heads": 128,
            "first_k_dense": 3,
            "num_experts": 256,
            "top_k": 8,
            "shared_experts": 1,
            "score_func": "sigmoid",
            "norm_topk": True,
            "n_groups": 8,
            "topk_groups": 4,
            "route_scale": 2.5,
            "vocab_size": 129280,
        },
    ),
}


@pytest.mark.parametrize("seq_len", [2048, 8192])
@pytest.mark.parametrize("tt_flavor", list(TT_DSV3))
def test_deepseek_v3_flavors_convert_with_torchtitan_shape(tt_flavor: str, seq_len: int) -> None:
    flavor, shape = TT_DSV3[tt_flavor]
    text = (
        f'[model]\nname = "deepseek_v3"\nflavor = "{tt_flavor}_flex_attn"\n'
        f'hf_assets_path = "tok"\n[training]\nseq_len = {seq_len}\n'
    )
    conv = converted(text)
    assert conv.blocking == []
    model = dict(conv.config["model"])
    assert (model.pop("name"), model.pop("flavor")) == ("deepseek_v3", flavor)
    model.pop("tokenizer_path")
    args = REGISTRY["deepseek_v3"].make_args(flavor, model.pop("vocab_size"), seq_len, model)
    balancing = {"aux_loss_coef": 0.0, "bias_update_rate": 1e-3, "mtp_layers": 0}
    want = {**shape, **balancing, "rope_factor": 40.0 if seq_len > 4096 else 1.0}
    assert {key: getattr(args, key) for key in want} == want


# TorchTitan v0.2's gpt_oss flavors (torchtitan/models/gpt_oss/__init__.py and model/args.py):
# the published heads, expert width, windows of 128 on every other layer from the first, sinks,
# a biased softmax top-4 router renormalized over the chosen, its 201,088-token vocabulary, and
# TorchTitan's balancing by a routing bias moved 1e-3 a step.
TT_GPT_OSS = {
    "debugmodel": {"dim": 256, "n_layers": 4, "num_experts": 8},
    "20b": {"dim": 2880, "n_layers": 24, "num_experts": 32},
    "120b": {"dim": 2880, "n_layers": 36, "num_experts": 128},
}
TT_GPT_OSS_COMMON = {
    "n_heads": 64,
    "n_kv_heads": 8,
    "head_dim": 64,
    "top_k": 4,
    "moe_hidden_dim": 2880,
    "sliding_window": 128,
    "window_pattern": "LG",
    "attention_sinks": True,
    "rope_theta": 150000.0,
    "vocab_size": 201088,
    **TT_MOE_ROUTING,
    "norm_eps": 1e-5,
}


@pytest.mark.parametrize("flavor", list(TT_GPT_OSS))
def test_gpt_oss_flavors_convert_with_torchtitan_shape(flavor: str) -> None:
    text = f'[model]\nname = "gpt_oss"\nflavor = "{flavor}"\nhf_assets_path = "tok"\n'
    conv = converted(text)
    assert conv.blocking == [] and "model.flavor" not in dropped_keys(conv)
    model = dict(conv.config["model"])
    assert (model.pop("name"), model.pop("flavor"), model.pop("tokenizer_path")) == (
        "gpt_oss",
        flavor,
        "tok",
    )
    args = REGISTRY["gpt_oss"].make_args(flavor, model.pop("vocab_size"), 4096, model)
    expected = TT_GPT_OSS[flavor] | TT_GPT_OSS_COMMON
    assert {key: getattr(args, key) for key in expected} == expected


# Laid out like TorchTitan's qwen3_moe_debug.toml (same sections and keys, values of our own).
TT_MOE_DEBUG = """
[job]
dump_folder = "./runs/tt_moe"
description = "a small mixture of experts"

[metrics]
log_freq = 1
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "qwen3"
flavor = "debugmodel_moe"
hf_assets_path = "./assets/debug_tokenizer"

[optimizer]
name = "AdamW"
lr = 5e-4
eps = 1e-8

[training]
local_batch_size = 2
seq_len = 256
steps = 6
dataset = "c4_test"

[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1

[checkpoint]
enable = false
export_dtype = "float32"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_torchtitan_gpt_oss_debug_file_loads_as_the_gpt_oss_family(tmp_path: Path) -> None:
    """A file laid out like their gpt_oss debug_model.toml (its [model], [training] and
    [parallelism] keys, values of our own) loads as a gpt_oss config whose model builds."""
    text = TT_MOE_DEBUG.replace('name = "qwen3"', 'name = "gpt_oss"').replace(
        'flavor = "debugmodel_moe"', 'flavor = "debugmodel"'
    )
    assert converted(text).blocking == []
    source = tmp_path / "tt.toml"
    source.write_text(text)
    cfg = load_config(["--job.config_file", str(source)])
    assert (cfg.model.name, cfg.model.flavor, cfg.model.top_k) == ("gpt_oss", "debugmodel", 4)
    spec, args = build_model_args(cfg, 2000)
    shape = (args.vocab_size, args.n_heads, args.sliding_window, args.attention_sinks)
    assert spec.name == "gpt_oss" and shape == (201088, 64, 128, True)


def test_torchtitan_moe_config_runs_as_is(tmp_path: Path) -> None:
    """Their qwen3 MoE debug file loads as a qwen3_moe config whose model builds (args
    checked), the command line still winning."""
    assert converted(TT_MOE_DEBUG).blocking == []
    source = tmp_path / "tt.toml"
    source.write_text(TT_MOE_DEBUG)
    cfg = load_config(["--job.config_file", str(source), "--model.top_k", "4"])
    model = (cfg.model.name, cfg.model.flavor, cfg.model.num_experts, cfg.model.bias_update_rate)
    assert model == ("qwen3_moe", "debugmodel", 64, 1e-3)
    spec, args = build_model_args(cfg, 2000)
    assert spec.name == "qwen3_moe" and (args.vocab_size, args.n_layers, args.top_k) == (2048, 8, 4)


@pytest.mark.parametrize(
    ("name", "flavor", "key"),
    [
        ("llama4", "17bx16e", "model.name"),
        ("qwen3", "72B", "model.flavor"),
        ("llama3", "debugmodel_moe", "model.flavor"),
    ],
)
def test_refusals_list_the_registry_families(
    name: str, flavor: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = f'[model]\nname = "{name}"\nflavor = "{flavor}"\n'
    (note,) = [n for n in converted(text).blocking if n.key == key]
    assert "no MoE" not in note.advice
    assert f"families are {', '.join(REGISTRY)}" in note.advice and "qwen3_moe" in note.advice
    families = ", ".join(REGISTRY)
    monkeypatch.setitem(REGISTRY, "mamba", REGISTRY["llama3"])  # a family added later shows up
    (note,) = [n for n in converted(text).blocking if n.key == key]
    assert f"families are {families}, mamba" in note.advice
    # the docs table's rule says the same (the registry when the module loaded)
    assert f"titanlite's families are {families};" in mapping()["model.name"].note
    assert "MoE flavors block" not in mapping()["model.flavor"].note


def test_expert_parallel_degree_carries_over() -> None:
    conv = converted("[parallelism]\nexpert_parallel_degree = 2\n")
    assert conv.config["parallelism"]["expert_parallel_degree"] == 2
    assert "parallelism.expert_parallel_degree" not in blocking_keys(conv)


def test_context_parallel_degree_carries_over() -> None:
    text = (
        '[parallelism]\ncontext_parallel_degree = 4\ncontext_parallel_rotate_method = "alltoall"\n'
    )
    conv = converted(text)
    assert conv.config["parallelism"]["context_parallel_degree"] == 4
    assert "parallelism.context_parallel_degree" not in blocking_keys(conv)
    assert "parallelism.context_parallel_rotate_method" in dropped_keys(conv)


def test_pipeline_keys_carry_over_with_torchtitan_defaults() -> None:
    text = (
        "[parallelism]\npipeline_parallel_degree = 4\n"
        'pipeline_parallel_schedule = "ZBVZeroBubble"\n'
    )
    p = converted(text).config["parallelism"]
    assert (p["pipeline_parallel_degree"], p["pipeline_parallel_schedule"]) == (4, "ZBVZeroBubble")
    assert p["pipeline_parallel_first_stage_less_layers"] == 1  # TorchTitan's default
    assert p["pipeline_parallel_last_stage_less_layers"] == 1


def test_collective_timeouts_carry_over() -> None:
    """TorchTitan's two timeouts are titanlite's two (start-up and first step; after it)."""
    comm = converted("[comm]\ninit_timeout_seconds = 300\ntrain_timeout_seconds = 100\n")
    assert comm.config["comm"] == {"init_timeout_seconds": 300, "timeout_seconds": 100}
    assert not {"comm.init_timeout_seconds", "comm.train_timeout_seconds"} & dropped_keys(comm)


def test_unknown_and_unsupported_keys_are_dropped_with_advice() -> None:
    conv = converted(
        '[training]\ndtype = "bfloat16"\nbogus = 1\n[training.dataloader]\nnum_workers = 4\n'
        '[activation_checkpoint]\nmode = "memory_budget"\n'
        '[model]\nflavor = "debugmodel_flex_attn"\n'
    )
    assert conv.blocking == []
    assert {
        "training.dtype",
        "training.bogus",
        "activation_checkpoint.mode",
        "model.flavor",
    } <= dropped_keys(conv)
    assert "training.dataloader.num_workers" not in dropped_keys(conv)
    assert conv.config["model"]["flavor"] == "debugmodel"
    assert "mode" not in conv.config.get("activation_checkpoint", {})


# --- detection --------------------------------------------------------------------------------


def test_torchtitan_files_are_detected() -> None:
    assert looks_like_torchtitan(parsed(TT_DEBUG)) and looks_like_torchtitan(parsed(TT_8B))
    for marker in (
        '[model]\nhf_assets_path = "x"\n',
        "[job]\nprint_config = false\n",
        '[parallelism]\ncontext_parallel_rotate_method = "allgather"\n',
        "[quantize.linear.float8]\nfilter_fqns = []\n",
        '[training]\ndataset = "c4_test"\n',
    ):
        assert looks_like_torchtitan(parsed(marker)), marker


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_titanlite_configs_are_not_detected(path: Path) -> None:
    assert not looks_like_torchtitan(tomllib.loads(path.read_text()))


def test_titanlite_config_with_unknown_keys_is_not_detected() -> None:
    text = (REPO / "train_configs" / "debug_model.toml").read_text()
    assert not looks_like_torchtitan(parsed(text + "\n[extra]\nfoo = 1\n"))
    assert not looks_like_torchtitan(
        parsed('[training]\ndatset = "sotu"\n[model]\nflavour = "x"\n')
    )


# --- the script -------------------------------------------------------------------------------


def convert_script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def test_script_writes_a_loadable_config(tmp_path: Path) -> None:
    source, out = tmp_path / "tt.toml", tmp_path / "out.toml"
    source.write_text(TT_DEBUG)
    result = convert_script(source, out)
    assert result.returncode == 0, result.stderr
    assert "training.dataset" in result.stderr  # the report
    text = out.read_text()
    assert text.startswith(f"# Converted from the TorchTitan config {source}")
    assert '#   compile.components = ["model", "loss"]' in text
    apply_toml(JobConfig(), tomllib.loads(text), str(out))
    assert tomllib.loads(text) == convert(parsed(TT_DEBUG)).config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.toml", "tt.toml"]  # no temp file


def test_script_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    source, out = tmp_path / "tt.toml", tmp_path / "out.toml"
    source.write_text(TT_8B)
    out.write_text("# mine\n")
    result = convert_script(source, out)
    assert result.returncode == 2 and out.read_text() == "# mine\n"
    assert result.stderr.strip().splitlines()[-1].startswith("convert_torchtitan_config: error: ")
    assert "--force" in result.stderr
    assert convert_script(source, out, "--force").returncode == 0
    assert tomllib.loads(out.read_text())["model"]["flavor"] == "8B"


QUANTIZED = "[checkpoint]\ninitial_load_in_hf_quantized = true\n"
"""A setting titanlite cannot honour (it blocks a conversion)."""


@pytest.mark.parametrize("case", ["missing", "invalid", "titanlite", "blocking"])
def test_script_errors(tmp_path: Path, case: str) -> None:
    source, out = tmp_path / "in.toml", tmp_path / "out.toml"
    if case == "invalid":
        source.write_text("[model\nname = 1\n")
    elif case == "titanlite":
        source = REPO / "train_configs" / "debug_model.toml"
    elif case == "blocking":
        source.write_text(TT_8B.replace("[checkpoint]\n", QUANTIZED, 1))
    result = convert_script(source, out)
    assert result.returncode == 2
    assert not out.exists()
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_torchtitan_config: error: ")
    if case == "blocking":
        assert "blocking: checkpoint.initial_load_in_hf_quantized = true" in result.stderr
        assert "nothing written" in last
    if case != "blocking":
        assert len(result.stderr.strip().splitlines()) == 1


# --- run as is -------------------------------------------------------------------------------


def test_run_as_is_loads_the_titanlite_equivalent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """./run_train.sh their.toml: converted in memory, ignored keys logged, and the command
    line (in titanlite's names) still wins."""
    source = tmp_path / "tt.toml"
    source.write_text(TT_DEBUG)
    with caplog.at_level(logging.WARNING, logger="titanlite.config.parse"):
        cfg = load_config(["--job.config_file", str(source), "--training.steps", "3"])
    assert (cfg.model.n_layers, cfg.model.vocab_size, cfg.training.steps) == (6, 2048, 3)
    assert cfg.checkpoint.async_mode == "async" and cfg.training.dataset == "sotu"
    assert cfg.job.config_file == str(source)
    logged = caplog.text
    assert "is a TorchTitan v0.2 config" in logged and "convert_torchtitan_config.py" in logged
    assert 'compile.components = ["model", "loss"]' in logged


def test_run_as_is_refuses_what_titanlite_cannot_honour_line_by_line(tmp_path: Path) -> None:
    source = tmp_path / "tt.toml"
    text = TT_DEBUG.replace("[checkpoint]\n", QUANTIZED, 1)
    text = text.replace('# converters = ["quantize.linear.float8"]', 'converters = ["mx"]')
    source.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(["--job.config_file", str(source)])
    lines = str(info.value).split("\n")
    assert len(lines) == 3 and "cannot honour" in lines[0]
    assert any("checkpoint.initial_load_in_hf_quantized = true" in line for line in lines[1:])
    assert any("model.converters" in line for line in lines[1:])


def torchtitan_tokenizer(folder: Path) -> Path:
    """A folder laid out like TorchTitan's tests/assets/tokenizer: a byte-level BPE
    tokenizer.json (written by the tokenizers library) without the BOS, EOS and pad that its
    tokenizer_config.json names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    raw.train_from_iterator([(REPO / "README.md").read_text()], trainer)
    raw.add_special_tokens(["<|endoftext|>"])
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "special": True}
    config = {
        "added_tokens_decoder": {
            "128000": {"content": "<|begin_of_text|>", **entry},
            "128001": {"content": "<|end_of_text|>", **entry},
        },
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|pad|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_torchtitan_debug_config_trains_as_is(model: str, tmp_path: Path) -> None:
    """Their debug file, its hf_assets_path a folder like their test tokenizer, trains 2 steps
    on 2 ranks (float32 and no compile, to stay quick on a CPU): llama3 at their tp 2; their
    qwen3 MoE and deepseek_v3 debug models (the MoE file naming deepseek_v3's) with fewer,
    smaller layers and experts."""
    import train_scenarios
    from pool import get_pool

    tokenizer = torchtitan_tokenizer(tmp_path / "debug_tokenizer")
    text = TT_DEBUG if model == "llama3" else TT_MOE_DEBUG
    if model == "deepseek_v3":
        text = text.replace(
            'name = "qwen3"\nflavor = "debugmodel_moe"',
            'name = "deepseek_v3"\nflavor = "debugmodel"',
        )
    source = tmp_path / "tt.toml"
    source.write_text(text.replace("./assets/debug_tokenizer", str(tokenizer)))
    argv = [
        "--job.config_file",
        str(source),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--compile.enable",
        "false",
        "--validation.steps",
        "1",
    ]
    if model != "llama3":
        argv += [
            "--model.n_layers",
            "2",
            "--model.num_experts",
            "4",
            "--model.top_k",
            "2",
            "--model.moe_hidden_dim",
            "64",
        ]
    if model == "deepseek_v3":
        argv += [
            "--model.kv_lora_rank",
            "32",
            "--model.qk_nope_head_dim",
            "16",
            "--model.qk_rope_head_dim",
            "8",
            "--model.v_head_dim",
            "16",
        ]
    run = get_pool(2).run(train_scenarios.train, argv=argv)[0]
    losses = [r["loss"] for r in run["records"] if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert run["info"]["model_name"] == model
    if model == "llama3":
        assert run["info"]["parallel_degrees"]["tp"] == 2
        assert (tmp_path / "run" / "ckpt" / "step-2").is_dir()  # their checkpoint.folder


# --- docs -------------------------------------------------------------------------------------


def test_markdown_table_lists_every_key() -> None:
    text = mapping_table_markdown()
    assert text.startswith("## TorchTitan v0.2 configs\n")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(mapping())
    assert "| `metrics.save_tb_folder` | `metrics.tensorboard_folder` |" in text


def test_float8_converters_map_to_titanlites_float8_with_torchtitans_defaults() -> None:
    conv = converted(
        '[model]\nconverters = ["quantize.linear.float8", "quantize.grouped_mm.float8"]\n'
        "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n"
        'filter_fqns = ["output", "auto_filter_small_kn"]\n'
        '[quantize.grouped_mm.float8]\nfqns = ["experts"]\n'
    )
    assert conv.config["model"]["converters"] == ["float8"]
    assert conv.config["float8"] == {
        "recipe": "rowwise",  # the experts' recipe; TorchTitan's unset recipe is tensorwise
        "filter_fqns": ["output"],
        "auto_filter_small": True,
        "enable_fsdp_float8_all_gather": True,
        "experts": True,
    }
    older = converted('[model]\nconverters = ["float8"]\n[float8]\nemulate = true\n')
    assert older.config["float8"] == {
        "recipe": "tensorwise",
        "filter_fqns": [],
        "auto_filter_small": False,
        "emulate": True,
    }
    assert not blocking_keys(older)
