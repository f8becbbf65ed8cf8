"""Hugging Face interop: RoPE permutation, state dict and config mapping, checkpoint reading,
export to / import from transformers' LlamaForCausalLM (same logits), tokenizer export,
sharding, and the scripts' refusals and one-line errors."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoints import write_checkpoint

from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from titanlite.errors import EXIT_USER_ERROR, UserError
from titanlite.interop import checkpoint_model
from titanlite.interop.hf import parse_size
from titanlite.models import get
from titanlite.models.decoder import Decoder as Transformer
from titanlite.models.init import init_parameters
from titanlite.models.layers import apply_rope, rope_tables
from titanlite.models.llama.args import FLAVORS
from titanlite.models.llama.args import LlamaArgs as ModelArgs
from titanlite.models.llama.hf import (
    from_hf_config,
    from_hf_state_dict,
    halves_to_interleaved,
    interleaved_to_halves,
    to_hf_config,
    to_hf_state_dict,
)

REPO = Path(__file__).resolve().parent.parent


def load_checkpoint_model(path: Path) -> tuple[Transformer, ModelArgs, dict]:
    loaded = checkpoint_model.load_checkpoint_model(path)
    assert loaded.spec.name == "llama3"
    return loaded.model, loaded.args, loaded.meta


sys.path.insert(0, str(REPO / "scripts"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The helpers save checkpoints without a process group, as intended.
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")
# transformers takes seconds to import and to build a model: those tests are slow.
needs_transformers = pytest.mark.slow

TEXT = "Mr. Speaker, Mr. Vice President: in 1863 the Union stood divided. Café, 東京, 😀!"


def tiny_args(**changes: object) -> ModelArgs:
    base: dict = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=4096,
        multiple_of=32,
        max_seq_len=128,
    )
    return ModelArgs(**(base | changes))


def tiny_model(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    if args.tie_embeddings:  # to_empty unties shared parameters
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers()
    init_parameters(model, lambda name: get("llama3").init_rule(args, name), seed)
    with torch.no_grad():  # sharper attention than the init gives, so RoPE errors show
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(20)
            layer.attention.wk.weight.mul_(20)
    return model


def tokens(n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 4096, (2, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- pure functions
def test_permutation_turns_interleaved_rope_into_rotate_half() -> None:
    n_heads, head_dim, dim, seq = 3, 8, 16, 5
    w = torch.randn(n_heads * head_dim, dim)
    x = torch.randn(1, seq, dim)
    table = rope_tables(head_dim, seq, 10000.0)
    # titanlite: project, rotate interleaved pairs.
    meta_q = apply_rope((x @ w.T).view(1, seq, n_heads, head_dim), table)
    # HF: project with permuted rows, rotate halves (cos/sin repeated over the two halves).
    hf_q = (x @ interleaved_to_halves(w, n_heads).T).view(1, seq, n_heads, head_dim)
    cos = table[:, :, 0].repeat(1, 2)[None, :, None]
    sin = table[:, :, 1].repeat(1, 2)[None, :, None]
    half = head_dim // 2
    rotated_half = torch.cat([-hf_q[..., half:], hf_q[..., :half]], dim=-1)
    hf_q = hf_q * cos + rotated_half * sin
    # Same vectors up to the per-head permutation, which both q and k get: same scores.
    regrouped = interleaved_to_halves(meta_q.reshape(-1, head_dim).T, 1).T
    torch.testing.assert_close(hf_q.reshape(-1, head_dim), regrouped)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, n_heads), n_heads), w)
    assert not torch.equal(interleaved_to_halves(w, n_heads), w)


@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_round_trip(tie: bool) -> None:
    args = tiny_args(tie_embeddings=tie)
    model = tiny_model(args)
    hf = to_hf_state_dict(model.state_dict(), args)
    assert ("lm_head.weight" in hf) is not tie
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    back = from_hf_state_dict(hf, args)
    assert back.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name
    del hf["model.norm.weight"]
    with pytest.raises(UserError, match="model.norm.weight"):
        from_hf_state_dict(hf, args)


def test_config_round_trip_and_published_flavors() -> None:
    args = tiny_args(tie_embeddings=True)
    back = from_hf_config(to_hf_config(args))  # the SwiGLU width, not how it was rounded
    assert back.ffn_hidden_dim == args.ffn_hidden_dim == 192
    assert dataclasses.replace(back, multiple_of=args.multiple_of) == args
    llama3_8b = dataclasses.replace(FLAVORS["8B"], vocab_size=128256, max_seq_len=8192)
    config = to_hf_config(llama3_8b)
    assert config["intermediate_size"] == 14336 and config["num_key_value_heads"] == 8
    assert from_hf_config(config) == llama3_8b  # multiple_of=1024, ffn_dim_multiplier=1.3
    odd = from_hf_config(config | {"intermediate_size": 5000})
    assert odd.ffn_hidden_dim == 5000
    with pytest.raises(UserError, match="not a Llama model"):
        from_hf_config(config | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UserError, match="rope_scaling"):
        from_hf_config(config | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("300KB") == 300_000
    assert parse_size("2GiB") == 2 * 2**30
    with pytest.raises(UserError, match="size"):
        parse_size("five")


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("with_output", [True, False])
def test_load_checkpoint_model_ignores_training_state(tmp_path: Path, with_output: bool) -> None:
    model = tiny_model(tiny_args(tie_embeddings=True), seed=3)
    state = model.state_dict()
    if not with_output:
        del state["output.weight"]
    # titanlite checkpoints hold only tensors (non-tensor state is in titanlite.json).
    extra = {"optimizer": {"state": {"x": torch.ones(3)}}, "other": {"y": torch.arange(3)}}
    dcp.save({"model": state, **extra}, checkpoint_id=str(tmp_path))
    sidecar = {"format": 1, "step": 7, "model_args": dataclasses.asdict(model.args)}
    (tmp_path / "titanlite.json").write_text(json.dumps(sidecar))
    loaded, args, meta = load_checkpoint_model(tmp_path)
    assert args == model.args and meta["step"] == 7
    assert loaded.output.weight is loaded.tok_embeddings.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_tied_flag_with_distinct_weights_loads_untied(tmp_path: Path) -> None:
    """A checkpoint flagged tie_embeddings whose output and embedding differ (trained untied)
    loads untied, so the loaded model (and an export) computes what was trained."""
    untied = tiny_model(tiny_args(), seed=4)
    flagged = dataclasses.replace(untied.args, tie_embeddings=True)
    dcp.save({"model": untied.state_dict()}, checkpoint_id=str(tmp_path))
    sidecar = {"format": 1, "step": 1, "model_args": dataclasses.asdict(flagged)}
    (tmp_path / "titanlite.json").write_text(json.dumps(sidecar))
    loaded, args, _ = load_checkpoint_model(tmp_path)
    assert args.tie_embeddings is False and loaded.args is args
    assert torch.equal(loaded.output.weight, untied.output.weight)
    assert to_hf_config(args)["tie_word_embeddings"] is False


def test_load_checkpoint_refuses_foreign_pickles(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_model(tiny_args()), step=7)
    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(UserError, match="metadata"):
        load_checkpoint_model(tmp_path)
    assert not sentinel.exists()


def test_a_truncated_shard_is_one_error_line(tmp_path: Path) -> None:
    """What export, generation and averaging read: a damaged shard is named, no traceback
    (DCP's CheckpointException is not an Exception)."""
    write_checkpoint(tmp_path, tiny_model(tiny_args()), step=7)
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(UserError, match="is unreadable: ") as error:
        load_checkpoint_model(tmp_path)
    assert len(str(error.value).splitlines()) == 1 and "Traceback" not in str(error.value)


def test_load_checkpoint_names_shape_mismatch(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, tiny_model(tiny_args()), step=7)
    sidecar = json.loads((tmp_path / "titanlite.json").read_text())
    sidecar["model_args"]["dim"] = 128
    (tmp_path / "titanlite.json").write_text(json.dumps(sidecar))
    with pytest.raises(UserError, match="tok_embeddings.weight has shape"):
        load_checkpoint_model(tmp_path)


# --------------------------------------------------------------------------- transformers
@needs_transformers
@pytest.mark.parametrize(
    "shape",
    [dict(tie_embeddings=False), dict(tie_embeddings=True), dict(n_kv_heads=4)],
    ids=["gqa-untied", "gqa-tied", "mha"],
)
def test_export_gives_transformers_the_same_logits(tmp_path: Path, shape: dict) -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny_model(tiny_args(**shape), seed=1)
    ckpt = write_checkpoint(tmp_path / "step-7", model, step=7)
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is model.args.tie_embeddings
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)

    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = tokens()
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
        scale = ours.abs().max().item()
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-5 * max(scale, 1.0), (diff, scale)
        # The check has teeth: skipping the RoPE permutation changes the logits.
        unpermuted = dict(hf.state_dict())
        for name, tensor in model.state_dict().items():
            if name.endswith(("wq.weight", "wk.weight")):
                proj = "q_proj" if name.endswith("wq.weight") else "k_proj"
                unpermuted[f"model.layers.{name.split('.')[1]}.self_attn.{proj}.weight"] = tensor
        hf.load_state_dict(unpermuted)
        assert (model(x) - hf(x).logits).abs().max().item() > 1e-2 * scale


@needs_transformers
def test_exported_tokenizer_matches_titanlite(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ckpt = write_checkpoint(tmp_path / "step-7", tiny_model(tiny_args()), step=7)
    assert convert_to_hf.main([str(ckpt), str(tmp_path / "hf")]) == 0
    ours = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    texts = [TEXT, "Hello world", "a\n\n  b\tc  ", "12345 + 678 = 13023"]
    for cls in (transformers.AutoTokenizer, transformers.LlamaTokenizer):
        theirs = cls.from_pretrained(tmp_path / "hf")
        for text in texts:
            ids = ours.encode(text, bos=True, eos=False)  # HF Llama adds BOS, not EOS
            assert theirs(text)["input_ids"] == ids, (cls.__name__, text)
            assert theirs.decode(ids, skip_special_tokens=True) == text
        assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (2, 3, 0)


@needs_transformers
def test_import_transformers_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**to_hf_config(tiny_args(n_kv_heads=1)))
    config.intermediate_size = 200  # not a ModelArgs-native width
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(20)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    model, args, meta = load_checkpoint_model(tmp_path / "ckpt")
    assert meta["model_only"] is True and args.ffn_hidden_dim == 200
    x = tokens()
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-5 * max(model(x).abs().max().item(), 1.0)


def test_round_trip_through_sharded_bfloat16_and_float32(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    model = tiny_model(tiny_args(tie_embeddings=True), seed=2)
    ckpt = write_checkpoint(tmp_path / "step-7", model, step=7)
    out = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(out), "--max-shard-size", "300KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    for name in shards:  # within the limit, or one tensor that alone exceeds it
        held = [t for t, file in index["weight_map"].items() if file == name]
        assert (out / name).stat().st_size < 300_000 + 4_096 or len(held) == 1
    assert not (out / "model.safetensors").exists()

    assert convert_from_hf.main([str(out), str(tmp_path / "back")]) == 0
    back, args, _ = load_checkpoint_model(tmp_path / "back")
    assert args == model.args
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name

    # A re-export may replace an earlier export; bfloat16 halves the weights.
    assert convert_to_hf.main([str(ckpt), str(out), "--dtype", "bfloat16"]) == 0
    assert not (out / "model.safetensors.index.json").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# --------------------------------------------------------------------------- refusals
def test_never_overwrites_user_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "step-7", tiny_model(tiny_args()), step=7)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    assert convert_to_hf.main([str(ckpt), str(out)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "notes.txt" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    # An import never replaces a training checkpoint (one it did not write itself).
    hf = tmp_path / "hf"
    assert convert_to_hf.main([str(ckpt), str(hf)]) == 0
    before = sorted(p.name for p in ckpt.iterdir())
    assert convert_from_hf.main([str(hf), str(ckpt)]) == EXIT_USER_ERROR
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary folder left behind


def bad_inputs(tmp_path: Path) -> dict[str, Path]:
    partial = tmp_path / "step-3"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")  # titanlite.json missing: an unfinished save
    not_llama = tmp_path / "gpt2"
    not_llama.mkdir()
    (not_llama / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(to_hf_config(tiny_args())))
    folders = {"partial": partial, "not_llama": not_llama, "no_weights": no_weights}
    for name, heads in (("typed", "eight"), ("no_heads", 0)):  # tracebacks before
        folders[name] = tmp_path / name
        folders[name].mkdir()
        config = to_hf_config(tiny_args()) | {"num_attention_heads": heads}
        (folders[name] / "config.json").write_text(json.dumps(config))
    return folders


@pytest.mark.parametrize(
    "script, source, message",
    [
        (convert_to_hf, "missing", "does not exist"),
        (convert_to_hf, "partial", "not a complete titanlite checkpoint"),
        (convert_from_hf, "missing", "does not exist"),
        (convert_from_hf, "not_llama", "not a model titanlite trains"),
        (convert_from_hf, "no_weights", "has no model.safetensors"),
        (convert_from_hf, "typed", "holds a value of the wrong type (invalid literal"),
        (convert_from_hf, "no_heads", "num_attention_heads must be at least 1, got 0"),
    ],
)
def test_bad_inputs_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], script, source: str, message: str
) -> None:
    path = bad_inputs(tmp_path).get(source, tmp_path / source)
    assert script.main([str(path), str(tmp_path / "out")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_scripts_exit_2_without_traceback(tmp_path: Path) -> None:
    inputs = bad_inputs(tmp_path)
    missing = str(tmp_path / "missing")
    cases = [
        (["convert_to_hf.py", str(inputs["partial"]), str(tmp_path / "o")], "not a complete"),
        (["generate.py", "--checkpoint", missing, "--prompt", "hi"], "does not exist"),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    for (script, *argv), message in cases:
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == EXIT_USER_ERROR, proc.stderr
        assert proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr and proc.stdout == ""
