"""Peak resident memory per rank while a run loads a Hugging Face folder as its
checkpoint.initial_load_path, at 1 rank and at N ranks (FSDP over N): each rank reads only
its slices, so its peak should be its share of the model plus what every process has
(Python, torch, the data pipeline).

    python scripts/bench_hf_load.py [--dim 1024] [--layers 16] [--ranks 4] [--folder DIR]

Writes a random Llama of that shape as an HF folder (float32, titanlite's exporter) unless
``--folder`` already holds one, then starts a run's set-up (the Trainer, which loads the
folder; no step is trained) with torchrun at 1 and at N ranks, and prints, per rank, the
resident memory before the set-up and its peak by the end of it (MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = """\
[job]
dump_folder = "{dump}"
[training]
steps = 1
local_batch_size = 1
seq_len = 64
dataset = "sotu"
[checkpoint]
enable = true
initial_load_path = "{folder}"
[validation]
enable = false
"""


def write_folder(folder: Path, dim: int, layers: int) -> int:
    """A random Llama (float32) as an HF folder; returns its parameter count."""
    import torch

    from titanlite.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
    from titanlite.interop.hf import save_hf
    from titanlite.models import get
    from titanlite.models.llama.args import LlamaArgs

    heads = dim // 64
    args = LlamaArgs(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads // 2, vocab_size=4096
    )
    spec = get("llama3")
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    state = model.state_dict()
    save_hf(state, spec, args, folder, tokenizer=load_tokenizer(DEFAULT_TOKENIZER_PATH))
    return sum(t.numel() for t in state.values())


def worker(config: str, out: Path) -> None:
    """One rank: set the run up (the load happens there) and record its memory."""
    from titanlite.config import load_config
    from titanlite.runtime import distributed
    from titanlite.trainer import Trainer

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    distributed.setup_logging()
    trainer = Trainer(load_config(["--job.config_file", config]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps({"before": before, "peak": peak}))
    trainer.close()


def measure(folder: Path, ranks: int, work: Path) -> list[dict[str, float]]:
    out = work / f"ranks{ranks}"
    out.mkdir()
    config = work / f"config{ranks}.toml"
    config.write_text(CONFIG.format(dump=work / f"run{ranks}", folder=folder))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "--worker",
        str(config),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = args.folder or work / "hf"
        if not (folder / "config.json").is_file():
            count = write_folder(folder, args.dim, args.layers)
            print(f"model: Llama dim {args.dim}, {args.layers} layers, {count / 1e6:.0f} M params")
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        print(f"folder: {size:.0f} MiB of safetensors")
        one = measure(folder, 1, work)[0]
        many = measure(folder, args.ranks, work)
    print(f"1 rank: peak {one['peak']:.0f} MiB (before set-up {one['before']:.0f})")
    for rank, m in enumerate(many):
        print(f"{args.ranks} ranks, rank {rank}: peak {m['peak']:.0f} MiB ({m['before']:.0f})")
    worst = max(m["peak"] for m in many)
    print(f"worst rank / 1 rank: {worst / one['peak']:.2f}")


if __name__ == "__main__":
    main()
