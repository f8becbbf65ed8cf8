"""The Qwen3.5 family: the Gated DeltaNet and gated-attention layers, published sizes, and a
round trip through transformers' Qwen3_5ForCausalLM with equal logits."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_scenarios
from checkpoints import write_checkpoint
from pool import get_pool

from titanlite.errors import UserError
from titanlite.interop.checkpoint_model import load_checkpoint_model
from titanlite.models import get
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params
from titanlite.models.qwen3_5.args import QWEN35_VOCAB, Qwen35Args
from titanlite.models.qwen3_5.model import HybridDecoder, ShortConv
from titanlite.models.qwen3_5_moe.args import Qwen35MoeArgs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402

QWEN35 = get("qwen3_5")
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")


def tiny_args(family: str = "qwen3_5", **changes: object) -> Qwen35Args:
    base: dict = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=96,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_dim=8,
        linear_v_dim=12,
        chunk_size=8,
        vocab_size=4096,
        max_seq_len=128,
        tie_embeddings=True,
        rope_theta=10_000.0,
    )
    if family == "qwen3_5_moe":  # 8 experts of width 32, top-2, a gated shared expert
        base |= dict(hidden_dim=0, num_experts=8, top_k=2, moe_hidden_dim=32)
    return get(family).args_cls(**(base | changes))


def tiny_model(args: Qwen35Args, seed: int = 0) -> HybridDecoder:
    model = HybridDecoder(args)
    spec = get("qwen3_5_moe" if isinstance(args, Qwen35MoeArgs) else "qwen3_5")
    init_parameters(model, lambda name: spec.init_rule(args, name), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every norm, decay and gate visibly off its start: mistakes show
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "shared_gate.weight")):
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
            elif name.endswith(("wq.weight", "wk.weight")):
                p.mul_(20)
    return model


# Published totals, in billions, from the model names (Qwen3.5 model cards).
PUBLISHED = {"27B": 27.0}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    args = QWEN35.make_args(flavor, QWEN35_VOCAB, 4096, {})
    with torch.device("meta"):
        total = count_params(QWEN35.build(args))
    assert abs(total / 1e9 - PUBLISHED[flavor]) <= 0.005 * PUBLISHED[flavor], total
    assert [args.is_full_attention(i) for i in range(8)] == [False, False, False, True] * 2


# The text_config of the published config.json files (Qwen/Qwen3.5-35B-A3B, -397B-A17B),
# and the vision encoder's output width (the encoder itself titanlite does not build).
MOE_CONFIGS = {
    "35B-A3B": dict(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "397B-A17B": dict(
        hidden_size=4096,
        num_hidden_layers=60,
        num_attention_heads=32,
        linear_num_value_heads=64,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
    ),
}
# The model cards: "35B in total and 3B activated", "397B in total and 17B activated".
MOE_CARDS = {"35B-A3B": (35.0, 3), "397B-A17B": (397.0, 17)}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", sorted(MOE_CONFIGS))
def test_moe_parameter_counts_equal_transformers_and_the_model_cards(flavor: str) -> None:
    """Total parameters equal transformers' Qwen3_5MoeForCausalLM of the published config;
    with the vision encoder the cards also count, within 0.5% of the card's total. The
    cards round the active count to whole billions."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

    spec = get("qwen3_5_moe")
    args = spec.make_args(flavor, QWEN35_VOCAB, 4096, {})
    common = dict(
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        vocab_size=QWEN35_VOCAB,
        tie_word_embeddings=False,
    )
    text = transformers.Qwen3_5MoeTextConfig(**common, **MOE_CONFIGS[flavor])
    vision = transformers.Qwen3_5MoeVisionConfig(out_hidden_size=text.hidden_size)
    with torch.device("meta"):
        total = count_params(spec.build(args))
        theirs = count_params(transformers.Qwen3_5MoeForCausalLM(text))
        encoder = count_params(hf_moe.Qwen3_5MoeVisionModel._from_config(vision))
    assert total == theirs
    card_total, card_active = MOE_CARDS[flavor]
    assert abs((total + encoder) / 1e9 - card_total) <= 0.005 * card_total, total + encoder
    active = spec.active_params(args, total)
    assert round(active / 1e9) == card_active, active
    experts = args.n_layers * args.num_experts * 3 * args.dim * args.moe_hidden_dim
    assert active == total - experts * (args.num_experts - args.top_k) // args.num_experts


def test_decays_start_spread_per_head_as_published() -> None:
    """A in (0, 16) and dt in [0.001, 0.1] (softplus of dt_bias with a = 0), different in
    every head and layer, rather than one constant everywhere."""
    args = tiny_args(linear_v_heads=16, linear_k_heads=4)
    model = HybridDecoder(args)
    init_parameters(model, lambda name: QWEN35.init_rule(args, name), 0)
    decays = [
        layer.linear_attn.decay for layer in model.layers.values() if hasattr(layer, "linear_attn")
    ]
    a = torch.stack([d.A_log.detach() for d in decays]).exp()
    dt = torch.nn.functional.softplus(torch.stack([d.dt_bias.detach() for d in decays]))
    assert 0 < a.min() and a.max() < 16 and a.flatten().unique().numel() == a.numel()
    assert 0.001 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.flatten().unique().numel() == dt.numel()


def test_convolution_restarts_at_documents() -> None:
    """A tap never reaches into the document before; within one document the taps equal a
    causal depthwise convolution."""
    conv = ShortConv({"x": 6}, 4)
    torch.nn.init.normal_(conv.x)
    x = torch.randn(1, 10, 6)
    documents = torch.tensor([[0] * 4 + [1] * 6])
    reference = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), conv.x.unsqueeze(1), groups=6
    )
    whole = conv("x", x)
    torch.testing.assert_close(whole, torch.nn.functional.silu(reference.transpose(1, 2)))
    split = conv("x", x, documents)
    torch.testing.assert_close(split[:, 4:], conv("x", x[:, 4:]))
    torch.testing.assert_close(split[:, :4], whole[:, :4])


def test_documents_are_independent() -> None:
    """With document ids, a document's logits are those of the model run on it alone (the
    DeltaNet state, the convolution and attention all restart)."""
    model = tiny_model(tiny_args())
    x = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(3))
    documents = torch.tensor([[0] * 7 + [1] * 13])
    positions = torch.cat([torch.arange(7), torch.arange(13)])
    with torch.no_grad():
        packed = model(x, positions=positions, documents=documents)
        alone = model(x[:, 7:])
    torch.testing.assert_close(packed[:, 7:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_config_round_trip(family: str) -> None:
    args = tiny_args(family, tie_embeddings=False)
    adapter = get(family).hf_adapter()
    assert adapter.from_hf_config(adapter.to_hf_config(args)) == dataclasses.replace(
        args, chunk_size=64
    )


def test_moe_import_takes_the_fused_expert_layout_and_names_strays() -> None:
    """transformers 5 keeps (and some folders store) each block's experts fused:
    gate_up_proj [experts, 2 x hidden, dim] and down_proj [experts, dim, hidden]; the import
    reads them as the per-expert matrices an export writes. A tensor no block has is named."""
    args = tiny_args("qwen3_5_moe", tie_embeddings=False)
    adapter = get("qwen3_5_moe").hf_adapter()
    state = tiny_model(args).state_dict()
    hf = adapter.to_hf_state_dict(state, args)
    for layer in range(args.n_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        per = {
            p: torch.stack([hf.pop(f"{prefix}{e}.{p}.weight") for e in range(8)])
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        hf[prefix + "gate_up_proj"] = torch.cat([per["gate_proj"], per["up_proj"]], dim=1)
        hf[prefix + "down_proj"] = per["down_proj"]
    back = adapter.from_hf_state_dict(hf, args)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    hf["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        UserError, match="unexpected tensors for a Qwen3.5-MoE model: model.layers.0.mlp.extra"
    ):
        adapter.from_hf_state_dict(hf, args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "hf_class"),
    [("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")],
)
def test_export_import_through_transformers_gives_equal_logits(
    tmp_path: Path, family: str, hf_class: str
) -> None:
    """The MoE flavor also routes the same experts: its router is sharpened so that top-2
    choices are clear, and logits then differ only by float rounding."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model(tiny_args(family, tie_embeddings=False), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(50)
    ckpt = write_checkpoint(tmp_path / "step-3", model, step=3, model_name=family)
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    hf = getattr(transformers, hf_class).from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 4096, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
    scale = ours.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale
    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back")
    assert back.spec.name == family
    with torch.no_grad():
        assert torch.equal(back.model(x), ours)


# The parity model: both layer kinds, heads divisible by 2 for TP; the DeltaNet's rule
# chunks (16 tokens) longer than a cp 4 rank's chunks of the 64-token sequence (8).
PARITY_MODEL = (
    "--model.name",
    "qwen3_5",
    "--model.dim",
    "64",
    "--model.n_layers",
    "4",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.head_dim",
    "16",
    "--model.hidden_dim",
    "96",
    "--model.linear_k_heads",
    "2",
    "--model.linear_v_heads",
    "4",
    "--model.linear_k_dim",
    "8",
    "--model.linear_v_dim",
    "8",
    "--model.chunk_size",
    "16",
)


# The MoE flavor's parity model: the same blocks with 4 experts (top-2) and a gated shared
# expert each, so that ep 2 puts two experts on each rank.
PARITY_MOE_MODEL = (
    *PARITY_MODEL[: PARITY_MODEL.index("--model.hidden_dim")],
    *PARITY_MODEL[PARITY_MODEL.index("--model.hidden_dim") + 2 :],
    "--model.name",
    "qwen3_5_moe",
    "--model.num_experts",
    "4",
    "--model.top_k",
    "2",
    "--model.moe_hidden_dim",
    "32",
)


def parity_run(
    tmp_path_factory: pytest.TempPathFactory,
    layout: Any,
    *,
    pp: int = 1,
    extra: tuple = (),
    model: tuple = PARITY_MODEL,
) -> tuple[dict, str]:
    """Curves (loss, grad norm per step) and rank 0's log of ``model`` on ``layout`` (with
    ``pp`` pipeline stages, one sequence per micro-batch)."""
    from test_parity import COMMON, METRICS, STEPS

    folder = tmp_path_factory.mktemp("qwen3_5")
    argv = [*model, *COMMON, "--job.dump_folder", str(folder), *layout.args(), *extra]
    if pp > 1:
        argv += [
            "--parallelism.pipeline_parallel_degree",
            str(pp),
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ]
    pool = get_pool(layout.ngpu * pp)
    run = pool.run(train_scenarios.train, argv=argv)[0]
    assert [r["step"] for r in run["records"]] == list(range(1, STEPS + 1))
    curves = {m: [float(r[m]) for r in run["records"]] for m in METRICS}
    return curves, "\n".join(pool.last_logs[0])


@pytest.fixture(scope="module")
def parity_baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from test_parity import STEPS, Layout

    curves, _ = parity_run(tmp_path_factory, Layout())
    assert len(set(curves["loss"])) == STEPS
    return curves


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shard=2,tp=2", "cp=4", "cp=2,tp=2", "pp=2"])
def test_parallel_layout_matches_one_process(
    layout: str, parity_baseline: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each layout trains like one process (fp32, 10 steps). dp_shard 2 x tp 2: both layer
    kinds split by heads, the DeltaNet convolution and decays by channel (the TP plan's
    "channels"). cp 4 and cp 2 x tp 2 (cp 2 alone: the document-mask test below): full
    attention gathers keys and values; the DeltaNet layers get each chunk's starting state and
    convolution lead-in from the chunks before it. pp 2: two
    stages of two blocks (linear, linear; linear, full) and tied embeddings."""
    from test_parity import MEASURED, Layout, assert_parity

    degrees = {k: int(v) for k, v in (part.split("=") for part in layout.split(","))}
    pp = degrees.pop("pp", 1)
    parallel = Layout(**degrees)
    curves, output = parity_run(tmp_path_factory, parallel, pp=pp)
    assert_parity(f"qwen3_5 {layout}", parity_baseline, curves)
    print(f"qwen3_5 {layout}: max relative difference {MEASURED[f'qwen3_5 {layout}']}")
    if parallel.cp > 1:
        assert "linear-attention layers gather each chunk's state transition" in output


@pytest.mark.slow
def test_document_mask_under_context_parallelism_matches_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """training.document_mask on cp 2 (fp32, 10 steps, windows of several short documents):
    the DeltaNet state and convolution restart at documents that begin in another rank's
    chunk, as in one process."""
    from test_context import short_documents
    from test_parity import MEASURED, Layout, assert_parity

    data = short_documents(tmp_path_factory.mktemp("docs") / "docs.jsonl")
    extra = ("--training.document_mask", "true", "--training.dataset_path", str(data))
    one, _ = parity_run(tmp_path_factory, Layout(), extra=extra)
    cp2, _ = parity_run(tmp_path_factory, Layout(cp=2), extra=extra)
    assert_parity("qwen3_5 cp=2 document mask", one, cp2)
    print(f"qwen3_5 cp=2 document mask: {MEASURED['qwen3_5 cp=2 document mask']}")


@pytest.mark.slow
def test_moe_flavor_at_ep_2_matches_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """qwen3_5_moe (fp32, 10 steps, aux loss on): expert parallelism 2 within dp_shard 2, each
    rank holding 2 of the 4 experts of every block, trains like one process."""
    from test_parity import MEASURED, Layout, assert_parity

    one, _ = parity_run(tmp_path_factory, Layout(), model=PARITY_MOE_MODEL)
    ep = ("--parallelism.expert_parallel_degree", "2")
    ep2, output = parity_run(tmp_path_factory, Layout(shard=2), extra=ep, model=PARITY_MOE_MODEL)
    assert "the experts of 4 layers split over ep=2 ranks" in output
    assert_parity("qwen3_5_moe ep=2", one, ep2)
    print(f"qwen3_5_moe ep=2: max relative difference {MEASURED['qwen3_5_moe ep=2']}")
