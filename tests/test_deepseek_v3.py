"""The DeepSeek-V3 family: latent attention (its core, YaRN), published sizes, and a round
trip through transformers' DeepseekV3ForCausalLM with equal logits."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from titanlite.models import get
from titanlite.models.attention import LatentCore
from titanlite.models.decoder import Decoder
from titanlite.models.deepseek_v3.args import DeepseekV3Args
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params

REPO = Path(__file__).resolve().parent.parent
SPEC = get("deepseek_v3")
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_args(**changes: object) -> DeepseekV3Args:
    base: dict = dict(
        dim=48, n_layers=3, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, dense_hidden_dim=40, first_k_dense=1,
        num_experts=8, top_k=3, moe_hidden_dim=12, shared_experts=1, n_groups=4,
        topk_groups=2, route_scale=2.5, vocab_size=512, max_seq_len=64,
    )  # fmt: skip
    return DeepseekV3Args(**(base | changes))


def tiny_model(args: DeepseekV3Args, seed: int = 0) -> Decoder:
    model = Decoder(args)
    init_parameters(model, lambda name: SPEC.init_rule(args, name), seed)
    model.init_buffers()
    with torch.no_grad():  # a decisive router and visible norms, so mistakes show in logits
        for name, p in model.named_parameters():
            if "router" in name:
                p.mul_(40)
            elif name.endswith("norm.weight"):
                p.copy_(torch.linspace(0.5, 2.0, p.numel()))
            elif ".attention.w" in name:
                p.mul_(5)
        for block in list(model.layers.values())[args.first_k_dense :]:
            block.feed_forward.expert_bias.copy_(torch.linspace(-0.05, 0.05, args.num_experts))
    return model


def test_latent_core_is_softmax_attention_with_its_scale_and_value_size() -> None:
    """Queries/keys of 12, values of 6: the core's output is softmax(q k^T x scale) v under a
    causal mask, and with documents each document attends on its own."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 10, 12, generator=g), torch.randn(2, 3, 10, 12, generator=g)
    v = torch.randn(2, 3, 10, 6, generator=g)
    core = LatentCore()
    core.softmax_scale = 0.7 / math.sqrt(12)
    logits = (q @ k.transpose(-1, -2)) * core.softmax_scale
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    want = logits.masked_fill(~causal, -math.inf).softmax(-1) @ v
    torch.testing.assert_close(core(q, k, v), want, atol=1e-5, rtol=1e-5)
    documents = torch.tensor([[0] * 4 + [1] * 6] * 2)
    split = torch.cat([core(q[:, :, :4], k[:, :, :4], v[:, :, :4]),
                       core(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])], dim=2)  # fmt: skip
    torch.testing.assert_close(core(q, k, v, documents), split, atol=1e-5, rtol=1e-5)


# Published totals in billions (DeepSeek-V2 paper for V2-Lite, DeepSeek-V3's model card without
# its 14 B MTP module, Kimi K2's technical report) and how close the shapes come: Kimi's 1.04 T
# is 1.3% above its config.json's shapes (docs/models.md).
PUBLISHED = {
    "16B": (102400, 15.7, 0.005),
    "671B": (129280, 671.0, 0.005),
    "kimi_k2": (163840, 1040.0, 0.015),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    vocab, total_b, within = PUBLISHED[flavor]
    args = SPEC.make_args(flavor, vocab, 4096, {})
    with torch.device("meta"):
        total = count_params(SPEC.build(args))
    assert abs(total / 1e9 - total_b) / total_b < within, total
    active = SPEC.active_params(args, total)
    assert SPEC.flops_per_token(args, 1) < 6.2 * active < 0.3 * 6 * total


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [{}, {"q_lora_rank": 0, "rope_factor": 4.0, "rope_original_seq_len": 16,
          "rope_mscale": 1.0, "rope_mscale_all_dim": 0.7, "tie_embeddings": True}],
    ids=["low-rank-q", "full-q-yarn-tied"],
)  # fmt: skip
def test_export_to_transformers_gives_equal_logits_and_imports_back(
    tmp_path: Path, changes: dict
) -> None:
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf
    import convert_to_hf

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    args = tiny_args(vocab_size=4096, **changes)
    model = tiny_model(args, seed=1)
    ckpt = write_checkpoint(tmp_path / "step-3", model)
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
    scale = max(ours.abs().max().item(), 1.0)
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale
    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back")
    assert back.spec.name == "deepseek_v3" and back.args == model.args
    with torch.no_grad():
        assert torch.equal(back.model(x), ours)


def write_checkpoint(folder: Path, model: Decoder) -> Path:
    """A model-only titanlite checkpoint of ``model`` (what the trainer's final save writes)."""
    import torch.distributed.checkpoint as dcp

    from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder))
    sidecar = {
        "format": 2, "step": 3, "model_only": True, "model_name": "deepseek_v3",
        "model_args": dataclasses.asdict(model.args), "tokenizer": str(DEFAULT_TOKENIZER_PATH),
    }  # fmt: skip
    (folder / "titanlite.json").write_text(json.dumps(sidecar))
    return folder


# --------------------------------------------------------------------------- training
DSV3_ARGS = [
    "--model.name", "deepseek_v3", "--model.n_layers", "2", "--model.q_lora_rank", "32",
    "--training.steps", "8", "--training.seq_len", "32", "--metrics.log_freq", "1",
    "--validation.enable", "false", "--checkpoint.enable", "false",
    "--model.aux_loss_coef", "0.01", "--model.bias_update_rate", "0.001",
]  # fmt: skip


def train(world: int, out: Path, local_batch: int, *args: str) -> dict:
    import train_scenarios
    from pool import get_pool

    argv = [*DSV3_ARGS, "--training.local_batch_size", str(local_batch),
            "--job.dump_folder", str(out), *args]  # fmt: skip
    return get_pool(world).run(train_scenarios.train, argv=argv)[0]


def by_step(run: dict, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run["records"] if key in r}


@pytest.mark.slow
def test_tensor_and_expert_parallel_layouts_match_one_process(tmp_path: Path) -> None:
    """deepseek_v3 debug (2 blocks: dense, then 8 experts in 4 groups; low-rank query), fp32,
    aux loss and bias update on: dp_shard 2 x tp 2 (latent attention split by heads) and
    ep 2 x dp_shard 2 against one process with the same global batch of 4, 8 steps: relative
    loss and gradient-norm differences <= 1e-5."""
    one = train(1, tmp_path / "one", 4)
    base, base_norm = by_step(one, "loss"), by_step(one, "grad_norm")
    assert sorted(base) == list(range(1, 9)) and base[8] < base[1]
    worst = {}
    layouts = (("dp2_tp2", 2, ("--parallelism.tensor_parallel_degree", "2")),
               ("ep2_dp2", 1, ("--parallelism.expert_parallel_degree", "2")))  # fmt: skip
    for name, local_batch, extra in layouts:
        run = train(4, tmp_path / name, local_batch, *extra)
        loss, norm = by_step(run, "loss"), by_step(run, "grad_norm")
        worst[name] = max(abs(loss[s] - base[s]) / base[s] for s in base)
        worst[f"{name}_grad_norm"] = max(abs(norm[s] - base_norm[s]) / base_norm[s] for s in base)
    print(f"deepseek_v3 parity, worst relative differences: {worst}")
    assert all(v <= 1e-5 for v in worst.values()), worst
