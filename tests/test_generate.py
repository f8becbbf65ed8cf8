"""Text generation: greedy and seeded sampling, top-k, EOS, context truncation, and the
generate.py script on a real checkpoint folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint
from torch import nn

from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from titanlite.errors import EXIT_USER_ERROR
from titanlite.models import get
from titanlite.models.decoder import Decoder as Transformer
from titanlite.models.generate import generate, next_token
from titanlite.models.init import init_parameters
from titanlite.models.llama.args import LlamaArgs as ModelArgs

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import generate as generate_script  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to:UserWarning")
ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=128
)
PROMPT = [2, 614, 1561, 3995, 694]


@pytest.fixture(scope="module")
def model() -> Transformer:
    model = Transformer(ARGS)
    init_parameters(model, lambda name: get("llama3").init_rule(ARGS, name), 0)
    with torch.no_grad():  # a peakier next-token distribution than the init's, so that
        model.output.weight.mul_(8)  # greedy, top-k and sampling choose differently
    return model.eval()


class Scripted(nn.Module):
    """Predicts a fixed sequence of tokens (one-hot logits) and records each context."""

    def __init__(self, plan: list[int], vocab: int = 16):
        super().__init__()
        self.plan, self.vocab = plan, vocab
        self.contexts: list[list[int]] = []
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.contexts.append(tokens[0].tolist())
        logits = torch.zeros(1, tokens.shape[1], self.vocab)
        logits[0, -1, self.plan[len(self.contexts) - 1]] = 10.0
        return logits


def test_greedy_is_the_argmax_loop_and_deterministic(model: Transformer) -> None:
    out = generate(model, PROMPT, max_new_tokens=12, max_seq_len=ARGS.max_seq_len)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(PROMPT) :]
    assert generate(model, PROMPT, max_new_tokens=12, max_seq_len=ARGS.max_seq_len) == out
    # top_k=1 keeps only the argmax, whatever the temperature and the seed.
    gen = torch.Generator().manual_seed(123)
    top1 = generate(model, PROMPT, 12, ARGS.max_seq_len, temperature=1.5, top_k=1, generator=gen)
    assert top1 == out


def test_sampling_is_reproducible_with_a_seed(model: Transformer) -> None:
    def sample(seed: int, top_k: int | None = None) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return generate(
            model, PROMPT, 16, ARGS.max_seq_len, temperature=1.0, top_k=top_k, generator=gen
        )

    first = sample(0)
    assert len(first) == 16 and sample(0) == first
    assert sample(1) != first
    greedy = generate(model, PROMPT, 16, ARGS.max_seq_len)
    assert first != greedy


def test_top_k_samples_only_among_the_k_best() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, temperature=5.0, top_k=2, generator=gen) for _ in range(200)}
    assert drawn == {1, 3}
    assert next_token(logits) == 1
    with pytest.raises(ValueError, match="temperature"):
        next_token(logits, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        next_token(logits, temperature=1.0, top_k=0)


def test_stops_at_eos_and_truncates_the_context() -> None:
    scripted = Scripted([5, 6, 7, 3, 9, 9])
    out = generate(scripted, [2, 10, 11], max_new_tokens=6, max_seq_len=4, eos_id=3)
    assert out == [5, 6, 7]  # EOS ends generation and is not returned
    assert scripted.contexts == [[2, 10, 11], [2, 10, 11, 5], [10, 11, 5, 6], [11, 5, 6, 7]]
    assert generate(Scripted([5, 6, 7]), [2], max_new_tokens=2, max_seq_len=4) == [5, 6]


# --------------------------------------------------------------------------- the script
@pytest.fixture(scope="module")
def checkpoint(model: Transformer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("run") / "step-5", model, step=5)


def test_script_prints_prompt_and_greedy_continuation(
    model: Transformer, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "Mr. Speaker, the state of"
    argv = ["--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "8"]
    assert generate_script.main(argv) == 0
    printed = capsys.readouterr().out
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    new = generate(model, ids, 8, ARGS.max_seq_len, eos_id=tokenizer.eos_id)
    expected = tokenizer.decode(ids + new)
    assert printed == expected + "\n" and printed.startswith(prompt)
    # Seeded sampling from the script is reproducible.
    sampled = argv + ["--temperature", "0.9", "--top-k", "50", "--seed", "4"]
    assert generate_script.main(sampled) == 0
    first = capsys.readouterr().out
    assert generate_script.main(sampled) == 0
    assert capsys.readouterr().out == first and first.startswith(prompt)


def test_script_rejects_bad_arguments(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["--checkpoint", str(tmp_path / "nope")], "does not exist"),
        (["--checkpoint", str(tmp_path)], "not a complete titanlite checkpoint"),
        (["--checkpoint", str(checkpoint), "--temperature", "-1"], "--temperature"),
        (["--checkpoint", str(checkpoint), "--tokenizer", str(tmp_path / "t")], "tokenizer"),
    ]
    for argv, message in cases:
        assert generate_script.main([*argv, "--prompt", "hi"]) == EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert err.startswith("error:") and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_script_end_to_end(checkpoint: Path) -> None:
    """As a user runs it (its error exits are checked in-process above)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    script = str(REPO / "scripts" / "generate.py")
    argv = ["--prompt", "We the people", "--max-new-tokens", "6", "--temperature", "0.7"]
    proc = subprocess.run(
        [sys.executable, script, "--checkpoint", str(checkpoint), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("We the people") and len(proc.stdout) > len("We the people\n")
