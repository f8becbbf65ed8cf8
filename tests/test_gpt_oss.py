"""The gpt-oss family: published sizes (total and active parameters), and Hugging Face
export/import against transformers' GptOssForCausalLM (window, sinks, YaRN, biased experts
with the clamped SwiGLU, the biased top-k router): logits equal to float32 round-off."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

from titanlite.models import get
from titanlite.models.decoder import Decoder
from titanlite.models.gpt_oss.args import GPT_OSS_VOCAB, GptOssArgs
from titanlite.models.init import init_parameters
from titanlite.models.layers import count_params

REPO = Path(__file__).resolve().parent.parent
SPEC = get("gpt_oss")


@pytest.mark.parametrize(
    # OpenAI's gpt-oss model card (arXiv 2508.10925, table 1): total and active parameters.
    ("flavor", "total", "active"),
    [("20b", 20.91e9, 3.61e9), ("120b", 116.83e9, 5.13e9)],
)
def test_published_parameter_counts(flavor: str, total: float, active: float) -> None:
    args = SPEC.make_args(flavor, GPT_OSS_VOCAB, 4096, {})
    with torch.device("meta"):
        counted = count_params(SPEC.build(args))
    assert abs(counted / total - 1) < 0.005
    assert abs(SPEC.active_params(args, counted) / active - 1) < 0.005


def tiny(**changes: object) -> GptOssArgs:
    base = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "top_k": 2,
        "moe_hidden_dim": 32,
        "sliding_window": 8,
        "vocab_size": 4096,
        "max_seq_len": 64,
        "rope_original_max_seq_len": 16,
        "rope_factor": 4.0,
        "aux_loss_coef": 0.0,
    }
    return GptOssArgs(**(base | changes))  # type: ignore[arg-type]


def test_export_gives_transformers_the_same_logits_and_imports_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf
    import convert_to_hf

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    args = tiny()
    model = Decoder(args)
    init_parameters(model, lambda name: SPEC.init_rule(args, name), 1)
    model.init_buffers()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # biases and sinks away from their zero start, a decisive router
        for name, p in model.named_parameters():
            if name.endswith(("bias", "b1", "b2", "b3", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if "router" in name:
                p.mul_(40)
            if "experts.w" in name:
                p.mul_(20)  # activations beyond the SwiGLU's clamp at 7
    out = tmp_path / "hf"
    ckpt = write_checkpoint(tmp_path / "step-1", model, step=1, model_name="gpt_oss")
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["rope_type"] == "yarn"
    hf = transformers.GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(4, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
        # Each feature matters: the model without its window differs from Hugging Face's.
        plain = Decoder(dataclasses.replace(args, sliding_window=0))
        plain.load_state_dict(model.state_dict())
        assert (plain(x) - theirs).abs().max() > 1e-3
    assert (ours - theirs).abs().max().item() <= 1e-5 * max(ours.abs().max().item(), 1.0)
    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back")
    assert back.spec.name == "gpt_oss" and back.args == model.args
    with torch.no_grad():
        assert torch.equal(back.model(x), ours)


# e2m1 by 4-bit code (sign bit 3): OCP microscaling's table, written out independently of
# titanlite.interop.mxfp4's derivation from the bits.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_pack(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 ``_blocks`` [experts, rows, groups, 16] and ``_scales`` for an
    [experts, in, out] tensor, and the values they encode in that layout: every value
    exactly representable (codes times powers of two from 2^-9 to 2^4)."""
    experts, inputs, rows = shape
    codes = torch.randint(0, 16, (experts, rows, inputs // 32, 32), generator=g)
    scales = torch.randint(118, 132, (experts, rows, inputs // 32), generator=g).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # even: low nibble
    values = torch.tensor(E2M1)[codes] * 2.0 ** (scales.double() - 127)[..., None]
    return blocks, scales, values.flatten(-2).transpose(1, 2).float()


def test_mxfp4_experts_import_to_the_values_they_encode(tmp_path: Path, capsys) -> None:
    """A gpt-oss folder as published (experts as MXFP4 blocks and scales, a
    quantization_config) imports with every expert weight equal to the value its codes and
    exponents encode, and the rest as exported; incomplete or misshapen MXFP4 tensors are
    one line and exit status 2."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO / "scripts"))
    import convert_from_hf
    import convert_to_hf

    from titanlite.interop.checkpoint_model import load_checkpoint_model

    args = tiny()
    model = Decoder(args)
    init_parameters(model, lambda name: SPEC.init_rule(args, name), 1)
    model.init_buffers()
    hf = tmp_path / "hf"
    ckpt = write_checkpoint(tmp_path / "step-1", model, step=1, model_name="gpt_oss")
    assert convert_to_hf.main([str(ckpt), str(hf)]) == 0
    tensors = load_file(str(hf / "model.safetensors"))
    g, expected = torch.Generator().manual_seed(3), {}
    for name in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales, expected[name] = mxfp4_pack(tuple(tensors.pop(name).shape), g)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(hf / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (hf / "config.json").write_text(json.dumps(config))

    assert convert_from_hf.main([str(hf), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(tmp_path / "back").model.state_dict()
    for layer in range(args.n_layers):
        mine, theirs = f"layers.{layer}.feed_forward.experts.", f"model.layers.{layer}.mlp.experts."
        gate_up, down = expected[theirs + "gate_up_proj"], expected[theirs + "down_proj"]
        assert torch.equal(back[mine + "w1"], gate_up[..., 0::2])
        assert torch.equal(back[mine + "w3"], gate_up[..., 1::2])
        assert torch.equal(back[mine + "w2"], down)
    for name, tensor in model.state_dict().items():
        if ".experts.w" not in name:
            assert torch.equal(back[name], tensor), name
    assert len(set(back["layers.0.feed_forward.experts.w2"].abs().flatten().tolist())) > 8

    down = "model.layers.1.mlp.experts.down_proj"
    broken = {
        "missing scales": {k: v for k, v in tensors.items() if k != down + "_scales"},
        "wrong scales": tensors | {down + "_scales": tensors[down + "_scales"][:, 1:].contiguous()},
    }
    for case, state in broken.items():
        save_file(state, str(hf / "model.safetensors"))
        capsys.readouterr()
        assert convert_from_hf.main([str(hf), str(tmp_path / case)]) == 2, case
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and down in lines[0] and "MXFP4" in lines[0], (case, lines)
        assert "Error" not in lines[0], lines


# --------------------------------------------------------------------------- parallel layouts
# The smallest gpt-oss: 2 layers (a windowed one with sinks, a full one with sinks), 4 heads
# over 2 key/value heads, 4 biased experts of width 32 (top-2), the balancing loss on (under
# TP and CP each rank routes its own tokens: the loss needs the whole sequence's counts).
PARITY_ARGS = [
    "--model.name",
    "gpt_oss",
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.head_dim",
    "16",
    "--model.num_experts",
    "4",
    "--model.top_k",
    "2",
    "--model.moe_hidden_dim",
    "32",
    "--model.sliding_window",
    "8",
    "--model.aux_loss_coef",
    "0.01",
    "--training.seq_len",
    "32",
    "--training.steps",
    "8",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]
PARITY_LAYOUTS = {  # name: (ranks, local batch of the global 4, mesh degrees, extra options)
    "dp_shard2_tp2": (
        4,
        2,
        {"dp_shard": 2, "tp": 2},
        ("--parallelism.tensor_parallel_degree", "2"),
    ),
    "ep2_cp2": (
        4,
        2,
        {"dp_shard": 2, "cp": 2},
        ("--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"),
    ),
    "pp2": (
        2,
        4,
        {"pp": 2},
        (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ),
    ),
}


@pytest.mark.slow
def test_parallel_layouts_train_like_one_process(tmp_path: Path) -> None:
    """fp32, 8 steps, global batch 4: dp_shard 2 x tp 2 (q/k/v biases split with their
    rows, o's added once, sinks split with the heads), dp_shard 2 x cp 2 with ep 2 (each
    sequence in 4 chunks of 8 tokens, the window of 8 reaching across chunks, a sink in each
    query's one softmax row; the balancing loss's expert shares summed over the cp ranks;
    experts and their biases split by expert over dp_shard 2, FSDP-sharded over cp) and pp 2
    against one process: loss and gradient norm within 1e-5 relative at every step."""
    import train_scenarios
    from pool import get_pool

    from titanlite.metrics.compare import relative_difference

    def train(name: str, world: int, local_batch: int, *extra: str) -> dict:
        argv = [
            *PARITY_ARGS,
            "--training.local_batch_size",
            str(local_batch),
            "--job.dump_folder",
            str(tmp_path / name),
            *extra,
        ]
        pool = get_pool(world)
        run = pool.run(train_scenarios.train, argv=argv)[0]
        assert [r["step"] for r in run["records"]] == list(range(1, 9)), name
        return run | {"log": "\n".join(pool.last_logs[0])}

    def curves(run: dict) -> dict[str, list[float]]:
        return {m: [float(r[m]) for r in run["records"]] for m in ("loss", "grad_norm")}

    one = train("one", 1, 4)
    assert "2 of 2 layers (1 with a sliding window of 8, 1 full, with sinks)" in one["log"]
    base = curves(one)
    assert len(set(base["loss"])) == 8  # a run that repeated one batch would make parity easy
    worst = {}
    for name, (world, local_batch, degrees, extra) in PARITY_LAYOUTS.items():
        run = train(name, world, local_batch, *extra)
        got = run["info"]["parallel_degrees"]
        assert {d: v for d, v in got.items() if v > 1} == degrees, (name, got)
        if name == "ep2_cp2":
            assert "split over ep=2 ranks" in run["log"], run["log"]
        for metric, values in curves(run).items():
            worst[f"{name} {metric}"] = max(
                relative_difference(a, b) for a, b in zip(base[metric], values, strict=True)
            )
    print(f"gpt-oss parity, worst relative difference over 8 steps: {worst}")
    assert all(v <= 1e-5 for v in worst.values()), worst
