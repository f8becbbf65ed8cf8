"""training.fused_loss: the output projection fused with the loss, never holding the logits.

The op against the unfused loss on the same tensors (loss, every term, gradients of the
hidden states and of the weight), then whole training runs fused against unfused: one
process with multi-token prediction, z-loss, document masks and tied embeddings, float8, and
(slow) dp_shard 2 x tp 2, pp 2 and cp 2 against one unfused process on the same global batch.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_scenarios import on_pool

from titanlite import models
from titanlite.config import ConfigError, load_config
from titanlite.data.batches import IGNORE_INDEX
from titanlite.parallel.head import DeferredHead, defer_head
from titanlite.training.fused_loss import head_scores
from titanlite.training.loss import TrainingLoss, mtp_labels

VOCAB, DIM, CHUNK = 1000, 64, 128  # 8 chunks, the last one short
TOKENS = 37  # tokens per block of the default fused loss: the last one short
# The two fused losses: gradients computed in the forward, a block of tokens at a time (the
# default), and recomputed in backward, a chunk of the vocabulary at a time.
MODES = {
    "in forward": {"tokens": TOKENS},
    "recompute": {"recompute": True, "chunk": CHUNK},
}
# float32 rounding: the chunked sums and the unfused ones add in different orders.
RTOL = 1e-6


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of ``b``."""
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def tensors(batch: int = 3, seq: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, DIM, generator=gen).requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=gen) * 0.3).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels[:, -3:] = IGNORE_INDEX  # padding
    labels[1, 5] = VOCAB - 1  # the last row of the short last chunk
    return hidden, weight, labels


def grads(objective: torch.Tensor, *inputs: torch.Tensor, retain: bool = False) -> list:
    return list(torch.autograd.grad(objective, inputs, retain_graph=retain))


def test_head_scores_are_the_log_partition_and_the_target_logit() -> None:
    hidden, weight, labels = tensors()
    lse, target = head_scores(hidden, weight, labels, chunk=CHUNK)
    logits = hidden @ weight.t()
    assert relative(lse, torch.logsumexp(logits, -1)) <= RTOL
    counted = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert relative(target[counted], picked[counted]) <= RTOL
    assert (target[~counted] == 0).all()
    # One chunk or many: the same numbers to rounding.
    whole, _ = head_scores(hidden, weight, labels, chunk=VOCAB)
    assert relative(lse, whole) <= RTOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("depths", [0, 2])
def test_fused_loss_equals_the_unfused_loss_and_gradients(
    mode: str, z_loss: float, depths: int
) -> None:
    """Cross-entropy, z-loss and MTP terms, and the gradients of hidden states and weight,
    from hidden states of the main positions and each depth's (as the model emits them)."""
    hidden, weight, labels = tensors(seq=40 * (1 + depths))
    seq = 40
    loss = TrainingLoss(z_loss, depths, 0.3, **MODES[mode])
    documents = torch.zeros(3, seq, dtype=torch.long)
    documents[:, 17:] = 1  # a document boundary: no MTP target across it
    targets = loss.targets(labels[:, :seq], documents) if depths else labels[:, :seq]
    if depths:
        assert targets.shape == (3, 1 + depths, seq)
        assert (mtp_labels(labels[:, :seq], depths, documents)[:, 1, 15] == IGNORE_INDEX).all()
    else:
        hidden = hidden[:, :seq].detach().requires_grad_()
    fused, fused_terms = loss(hidden, targets, head=weight)
    unfused, unfused_terms = loss((hidden @ weight.t()).float(), targets)
    assert fused_terms.shape == unfused_terms.shape == (len(loss.names),)
    assert relative(fused, unfused) <= RTOL
    assert relative(fused_terms, unfused_terms) <= RTOL
    # The objective's gradient scaled (as the trainer's division by the token count does).
    scaled = grads(fused * 0.25, hidden, weight)
    for a, b in zip(scaled, grads(unfused * 0.25, hidden, weight), strict=True):
        assert relative(a, b) <= 4 * RTOL  # dh sums chunk by chunk: a few more roundings


@pytest.mark.parametrize("mode", MODES)
def test_the_loss_of_no_target_is_zero_and_its_gradient_too(mode: str) -> None:
    hidden, weight, labels = tensors()
    labels[:] = IGNORE_INDEX
    objective, terms = TrainingLoss(1e-2, **MODES[mode])(hidden, labels, head=weight)
    assert objective.item() == 0 and terms.tolist() == [0.0, 0.0]
    assert all((g == 0).all() for g in grads(objective, hidden, weight))


def test_without_gradients_the_scores_alone_and_a_frozen_weight_gets_none() -> None:
    """Evaluation (no grad) gives the training loss's numbers; a frozen head (LoRA) gets
    no gradient and the hidden states theirs."""
    hidden, weight, labels = tensors()
    loss = TrainingLoss(1e-2, tokens=TOKENS)
    trained, trained_terms = loss(hidden, labels, head=weight)
    with torch.no_grad():
        evaluated, terms = loss(hidden, labels, head=weight)
    assert not evaluated.requires_grad and torch.equal(terms, trained_terms)
    assert relative(evaluated, trained) <= RTOL
    frozen = weight.detach()
    objective, _ = loss(hidden, labels, head=frozen)
    objective.backward()
    assert frozen.grad is None
    assert relative(hidden.grad, grads(trained, hidden)[0]) <= RTOL
    # Backward twice (a zero-bubble pipeline's input pass, then its weight pass): the same.
    hidden.grad = None
    objective, _ = loss(hidden, labels, head=weight)
    first = grads(objective * 2, hidden, weight, retain=True)
    second = grads(objective * 2, hidden, weight)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_under_bf16_autocast_the_logits_are_bf16_as_unfused(mode: str) -> None:
    hidden, weight, labels = tensors()
    loss = TrainingLoss(**MODES[mode])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, _ = loss(hidden, labels, head=weight)
        unfused, _ = loss(F.linear(hidden, weight).float(), labels)
    exact, _ = loss(hidden, labels, head=weight)
    # Same bf16 products (the sums stay float32): far closer to each other than to float32.
    assert relative(fused, unfused) <= 1e-5 < relative(fused, exact)


def test_the_deferred_head_keeps_its_name_the_tie_and_high_precision() -> None:
    """float8 would convert the projection if its filter let it: deferred, it stays the
    same high-precision parameter (tied to the embedding) under the same name."""
    spec = models.get("llama3")
    args = spec.make_args("debugmodel", 256, 64, {"n_layers": 1, "tie_embeddings": True})
    with torch.device("meta"):
        model = spec.build(args)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    defer_head(model, spec)
    assert isinstance(model.output, DeferredHead)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == names
    x = torch.randn(2, 3, args.dim, device="meta")
    assert model.output(x) is x


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [("chunk", "0", "must be at least 1"), ("tokens", "-1", "must be 0 (automatic) or more")],
)
def test_a_block_below_its_least_is_a_one_line_config_error(
    key: str, value: str, problem: str
) -> None:
    name = f"training.fused_loss_{key}"
    with pytest.raises(ConfigError, match=re.escape(f"{name}: {problem}")) as e:
        load_config([f"--{name}", value])
    assert len(str(e.value).splitlines()) == 1


def test_the_8b_dry_run_shows_the_loss_with_and_without_fusing() -> None:
    """Llama 3 8B (float32), 8,192 tokens per rank, vocabulary 128,256: unfused the loss
    peaks at 3 copies of the 3.91 GiB logits; fused at a [523, vocab] block (256 MiB) plus dh
    and dW (2.08 GiB, kept for backward); recomputing at 2 [tokens, chunk] blocks; the
    activation estimate differs by the saving."""

    from titanlite.dry_run import dry_run

    config = str(Path(__file__).parent.parent / "train_configs" / "llama3_8b.toml")
    reports = {}
    for name, args in {"unfused": UNFUSED, **FUSED}.items():
        cfg = load_config(["--job.config_file", config, *args])
        reports[name] = dry_run(cfg, 8, 128256)
    gib = {
        k: float(re.search(r"activations\s+~([\d.]+) GiB", out).group(1))
        for k, out in reports.items()
    }
    assert "loss            unfused: ~11.74 GiB at its peak" in reports["unfused"]
    assert "loss            fused: ~2.33 GiB at its peak" in reports["in forward"]
    assert "2.08 GiB of dh and dW kept for backward); unf" in reports["in forward"]
    assert "9.41 GiB less fused" in reports["in forward"]
    assert "loss            fused: ~0.50 GiB at its peak" in reports["recompute"]
    assert "11.24 GiB less fused" in reports["recompute"]
    assert gib["unfused"] - gib["in forward"] == pytest.approx(9.41, abs=0.02), reports
    assert gib["unfused"] - gib["recompute"] == pytest.approx(11.24, abs=0.02), reports


# --- whole runs -----------------------------------------------------------------------------

STEPS = 8
# deepseek_v3's debug model with dense blocks only (routing flips would amplify rounding),
# two multi-token prediction depths (under FSDP the first is resharded before the head reads
# its output: its final norm must run inside it), z-loss on, tied embeddings, the vocabulary
# of 4,096 in 14 chunks (7 per rank under tp 2) when recomputed, the tokens (4 x 32 x 3 per
# rank in one process) in blocks of 100 otherwise.
DSV3 = [
    "--model.name",
    "deepseek_v3",
    "--model.n_layers",
    "2",
    "--model.first_k_dense",
    "2",
    "--model.q_lora_rank",
    "32",
    "--model.mtp_layers",
    "2",
    "--model.mtp_loss_weight",
    "0.3",
    "--model.tie_embeddings",
    "true",
    "--training.z_loss_weight",
    "0.01",
    "--training.fused_loss_chunk",
    "300",
    "--training.fused_loss_tokens",
    "100",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
]
TERMS = ("loss", "z_loss", "mtp_loss", "grad_norm")


def curves(world: int, folder: Path, *args: str) -> dict[str, list[float]]:
    run = on_pool(world, [*DSV3, "--job.dump_folder", str(folder), *args])
    records = [r for r in run["records"] if "kind" not in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return {t: [r[t] for r in records] for t in TERMS}


def worst(base: dict[str, list[float]], other: dict[str, list[float]]) -> dict[str, float]:
    """Largest relative difference per term over the steps, and the gradient norm's at step 1
    (the same weights: no drift yet)."""
    diffs = {
        t: max(abs(a - b) / abs(a) for a, b in zip(base[t], other[t], strict=True)) for t in TERMS
    }
    first = base["grad_norm"][0]
    return {**diffs, "grad_norm_step_1": abs(first - other["grad_norm"][0]) / first}


# Over 8 steps at lr 2e-3 the weights drift apart by rounding, which the gradient norm shows
# most (measured up to 4.1e-6 at step 8, <= 2e-7 at step 1; unfused layouts drift as much):
# the bound of test_deepseek_v3's layouts.
GRAD_NORM_RTOL = 1e-5


def assert_exact(name: str, diff: dict[str, float]) -> None:
    assert max(diff["loss"], diff["z_loss"], diff["mtp_loss"]) <= RTOL, (name, diff)
    assert diff["grad_norm_step_1"] <= RTOL, (name, diff)
    assert diff["grad_norm"] <= GRAD_NORM_RTOL, (name, diff)


@pytest.mark.slow  # three runs of the trainer: with its layouts, below
def test_one_process_fused_trains_as_unfused_with_mtp_z_loss_and_documents(
    tmp_path: Path,
) -> None:
    common = ["--training.local_batch_size", "4", "--training.document_mask", "true"]
    base = curves(1, tmp_path / "unfused", *common, *UNFUSED)
    assert base["loss"][-1] < base["loss"][0] and base["mtp_loss"][0] > 0
    for name, mode in FUSED.items():
        fused = curves(1, tmp_path / name, *common, *mode)
        diff = worst(base, fused)
        print(f"fused ({name}) vs unfused, one process, max relative differences:", diff)
        assert_exact(f"one process, {name}", diff)


UNFUSED = ["--training.fused_loss", "false"]  # the default is fused
FUSED = {
    "in forward": ["--training.fused_loss", "true"],
    "recompute": ["--training.fused_loss", "true", "--training.fused_loss_recompute", "true"],
}
TP = ["--parallelism.tensor_parallel_degree", "2"]
# Each layout with the default fused loss; the recomputing one where it differs from it most
# (its reduction over the vocabulary shards: both modes reduce the same way under pp and cp).
LAYOUTS = {
    "dp_shard 2 x tp 2": (4, TP, 2, FUSED["in forward"]),
    "dp_shard 2 x tp 2, recompute": (4, TP, 2, FUSED["recompute"]),
    "pp 2": (2, ["--parallelism.pipeline_parallel_degree", "2"], 4, FUSED["in forward"]),
    "cp 2": (2, ["--parallelism.context_parallel_degree", "2"], 4, FUSED["in forward"]),
}


@pytest.mark.slow
def test_fused_layouts_train_as_one_unfused_process(tmp_path: Path) -> None:
    """The same global batch of 4 sequences, fp32: each layout fused against one process
    unfused (and the layout unfused, to show the fused loss adds no difference of its own)."""
    base = curves(1, tmp_path / "one", "--training.local_batch_size", "4", *UNFUSED)
    measured = {}
    for i, (name, (world, args, local, mode)) in enumerate(LAYOUTS.items()):
        batch = ["--training.local_batch_size", str(local)]
        start = time.perf_counter()
        fused = curves(world, tmp_path / f"layout{i}", *args, *batch, *mode)
        measured[name] = worst(base, fused)
        measured[name]["seconds"] = time.perf_counter() - start
    print("fused layouts vs one unfused process, max relative differences:", measured)
    for name, diff in measured.items():
        assert_exact(name, diff)


@pytest.mark.slow  # two runs of the trainer
def test_under_float8_the_fused_projection_stays_in_high_precision(tmp_path: Path) -> None:
    """Float8 on every other linear: the fused run (whose filter would let the projection be
    converted) trains as the unfused one whose filter keeps it in high precision; float8
    rounds a value differently now and then, hence F8_RTOL (as test_float8's layouts)."""
    llama = [
        *("--model.name", "llama3", "--model.dim", "64", "--model.n_layers", "2"),
        *("--model.n_heads", "4", "--model.n_kv_heads", "4", "--model.multiple_of", "32"),
        *("--model.converters", "float8", "--float8.auto_filter_small", "false"),
        *("--training.steps", str(STEPS), "--training.seq_len", "64", "--metrics.log_freq", "1"),
        *("--validation.enable", "false", "--checkpoint.enable", "false"),
        *("--training.local_batch_size", "2", "--training.fused_loss_tokens", "50"),
    ]
    runs = {}
    for fused, filters in (("false", "output,router"), ("true", "router")):
        folder = tmp_path / fused
        run = on_pool(
            1,
            [
                *llama,
                "--training.fused_loss",
                fused,
                "--float8.filter_fqns",
                filters,
                "--job.dump_folder",
                str(folder),
            ],
        )
        runs[fused] = [r["loss"] for r in run["records"] if "kind" not in r]
        assert len(runs[fused]) == STEPS
    diff = max(abs(a - b) / a for a, b in zip(runs["false"], runs["true"], strict=True))
    print(f"float8, fused vs unfused loss: {diff:.2e} at most")
    assert diff <= 1e-3, (diff, runs)
    assert runs["false"][0] == pytest.approx(runs["true"][0], rel=RTOL)
