"""PEFT adapter export (scripts/convert_to_hf.py --peft-adapter): an HF folder (made by
transformers) -> LoRA training from it -> adapters-only checkpoint -> a PEFT adapter folder
that ``peft.PeftModel.from_pretrained`` puts on transformers' model of the base, which then
computes titanlite's LoRA model's logits. Llama's q/k rows are permuted on the way (RoPE
halves), Qwen3's are not; bad input is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

# Looked up, not imported: importing peft (and transformers' models with it) at collection
# cost every pytest worker about 1.5 s, in every run, the fast subset's included.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("transformers", "peft")),
    reason="needs transformers and peft",
)

RANK, ALPHA = 4, 12.0  # scale 3, not the default's
# llama3: every default target, so PEFT's target_modules are the paths within a layer;
# qwen3: some linears of some layers, so they are full module paths.
TARGETS = {"llama3": None, "qwen3": "attention.wq,attention.wk,layers.1.feed_forward.w2"}


def _qwen3_folder(out: Path) -> Path:
    """A tiny Qwen3 model built by transformers (random weights, none zero) and a tokenizer."""
    import hf_families
    import transformers

    config = transformers.Qwen3Config(
        **hf_families.COMMON,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    shutil.copy(hf_families.TOKENIZER, out / "tokenizer.model")
    return out


def _convert(argv: list[str]) -> int:
    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import convert_to_hf

    return convert_to_hf.main(argv)


def _titanlite_logits(base: Path, step: Path, targets: str | None, tokens: torch.Tensor):
    """titanlite's model of the base folder with the checkpoint's adapters."""
    import dataclasses

    from titanlite.converters.lora import convert
    from titanlite.converters.lora_settings import LoraSettings
    from titanlite.interop.hf import load_hf
    from titanlite.interop.lora_merge import read_adapters

    state, spec, args = load_hf(base)
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(args, tie_embeddings=False))
    settings = LoraSettings(rank=RANK, alpha=ALPHA)
    if targets:
        settings.target_modules = targets.split(",")
    convert(model, spec, settings)
    model.to_empty(device="cpu")
    spec.init_buffers(model)
    adapters = read_adapters(step)
    assert all(bool(t.abs().sum()) for t in adapters.values())  # trained: B moved off zero
    model.load_state_dict({**state, **adapters})
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TARGETS))
def test_peft_loads_the_adapters_onto_the_base_and_computes_titanlites_logits(
    tmp_path: Path, family: str
) -> None:
    import hf_families
    import hf_scenarios
    from peft import PeftModel
    from pool import get_pool

    base = tmp_path / "base"
    if family == "llama3":
        hf_families.write_folder("llama3", base)
    else:
        _qwen3_folder(base)
    config = hf_scenarios.config_file(tmp_path / "run", steps=2, local=4)
    argv = ["--job.config_file", str(config), "--checkpoint.initial_load_path", str(base)]
    argv += ["--model.converters", "lora", "--lora.rank", str(RANK), "--lora.alpha", str(ALPHA)]
    argv += ["--optimizer.lr", "2e-2"]
    if TARGETS[family]:
        argv += ["--lora.target_modules", TARGETS[family]]
    get_pool(1).run(hf_scenarios.train, argv=argv)
    step = tmp_path / "run" / "run" / "checkpoint" / "step-2"
    out = tmp_path / "peft"
    assert _convert([str(step), str(out), "--peft-adapter"]) == 0
    assert _convert([str(step), str(out), "--peft-adapter"]) == 0  # replaces its own export

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and not config["use_rslora"]
    assert config["lora_alpha"] == ALPHA and config["base_model_name_or_path"] == str(
        base.resolve()
    )
    if family == "llama3":
        assert config["target_modules"] == [
            *(f"mlp.{p}_proj" for p in ("down", "gate", "up")),
            *(f"self_attn.{p}_proj" for p in "koqv"),
        ]
    else:
        assert config["target_modules"] == [
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.mlp.down_proj",
            "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.q_proj",
        ]

    tokens = torch.randint(
        0, hf_families.VOCAB, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    ours = _titanlite_logits(base, step, TARGETS[family], tokens)
    hf_model = hf_families.load(base)
    with torch.no_grad():
        before = hf_model(tokens).logits
        peft_model = PeftModel.from_pretrained(hf_model, out).eval()
        theirs = peft_model(tokens).logits
    adapted = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A.default")]
    assert len(adapted) == (14 if family == "llama3" else 5)
    worst = float((ours - theirs).abs().max() / ours.abs().max())
    print(f"\n{family} PEFT adapter: transformers + peft vs titanlite logits, {worst:.2e} relative")
    assert worst <= 1e-5
    assert float((before - theirs).abs().max() / ours.abs().max()) > 1e-3  # adapters count


def test_a_checkpoint_without_adapters_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    from titanlite.interop.checkpoint_model import save_model_checkpoint
    from titanlite.models import get

    spec = get("llama3")
    args = spec.make_args("debugmodel", 256, 64, {})
    model = spec.build(args)
    folder = save_model_checkpoint(model.state_dict(), spec, args, tmp_path / "full")
    out = tmp_path / "peft"
    for extra in ([], ["--merge-lora"]):
        assert _convert([str(folder), str(out), "--peft-adapter", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ")
        assert "Error" not in err and "Traceback" not in err
        assert ("drop --merge-lora" if extra else "holds no LoRA adapters") in err, err
    assert not out.exists()


def test_a_linear_hf_fuses_or_a_router_is_refused_in_one_line() -> None:
    """Qwen3.5 fuses the query with its gate into q_proj; a mixture's router is no linear
    in transformers: no single HF linear for the adapters, refused. Llama's wq is found,
    its rows in HF's RoPE order."""
    from titanlite.errors import UserError
    from titanlite.interop.peft_export import hf_linear
    from titanlite.models import get
    from titanlite.models.llama.hf import interleaved_to_halves

    def find(family: str, module: str):
        spec = get(family)
        args = spec.make_args("debugmodel", 256, 64, {})
        with torch.device("meta"):
            context = spec.build(args).state_dict()
        return hf_linear(spec.hf_adapter(), args, context, module), args

    found, args = find("llama3", "layers.1.attention.wq")
    assert found.name == "model.layers.1.self_attn.q_proj"
    rows = torch.arange(args.dim, dtype=torch.float32)[:, None]
    assert torch.equal(found.rows, interleaved_to_halves(rows, args.n_heads)[:, 0].long())
    assert torch.equal(found.cols, torch.arange(args.dim))
    refused = {"qwen3_5": "layers.3.attention.wq", "qwen3_moe": "layers.0.feed_forward.router"}
    for family, module in refused.items():
        with pytest.raises(UserError) as e:
            find(family, module)
        assert "\n" not in str(e.value) and "--merge-lora" in str(e.value)
