"""The DeepSeek-V3 family: latent attention (its core, YaRN), published sizes, multi-token
prediction (its targets and loss), and a round trip through transformers'
DeepseekV3ForCausalLM with equal logits (MTP weights where the published checkpoints keep
them)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from titanlite.models import get
from titanlite.models.attention import LatentCore
from titanlite.models.decoder import Decoder
from titanlite.models.deepseek_v3.args import DeepseekV3Args
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params

REPO = Path(__file__).resolve().parent.parent
SPEC = get("deepseek_v3")


def tiny_args(**changes: object) -> DeepseekV3Args:
    base: dict = dict(
        dim=48,
        n_layers=3,
        n_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        dense_hidden_dim=40,
        first_k_dense=1,
        num_experts=8,
        top_k=3,
        moe_hidden_dim=12,
        shared_experts=1,
        n_groups=4,
        topk_groups=2,
        route_scale=2.5,
        vocab_size=512,
        max_seq_len=64,
    )
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
    split = torch.cat(
        [core(q[:, :, :4], k[:, :, :4], v[:, :, :4]), core(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])],
        dim=2,
    )
    torch.testing.assert_close(core(q, k, v, documents), split, atol=1e-5, rtol=1e-5)


# Published totals in billions and how close the shapes come (docs/models.md): DeepSeek-V2's
# paper for V2-Lite; DeepSeek-V3's model card (671 B main model, 685 B with the MTP module as
# the Hub stores it: its own copies of the embedding and output head); the Hugging Face Hub's
# parameter count of Kimi-K2-Base (1.03 T; its technical report's 1.04 T is 1.3% more than
# the released tensors).
PUBLISHED = {
    "16B": (102400, 15.7, None),
    "671B": (129280, 671.0, 685.0),
    "kimi_k2": (163840, 1030.0, None),
}


def test_more_mtp_depths_than_the_sequence_has_tokens_is_refused() -> None:
    """A depth k predicts the token k + 1 places ahead: at or past the sequence length it has
    nothing to predict (a million depths built for minutes before)."""
    assert SPEC.make_args("debugmodel", 4096, 8, {"mtp_layers": 7}).mtp_layers == 7
    for depths in (8, 10**6):
        with pytest.raises(
            ValueError, match=f"mtp_layers {depths} must be below the sequence length 8"
        ):
            SPEC.make_args("debugmodel", 4096, 8, {"mtp_layers": depths})


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts(flavor: str) -> None:
    vocab, total_b, with_mtp_b = PUBLISHED[flavor]
    args = SPEC.make_args(flavor, vocab, 4096, {"mtp_layers": 1})
    with torch.device("meta"):
        model = SPEC.build(args)
    with_mtp = count_params(model)
    total = with_mtp - sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert abs(total / 1e9 - total_b) / total_b < 0.005, total
    if with_mtp_b:  # the published module keeps copies of the embedding and output head
        stored = with_mtp + 2 * vocab * args.dim
        assert abs(stored / 1e9 - with_mtp_b) / with_mtp_b < 0.005, stored
    main = dataclasses.replace(args, mtp_layers=0)
    active = SPEC.active_params(main, total)
    assert SPEC.flops_per_token(main, 1) < 6.2 * active < 0.3 * 6 * total


def test_mtp_targets_skip_the_window_tail_and_other_documents() -> None:
    """Depth d's target at position i is label i + d, none where i + d runs past the window,
    where the label is ignored, or (with documents) where it belongs to another document
    than position i's token."""
    from titanlite.data.batches import IGNORE_INDEX
    from titanlite.training.loss import mtp_labels

    labels = torch.tensor([[11, 12, 13, 14, 15, 16, IGNORE_INDEX, 18]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])  # label i is token i + 1's
    plain, split = mtp_labels(labels, 2), mtp_labels(labels, 2, documents)
    assert plain.shape == split.shape == (1, 3, 8)
    for d in (1, 2):
        for i in range(8):
            want = labels[0, i + d].item() if i + d < 8 else IGNORE_INDEX
            assert plain[0, d, i].item() == want, (d, i)
            next_doc = documents[0, min(i + d + 1, 7)].item()  # the window's end: its last
            same = i + d < 8 and next_doc == documents[0, i].item()
            assert split[0, d, i].item() == (want if same else IGNORE_INDEX), (d, i)
    assert torch.equal(split[:, 0], labels)
    assert split[0, 1].tolist() == [12, -100, -100, 15, 16, -100, -100, -100]


def test_mtp_loss_equals_a_direct_computation() -> None:
    """Two depths on the tiny model: the decoder's training logits carry each depth's after
    the main ones, and TrainingLoss's terms (cross-entropy, MTP loss) and objective equal
    the published recipe computed here module by module: depth d joins the previous depth's
    hidden state with the embedding of the token d ahead, and its cross-entropy covers the
    targets d + 1 ahead."""
    import torch.nn.functional as F

    from titanlite.training.loss import TrainingLoss, mtp_labels

    args = tiny_args(mtp_layers=2, mtp_loss_weight=0.25)
    model = tiny_model(args, seed=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (2, 12), generator=g)
    labels = torch.randint(0, 512, (2, 12), generator=g)
    labels[0, 5] = -100
    loss = TrainingLoss(0.0, 2, 0.25)
    assert loss.names == ("loss", "mtp_loss")
    objective, terms = loss(model(tokens), mtp_labels(labels, 2))
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
        for block in model.layers.values():
            h = block(h, model.rope)
        ce = F.cross_entropy(
            model.output(model.norm(h)).flatten(0, 1),
            labels.flatten(),
            reduction="sum",
            ignore_index=-100,
        )
        depth_losses = []
        for d, depth in enumerate(model.mtp.values(), start=1):
            ahead = torch.cat([tokens[:, d:], tokens[:, :d]], dim=1)
            joined = torch.cat([depth.enorm(model.tok_embeddings(ahead)), depth.hnorm(h)], -1)
            h = depth.block(depth.eh_proj(joined), model.rope)
            logits = model.output(depth.norm(h))[:, : 12 - d]
            depth_losses.append(
                F.cross_entropy(
                    logits.flatten(0, 1),
                    labels[:, d:].flatten(),
                    reduction="sum",
                    ignore_index=-100,
                )
            )
        mtp = sum(depth_losses) / 2
    torch.testing.assert_close(terms, torch.stack([ce, mtp]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(objective.detach(), ce + 0.25 * mtp, rtol=1e-5, atol=1e-5)
    assert mtp > 0 and not torch.allclose(depth_losses[0], depth_losses[1])
    model.eval()  # evaluation and generation see the main logits only
    assert model(tokens).shape == (2, 12, 512)
    assert loss(model(tokens), labels)[1][1].item() == 0.0


def test_training_step_gives_mtp_its_targets_within_documents() -> None:
    """With training.document_mask, ParallelModel's training step hands the loss the MTP
    targets of mtp_labels with the window's documents (BOS = 1 starts one mid-window): its
    terms equal the loss of the document-masked logits against those targets, and differ
    from the targets that ignore the documents."""
    from titanlite.data.documents import DocumentMask
    from titanlite.parallel.parallel_model import ParallelModel
    from titanlite.training.loss import TrainingLoss, mtp_labels

    model = tiny_model(tiny_args(mtp_layers=1), seed=4)
    documents = DocumentMask(bos_id=1, eos_id=2)
    loss = TrainingLoss(0.0, 1, 0.3)
    parallel = ParallelModel([model], [model], loss, documents=documents, mtp_depths=1)
    tokens = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(5))
    tokens[:, 6] = 1
    labels = torch.roll(tokens, -1, dims=1)
    terms = parallel.forward_backward(tokens, labels, 1.0)
    ids = documents.ids(tokens)
    with torch.no_grad():
        logits = model(tokens, documents=ids)
        within = loss(logits, mtp_labels(labels, 1, ids))[1]
        across = loss(logits, mtp_labels(labels, 1))[1]
    torch.testing.assert_close(terms, within, rtol=0, atol=0)
    assert terms[1] != across[1]


YARN = {
    "rope_factor": 4.0,
    "rope_original_seq_len": 16,
    "rope_mscale": 1.0,
    "rope_mscale_all_dim": 0.7,
}
# DeepSeek-V2-Lite's routing (the 16B flavor's): softmax top-k, no groups, no renormalization.
SOFTMAX = {
    "score_func": "softmax",
    "norm_topk": False,
    "n_groups": 1,
    "topk_groups": 1,
    "route_scale": 1.5,
    "bias_update_rate": 0.0,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [YARN, {"q_lora_rank": 0, **YARN, "tie_embeddings": True, **SOFTMAX}, {"mtp_layers": 1}],
    ids=["low-rank-q-yarn", "softmax-v2-full-q-yarn-tied", "mtp"],
)
def test_export_to_transformers_gives_equal_logits_and_imports_back(
    tmp_path: Path, changes: dict
) -> None:
    """Sigmoid scores export as DeepseekV3ForCausalLM, softmax scores (DeepSeek-V2-Lite's
    shape) as DeepseekV2ForCausalLM; either loads with titanlite's logits and imports back."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf
    import convert_to_hf

    from titanlite.errors import UserError
    from titanlite.interop.checkpoint_model import load_checkpoint_model

    args = tiny_args(vocab_size=4096, **changes)
    model = tiny_model(args, seed=1).eval()
    adapter = SPEC.hf_adapter()
    arch = "DeepseekV2ForCausalLM" if args.score_func == "softmax" else "DeepseekV3ForCausalLM"
    if args.score_func == "softmax":  # DeepSeek-V2 has no routing bias: a trained one refuses
        with pytest.raises(UserError, match=r"layers\.1\.feed_forward\.expert_bias is not zero"):
            adapter.to_hf_state_dict(model.state_dict(), args)
        with torch.no_grad():
            for block in list(model.layers.values())[args.first_k_dense :]:
                block.feed_forward.expert_bias.zero_()
    ckpt = write_checkpoint(tmp_path / "step-3", model, step=3, model_name="deepseek_v3")
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert config.get("num_nextn_predict_layers", 0) == args.mtp_layers
    read = adapter.from_hf_config(config)  # config.json alone gives back the routing
    assert (read.score_func, read.norm_topk, read.n_groups, read.route_scale) == (
        args.score_func,
        args.norm_topk,
        args.n_groups,
        args.route_scale,
    )
    if args.mtp_layers:  # the depth as the block after the last, as DeepSeek-V3 ships it
        from safetensors import safe_open

        names = set()
        for file in out.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                names |= set(f.keys())
        mtp = {n for n in names if n.startswith("model.layers.3.")}
        assert {
            f"model.layers.3.{n}"
            for n in (
                "enorm.weight",
                "hnorm.weight",
                "eh_proj.weight",
                "shared_head.norm.weight",
                "shared_head.head.weight",
                "embed_tokens.weight",
                "mlp.gate.weight",
            )
        } <= mtp
    hf = getattr(transformers, arch).from_pretrained(out, dtype=torch.float32).eval()
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
    restored = back.model.state_dict()
    for name, tensor in model.state_dict().items():  # the MTP depth's weights too
        assert torch.equal(restored[name], tensor), name
    assert any(n.startswith("mtp.0.") for n in restored) == bool(args.mtp_layers)


# --------------------------------------------------------------------------- training
DSV3_ARGS = [
    "--model.name",
    "deepseek_v3",
    "--model.n_layers",
    "2",
    "--model.q_lora_rank",
    "32",
    "--training.steps",
    "8",
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--model.aux_loss_coef",
    "0.01",
    "--model.bias_update_rate",
    "0.001",
    "--model.mtp_layers",
    "1",
    "--model.mtp_loss_weight",
    "0.3",
]


def train(world: int, out: Path, local_batch: int, *args: str) -> dict:
    from train_scenarios import on_pool

    argv = [
        *DSV3_ARGS,
        "--training.local_batch_size",
        str(local_batch),
        "--job.dump_folder",
        str(out),
        *args,
    ]
    return on_pool(world, argv)


def by_step(run: dict, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run["records"] if key in r}


@pytest.mark.slow
def test_tensor_expert_and_pipeline_layouts_match_one_process(tmp_path: Path) -> None:
    """deepseek_v3 debug (2 blocks: dense, then 8 experts in 4 groups; low-rank query; one
    multi-token prediction depth), fp32, aux loss and bias update on: dp_shard 2 x tp 2
    (latent attention split by heads), ep 2 within dp_shard 2 x cp 2 (each sequence split
    over the cp ranks: latent attention's keys gathered, the aux loss's expert shares and the
    bias counts summed over cp, the MTP depth given the ids and targets past each chunk) and
    pp 2 x dp_shard 2 with ep 2 within dp_shard (the experts of the second stage split over 2
    ranks; the depth on the last stage, fed the next tokens' embeddings from the first)
    against one process with the same global batch of 4, 8 steps: relative loss, MTP loss
    and gradient-norm differences <= 1e-5."""
    one = train(1, tmp_path / "one", 4)
    base, base_norm = by_step(one, "loss"), by_step(one, "grad_norm")
    base_mtp = by_step(one, "mtp_loss")
    assert sorted(base) == list(range(1, 9)) and base[8] < base[1]
    assert sorted(base_mtp) == list(range(1, 9)) and base_mtp[8] < base_mtp[1]
    worst = {}
    layouts = (
        ("dp2_tp2", 2, ("--parallelism.tensor_parallel_degree", "2")),
        (
            "ep2_cp2",
            2,
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.context_parallel_degree",
                "2",
            ),
        ),
        (
            "pp2_ep2_dp2",
            2,
            (
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.expert_parallel_degree",
                "2",
            ),
        ),
    )
    for name, local_batch, extra in layouts:
        run = train(4, tmp_path / name, local_batch, *extra)
        loss, norm = by_step(run, "loss"), by_step(run, "grad_norm")
        worst[name] = max(abs(loss[s] - base[s]) / base[s] for s in base)
        worst[f"{name}_grad_norm"] = max(abs(norm[s] - base_norm[s]) / base_norm[s] for s in base)
        mtp = by_step(run, "mtp_loss")
        worst[f"{name}_mtp"] = max(abs(mtp[s] - base_mtp[s]) / base_mtp[s] for s in base)
    print(f"deepseek_v3 parity, worst relative differences: {worst}")
    assert all(v <= 1e-5 for v in worst.values()), worst


# --------------------------------------------------------------------------- FP8 import
def write_fp8_folder(folder: Path, block: int = 16) -> dict[str, torch.Tensor]:
    """An HF DeepSeek-V3 folder of the tiny model (one MTP depth) whose projections are
    float8 e4m3 with a float32 scale per block x block tile (edges partial), as DeepSeek-V3
    and Kimi K2 are published; returns the float32 weights the scales stand for."""
    from safetensors.torch import save_file

    from titanlite.models.deepseek_v3 import hf

    args = tiny_args(mtp_layers=1)
    state = hf.to_hf_state_dict(tiny_model(args).state_dict(), args)
    tensors, expected = {}, {}
    for name, w in state.items():
        if not name.endswith(("proj.weight", "mqa.weight")):  # norms, embeddings, routers stay
            tensors[name] = expected[name] = w
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        scale = torch.zeros(rows, cols)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        expected[name] = torch.empty_like(w)
        for r in range(rows):
            for c in range(cols):
                tile = (slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block))
                scale[r, c] = w[tile].abs().max() / 448
                q[tile] = (w[tile] / scale[r, c]).to(torch.float8_e4m3fn)
                expected[name][tile] = q[tile].float() * scale[r, c]
        tensors[name], tensors[name + "_scale_inv"] = q, scale
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf.to_hf_config(args) | {
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [block, block],
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def test_fp8_block_scaled_weights_import_dequantized_and_bad_scales_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every projection of an FP8 folder (16 x 16 blocks over 48-, 40- and 12-wide matrices:
    partial edge blocks) imports as its float8 values times its block's scale; a folder
    missing a scale or with one of the wrong shape exits 2 with one line."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf

    from titanlite.errors import UserError
    from titanlite.interop.hf import load_hf
    from titanlite.models.deepseek_v3 import hf

    expected = write_fp8_folder(tmp_path / "fp8")
    state, spec, args = load_hf(tmp_path / "fp8")
    assert spec.name == "deepseek_v3" and args.mtp_layers == 1
    want = hf.from_hf_state_dict(expected, args)
    assert sorted(state) == sorted(want)
    for name, tensor in want.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    without = {k: v for k, v in expected.items() if not k.startswith("model.layers.3.")}
    with pytest.raises(UserError, match="no model.layers.3.. tensors; set it to 0"):
        hf.from_hf_state_dict(without, args)  # transformers saves no MTP block
    o_proj = expected["model.layers.0.self_attn.o_proj.weight"]
    assert not torch.equal(o_proj, tiny_model(args).state_dict()["layers.0.attention.wo.weight"])
    assert convert_from_hf.main([str(tmp_path / "fp8"), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()

    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    scale = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    broken = {
        "missing": {k: v for k, v in tensors.items() if k != scale},
        "wrong shape": tensors | {scale: tensors[scale][:1]},
    }
    lines = {}
    for name, content in broken.items():
        save_file(content, str(tmp_path / "fp8" / "model.safetensors"))
        assert convert_from_hf.main([str(tmp_path / "fp8"), str(tmp_path / name)]) == 2
        lines[name] = capsys.readouterr().err.strip().splitlines()
    weight = scale.removesuffix("_scale_inv")
    assert lines == {
        "missing": [f"error: float8 weight {weight!r} has no {scale!r}"],
        "wrong shape": [
            f"error: {scale!r} has shape [1, 1]; {weight!r} of shape [48, 12] in "
            "16x16 blocks needs [3, 1]"
        ],
    }


@pytest.mark.slow
def test_the_shipped_debug_config_learns_and_resumes_across_layouts(tmp_path: Path) -> None:
    """train_configs/deepseek_v3_debug.toml as shipped (aux loss and routing-bias updates on)
    but short (8 steps of 32 tokens, no validation) with one MTP depth: the loss falls by more
    than a fifth on one rank and on four (ep 2 within dp_shard 4, the same global batch of 8),
    the two agree, and the four ranks' step-4 checkpoint resumes in one process with steps 5-8's
    loss and MTP loss within 1e-5 of theirs (the experts, their routing biases and the MTP
    depth restored whole from their ep shards)."""
    import shutil

    from train_scenarios import by_step as records_by_step
    from train_scenarios import on_pool

    short = [
        "--job.config_file",
        str(REPO / "train_configs" / "deepseek_v3_debug.toml"),
        "--training.steps",
        "8",
        "--training.seq_len",
        "32",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--checkpoint.interval",
        "4",
        "--model.mtp_layers",
        "1",
    ]
    one = on_pool(1, [*short, "--job.dump_folder", str(tmp_path / "one")])
    four = on_pool(
        4,
        [
            *short,
            "--job.dump_folder",
            str(tmp_path / "four"),
            "--training.local_batch_size",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ],
    )
    curves = [[r["loss"] for r in records_by_step(run["records"]).values()] for run in (one, four)]
    for curve in curves:
        assert len(curve) == 8 and curve[-1] < 0.8 * curve[0], curve
    worst = max(abs(a - b) / a for a, b in zip(*curves, strict=True))
    print(
        f"deepseek_v3_debug.toml: loss {curves[0][0]:.2f} -> {curves[0][-1]:.2f}; "
        f"4 ranks against 1: {worst:.1e}"
    )
    assert worst <= 1e-5

    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "four" / "checkpoint" / "step-4", out / "checkpoint" / "step-4")
    resumed = on_pool(1, [*short, "--job.dump_folder", str(out)])
    assert any(r.get("kind") == "resume" and r["step"] == 4 for r in resumed["records"])
    for key in ("loss", "mtp_loss"):
        want, got = by_step(four, key), by_step(resumed, key)
        assert sorted(got) == [5, 6, 7, 8], got
        worst = max(abs(got[s] - want[s]) / want[s] for s in got)
        print(f"deepseek_v3 ep 2 -> 1 process resume, worst relative {key} difference: {worst:.2e}")
        assert worst <= 1e-5, (key, want, got)
