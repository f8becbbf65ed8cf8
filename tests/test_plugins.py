"""The plug-in points: the attention registry, the optimizer registry with its parameter-group
rules, the model-converter registry and the one loader interface. Each later feature adds an
entry; these tests hold the interfaces those entries rely on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import plugin_scenarios
import pytest
import torch
from pool import get_pool
from torch import nn

from titanlite import models, optim
from titanlite.checks import check
from titanlite.config import ConfigError, help_text, load_config, to_toml
from titanlite.config.catalog import Section
from titanlite.config.job_config import ParamGroupRule
from titanlite.config.planned import PlannedRun
from titanlite.data import DEFAULT_TOKENIZER_PATH, DataSpec, Loader, load_tokenizer
from titanlite.data.build import build_dataloader
from titanlite.errors import UserError
from titanlite.models.attention import REGISTRY as ATTENTION
from titanlite.models.decoder_spec import AttentionVariants
from titanlite.models.interfaces import AttentionCore
from titanlite.optim import build_optimizer, resolve_groups

SMALL = [
    "--training.steps",
    "3",
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--metrics.log_freq",
    "1",
]


# --- attention ----------------------------------------------------------------------------------


def test_every_family_builds_its_attention_core_from_the_registry() -> None:
    for name, spec in models.REGISTRY.items():
        args = spec.make_args("debugmodel", 128, 32, {"n_layers": 1})
        with torch.device("meta"):
            model = spec.build(args)
        cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
        assert cores, name
        if not isinstance(args, AttentionVariants):  # its own layers (latent, linear attention)
            assert all(type(c) in ATTENTION.values() and c.mask.causal for c in cores), name
            continue
        for i, core in enumerate(cores):  # the masked core where a window or sinks apply
            variant = args.layer_window(i) is not None or args.attention_sinks
            assert type(core) is ATTENTION["masked" if variant else args.attention], name
            assert core.mask.causal and core.mask.window == args.layer_window(i)
            assert core.mask.sink == args.attention_sinks


def test_the_causal_core_matches_sdpa_with_and_without_documents() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    core = ATTENTION["sdpa"]()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    assert torch.equal(core(q, k, v), expected)
    documents = torch.zeros(2, 16, dtype=torch.long)
    documents[:, 9:] = 1
    mask = torch.ones(16, 16, dtype=torch.bool).tril() & (
        documents[:, :, None] == documents[:, None]
    )
    blocked = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], enable_gqa=True
    )
    torch.testing.assert_close(core(q, k, v, documents), blocked)


@pytest.mark.slow
def test_context_parallelism_reads_the_cores_mask(tmp_path: Path) -> None:
    argv = [
        *SMALL,
        "--parallelism.context_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    results = get_pool(2).run(plugin_scenarios.context_parallel_reads_the_mask, argv=argv)
    assert all("context parallelism takes causal attention only" in r for r in results)
    assert all("causal=False" in r for r in results)


# --- optimizers and parameter groups ------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.output = nn.Linear(4, 10, bias=False)


GROUPS_TOML = """
[optimizer]
lr = 0.01
weight_decay = 0.1

[[optimizer.param_groups]]
params = "tok_embeddings.*, output.*"
lr_scale = 0.5
name = "embeddings"

[[optimizer.param_groups]]
dims = "vector"
weight_decay = 0.0

[[optimizer.param_groups]]
params = "*"
"""


def test_param_group_rules_from_toml_resolve_first_match_wins(tmp_path: Path) -> None:
    config = tmp_path / "groups.toml"
    config.write_text(GROUPS_TOML)
    cfg = load_config(["--job.config_file", str(config)])
    model = Tiny()
    optimizer, groups = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    assert [(g.name, g.names) for g in groups] == [
        ("embeddings", ["tok_embeddings.weight", "output.weight"]),
        ("rule 1", ["proj.bias", "norm.weight", "norm.bias"]),
        ("rule 2", ["proj.weight"]),
    ]
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.005, 0.1),
        (0.01, 0.0),
        (0.01, 0.1),
    ]
    # The same rules on the command line (a TOML inline array), and back through to_toml.
    inline = (
        '[{params = "tok_embeddings.*, output.*", lr_scale = 0.5, name = "embeddings"}, '
        '{dims = "vector", weight_decay = 0.0}, {params = "*"}]'
    )
    cli = load_config(["--optimizer.lr", "0.01", "--optimizer.param_groups", inline])
    assert cli.optimizer.param_groups == cfg.optimizer.param_groups


def test_the_default_rules_are_adamws_decay_on_matrices() -> None:
    cfg = load_config([])
    groups = resolve_groups(Tiny(), cfg.optimizer)
    assert [(g.name, g.weight_decay, len(g.params)) for g in groups] == [
        ("decay", 0.1, 3),
        ("no_decay", 0.0, 3),
    ]


def test_param_group_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            [
                "--optimizer.param_groups",
                '[{params = "*", optimizer = "adamx", lr_scale = 0}, {nme = "x"}]',
            ]
        )
    assert "unknown key in --optimizer.param_groups[1]: 'nme' (did you mean 'name'?)" in str(
        e.value
    )
    with pytest.raises(ConfigError) as e:
        load_config(
            ["--optimizer.param_groups", '[{params = "*", optimizer = "adamx", lr_scale = 0}]']
        )
    lines = str(e.value).splitlines()
    assert (
        "optimizer.param_groups[0].optimizer: 'adamx' is not one of adamw, muon "
        "(did you mean 'adamw'?)" in lines
    )
    assert "optimizer.param_groups[0].lr_scale: must be > 0, got 0.0" in lines
    cfg = load_config(["--optimizer.param_groups", '[{params = "proj.*"}]'])
    with pytest.raises(
        UserError, match=r"no rule takes parameter tok_embeddings.weight \(shape \(10, 4\)\)"
    ):
        resolve_groups(Tiny(), cfg.optimizer)


# --- converters ---------------------------------------------------------------------------------


def test_an_unknown_converter_is_a_config_error() -> None:
    expected = r"model.converters\[0\]: 'flaot8' is not one of .*float8.*did you mean 'float8'"
    with pytest.raises(ConfigError, match=expected):
        load_config(["--model.converters", "flaot8"])


@pytest.mark.slow
def test_a_registered_converter_runs_before_parallelization(tmp_path: Path) -> None:
    """A converter registered at run time replaces the blocks' linears on the meta model,
    before FSDP; the run trains through the converted modules with the losses of the plain
    model (the toy converter keeps the math) and run.json names it."""
    plain = get_pool(1).run(
        "train_scenarios:train", argv=[*SMALL, "--job.dump_folder", str(tmp_path / "plain")]
    )[0]
    got = get_pool(1).run(
        plugin_scenarios.train_with_counting_converter,
        argv=[*SMALL, "--job.dump_folder", str(tmp_path / "converted")],
    )[0]
    losses = [r["loss"] for r in got["run"]["records"] if "loss" in r]
    assert losses == [r["loss"] for r in plain["records"] if "loss" in r]
    assert got["calls"] == 3 * 2 * 7  # steps x blocks x (wq, wk, wv, wo, w1, w2, w3)
    assert got["run"]["info"]["converters"] == ["counting"]
    logs = "\n".join(get_pool(1).last_logs[0])
    assert "converter counting replaced 14 modules" in logs


# --- loaders --------------------------------------------------------------------------------------


def test_every_loader_implements_the_one_interface(tmp_path: Path) -> None:
    from titanlite.data.mixture import MixtureLoader, Part
    from titanlite.data.tokens import pretokenize

    tok = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"document {i} " + "words " * 40 for i in range(60)))
    spec = DataSpec(dataset_path=str(text), seq_len=16, local_batch_size=2, validation_fraction=0.1)
    folder = tmp_path / "tokens"
    pretokenize(spec, tok, folder, shard_tokens=500, progress=False)
    folder_spec = DataSpec(dataset_path=str(folder), seq_len=16, local_batch_size=2)
    loaders = {
        "text": build_dataloader(tok, spec, 0, 1, prefetch=False),
        "tokens": build_dataloader(tok, folder_spec, 0, 1),
        "mixture": MixtureLoader(
            tok, [Part("a", 0.5, folder_spec), Part("b", 0.5, folder_spec)], 0, 1
        ),
    }
    for kind, loader in loaders.items():
        assert isinstance(loader, Loader), kind
        inputs, labels = next(iter(loader))
        assert inputs.shape == labels.shape == (2, 16)
        state = json.loads(json.dumps({k: v for k, v in loader.state_dict().items()}))
        line = loader.describe()
        assert "\n" not in line and line, kind
        loader.load_state_dict(state)
        loader.close()
    assert "text" in loaders["text"].describe() and "2 windows" in loaders["text"].describe()
    assert "data mixture after 2 windows" in loaders["mixture"].describe()


@dataclass
class ToySettings:
    strength: float = 1.0
    """How hard the toy optimizer pushes."""


def toy_refuses(run: PlannedRun) -> list[str]:
    return ["toy: a strength above 5 is refused"] if run.cfg.toy.strength > 5 else []


def test_a_component_with_settings_is_its_own_module_and_one_registry_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An optimizer with its own [toy] section and rule, registered by one entry: the section
    parses from the command line, --help lists it with its doc, config.toml writes it, and
    its rule runs before launch; titanlite/config/ knows nothing of it."""
    with pytest.raises(ConfigError, match="unknown option '--toy.strength'"):
        load_config(["--toy.strength", "7"])
    entry = optim.OptimizerEntry(
        module="titanlite.optim.adamw",
        default_rules=(ParamGroupRule(),),
        section=Section("toy", ToySettings, after="optimizer"),
        refuses=toy_refuses,
    )
    monkeypatch.setitem(optim.REGISTRY, "toy", entry)
    cfg = load_config(["--optimizer.name", "toy", "--toy.strength", "7"])
    assert cfg.toy == ToySettings(strength=7.0) and cfg.components["toy"] is cfg.toy
    assert "[toy]" in help_text() and "How hard the toy optimizer pushes." in help_text()
    assert "[optimizer]" in to_toml(cfg) and "[toy]\nstrength = 7.0\n" in to_toml(cfg)
    with pytest.raises(ConfigError, match="toy: a strength above 5 is refused"):
        check(cfg, 1)
    check(load_config(["--optimizer.name", "toy"]), 1)  # the default strength passes
