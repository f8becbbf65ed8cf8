"""The Qwen3 family: published shapes and sizes, q/k norms, rotate-half RoPE, and a round trip
through transformers' Qwen3ForCausalLM with equal logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from titanlite.interop.checkpoint_model import load_checkpoint_model
from titanlite.models import get
from titanlite.models.decoder import Decoder
from titanlite.models.init import init_parameters
from titanlite.models.layers import apply_rope_halves, count_params, rope_tables
from titanlite.models.qwen3.args import QWEN3_VOCAB, Qwen3Args
from titanlite.models.qwen3.hf import from_hf_config, to_hf_config

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402

QWEN3 = get("qwen3")
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")


def tiny_args(**changes: object) -> Qwen3Args:
    base: dict = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        hidden_dim=96,
        vocab_size=4096,
        max_seq_len=128,
        tie_embeddings=True,
    )
    return Qwen3Args(**(base | changes))


def tiny_model(args: Qwen3Args, seed: int = 0) -> Decoder:
    model = Decoder(args)
    init_parameters(model, lambda name: QWEN3.init_rule(args, name), seed)
    with torch.no_grad():  # sharper attention and visible norms, so mistakes show in logits
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(torch.linspace(0.5, 3.0, p.numel()))
            elif name.endswith(("wq.weight", "wk.weight")):
                p.mul_(20)
    return model


# Published totals and non-embedding counts (Qwen3 model cards, in billions, as rounded there).
PUBLISHED = {
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    args = QWEN3.make_args(flavor, QWEN3_VOCAB, 4096, {})
    with torch.device("meta"):
        model = Decoder(args)
    total = count_params(model)
    # Non-embedding excludes the embedding and, when untied, the output projection too.
    embedding = QWEN3_VOCAB * args.dim * (1 if args.tie_embeddings else 2)
    total_b, non_embedding_b = PUBLISHED[flavor]
    digits = len(str(non_embedding_b).split(".")[1])
    assert round((total - embedding) / 1e9, digits) == non_embedding_b
    assert round(total / 1e9, 1) == total_b
    # Small sizes tie the output projection to the embedding, larger ones do not.
    assert args.tie_embeddings is (flavor in ("0.6B", "1.7B", "4B"))


def test_qwen3_8b_layer_shapes() -> None:
    args = QWEN3.make_args("8B", QWEN3_VOCAB, 4096, {})
    with torch.device("meta"):
        block = Decoder(args).layers["0"]
    attention = block.attention
    assert attention.wq.weight.shape == (32 * 128, 4096)
    assert attention.wk.weight.shape == (8 * 128, 4096)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (128,)
    assert block.feed_forward.w1.weight.shape == (12288, 4096)


def test_head_dim_independent_of_dim_and_qk_norm_matters() -> None:
    args = tiny_args()  # 4 heads x 24 = 96 != dim 64
    model = tiny_model(args)
    x = torch.randint(0, 4096, (2, 10))
    with torch.no_grad():
        before = model(x)
        model.layers["0"].attention.q_norm.weight.mul_(3)
        assert not torch.allclose(before, model(x), atol=1e-3)


def test_rope_halves_rotates_first_and_second_halves() -> None:
    table = rope_tables(8, 6, 10000.0)
    x = torch.randn(1, 6, 2, 8)
    rotated = apply_rope_halves(x, table)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])
    # Pair (x_0, x_4) turns by one radian per position, as HF's rotate_half does.
    cos, sin = torch.cos(torch.tensor(3.0)), torch.sin(torch.tensor(3.0))
    torch.testing.assert_close(rotated[0, 3, :, 0], x[0, 3, :, 0] * cos - x[0, 3, :, 4] * sin)


def test_unknown_override_names_the_family() -> None:
    with pytest.raises(ValueError, match="multiple_of does not apply to qwen3"):
        QWEN3.make_args("debugmodel", 4096, 64, {"multiple_of": 64})


def test_config_round_trip() -> None:
    args = tiny_args(tie_embeddings=False)
    assert from_hf_config(to_hf_config(args)) == args


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False])
def test_export_import_through_transformers_gives_equal_logits(tmp_path: Path, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny_model(tiny_args(tie_embeddings=tie), seed=1)
    ckpt = write_checkpoint(tmp_path / "step-3", model, step=3, model_name="qwen3")
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 24
    hf = transformers.Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
    scale = max(ours.abs().max().item(), 1.0)
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale
    # Back into titanlite: the same function again.
    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back")
    assert back.spec.name == "qwen3" and back.args == model.args
    with torch.no_grad():
        assert torch.equal(back.model(x), ours)


@pytest.mark.slow
def test_trained_checkpoint_exports_to_transformers(tmp_path: Path) -> None:
    """A checkpoint the trainer wrote (sidecar names the family) exports to a folder that
    Qwen3ForCausalLM loads with the logits of the trained weights."""
    transformers = pytest.importorskip("transformers")
    import train_scenarios
    from pool import get_pool

    run = tmp_path / "run"
    argv = [
        "--model.name",
        "qwen3",
        "--model.n_layers",
        "2",
        "--training.steps",
        "3",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--validation.enable",
        "false",
        "--job.dump_folder",
        str(run),
    ]
    get_pool(1).run(train_scenarios.train, argv=argv)
    ckpt = run / "checkpoint" / "step-3"
    assert json.loads((ckpt / "titanlite.json").read_text())["model_name"] == "qwen3"
    assert convert_to_hf.main([str(ckpt), str(tmp_path / "hf")]) == 0
    trained = load_checkpoint_model(ckpt)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    x = torch.randint(4, 4096, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = trained.model(x), hf.eval()(x).logits.float()
    assert (ours - theirs).abs().max().item() <= 1e-5 * max(ours.abs().max().item(), 1.0)
