"""Training throughput of titanlite against a plain-PyTorch loop of the same model shape.

For each flavor and case (processes x parallelism x eager/compiled x fp32/bf16) this runs, in
one sitting and back to back, (a) titanlite itself, started the way ./run_train.sh starts it
(torchrun -m titanlite.train with the bench overrides; one process directly, without
torchrun), and (b) the no-framework reference
below: a Llama of identical parameter shapes written in ~60 lines of plain PyTorch, random
tokens, AdamW and gradient clipping, wrapped in torch's own DDP or FSDP2 for two ranks.
Both print per-step times; the table compares medians over the steps after --warmup.

MFU is achieved FLOP/s over the whole machine divided by the matmul peak measured here at
the start (all cores, in the case's dtype), so titanlite and the reference are judged alike.

    python scripts/bench.py                          # the full table (about 15 min, 2 cores)
    python scripts/bench.py --flavors debugmodel --cases 1p-eager-fp32 --steps 4
    python scripts/bench.py --json results.json      # also write the rows as JSON

Internal: `--reference-worker` runs one reference case (started by this script, under torchrun
for several processes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from titanlite.data import load_tokenizer  # noqa: E402
from titanlite.metrics.jsonl import read_metrics  # noqa: E402
from titanlite.metrics.loggers import measure_matmul_flops  # noqa: E402
from titanlite.models.layers import count_params  # noqa: E402
from titanlite.models.llama import SPEC as LLAMA  # noqa: E402
from titanlite.models.llama.args import LlamaArgs as ModelArgs  # noqa: E402
from titanlite.runtime.distributed import env_info, join_group  # noqa: E402

TOKENIZER = REPO / "titanlite" / "assets" / "tokenizer.model"


@dataclass(frozen=True)
class Case:
    name: str
    ranks: int
    data_parallel: str  # "none", "ddp" (titanlite BucketedDDP / torch DDP) or "fsdp"
    compile: bool
    dtype: str  # "float32" or "bfloat16"


CASES = {
    c.name: c
    for c in [
        Case("1p-eager-fp32", 1, "none", False, "float32"),
        Case("1p-compile-fp32", 1, "none", True, "float32"),
        Case("1p-eager-bf16", 1, "none", False, "bfloat16"),
        Case("1p-compile-bf16", 1, "none", True, "bfloat16"),
        Case("2r-ddp-eager-fp32", 2, "ddp", False, "float32"),
        Case("2r-fsdp-eager-fp32", 2, "fsdp", False, "float32"),
        Case("2r-ddp-compile-fp32", 2, "ddp", True, "float32"),
    ]
}


# --------------------------------------------------------------------------- the reference
# Written the way a researcher writes a loop without a framework (nanoGPT style): fused
# norms from torch, complex-number RoPE, SDPA, mean loss, default AdamW, clip_grad_norm_.


class RefAttention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = a.n_heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.hd)
        k = self.wk(x).view(b, t, self.n_kv, self.hd)
        v = self.wv(x).view(b, t, self.n_kv, self.hd)

        def rotate(z: torch.Tensor) -> torch.Tensor:
            zc = torch.view_as_complex(z.float().reshape(b, t, -1, self.hd // 2, 2))
            return torch.view_as_real(zc * freqs[:t, None]).flatten(3).type_as(z)

        q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=True, enable_gqa=self.n_kv != self.n_heads
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class RefBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attention = RefAttention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.w1 = nn.Linear(a.dim, a.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RefLlama(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.blocks = nn.ModuleList(RefBlock(a) for _ in range(a.n_layers))
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)
        inv = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        angles = torch.outer(torch.arange(a.max_seq_len).float(), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.freqs)
        return self.head(self.norm(x)).float()


def reference_worker(args: argparse.Namespace) -> None:
    """One reference case in this process (a rank of a torchrun group, or alone); rank 0 writes
    times."""
    import torch.distributed as dist

    case = CASES[args.case]
    rank, world, _, _ = env_info()
    join_group("gloo", rank, world)  # under torchrun, or alone when started directly
    torch.manual_seed(0)
    a = LLAMA.make_args(args.flavor, args.vocab_size, args.seq_len, {})
    model: nn.Module = RefLlama(a)
    if case.data_parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, case.dtype))
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    if case.compile:
        for block in model.blocks:
            block.compile()
    if case.data_parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    autocast = case.dtype == "bfloat16" and case.data_parallel != "fsdp"
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, a.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # what a loop that prints its loss every step pays
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the runs


def launch(ranks: int, args: list[str]) -> list[str]:
    """The command that runs ``python ARGS`` on ``ranks`` processes: torchrun for several, the
    interpreter itself for one (as run_train.sh does; torchrun would add its own process and
    its `import torch`, about 2 s of CPU)."""
    if ranks == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        *args,
    ]


def run(cmd: list[str], threads: int, timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:8])} ... exited {proc.returncode}:\n" + "\n".join(tail))


def read_records(dump: Path) -> list[dict]:
    """A run's training records, in step order."""
    train = read_metrics(dump / "metrics.jsonl").train
    return [train[step] for step in sorted(train)]


def titanlite_run(case: Case, flavor: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """The per-step records of a real titanlite run (logged every step)."""
    dump = tmp / f"titanlite-{flavor}-{case.name}"
    overrides = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        "--model.flavor",
        flavor,
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.batch),
        "--training.steps",
        str(args.steps),
        "--training.mixed_precision_param",
        case.dtype,
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        "--compile.enable",
        str(case.compile).lower(),
        "--parallelism.data_parallel_replicate_degree",
        str(case.ranks if case.data_parallel == "ddp" else 1),
        "--parallelism.data_parallel_shard_degree",
        str(case.ranks if case.data_parallel == "fsdp" else 1),
    ]
    threads = max(1, args.cores // case.ranks)
    run(launch(case.ranks, ["-m", "titanlite.train", *overrides]), threads, args.timeout)
    return [r for r in read_records(dump) if "tps" in r]


def reference_times(case: Case, flavor: str, args: argparse.Namespace, tmp: Path) -> list[float]:
    out = tmp / f"reference-{flavor}-{case.name}.json"
    worker = [
        __file__,
        "--reference-worker",
        "--case",
        case.name,
        "--flavor",
        flavor,
        "--vocab-size",
        str(args.vocab_size),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--out",
        str(out),
    ]
    run(launch(case.ranks, worker), max(1, args.cores // case.ranks), args.timeout)
    return json.loads(out.read_text())


def throughput(args: argparse.Namespace, peaks: dict[str, float], tmp: Path) -> list[dict]:
    print(
        f"\n## Training throughput\n\nper rank {args.batch} x {args.seq_len} tokens per step; "
        f"{args.cores} cores split evenly between the ranks; medians over the steps after "
        f"the first {args.warmup} of {args.steps} ({args.bf16_warmup} of {args.bf16_steps} "
        f"for bf16), {args.repeats} run(s) per side\n"
    )
    header = (
        "| flavor | case | titanlite tok/s | reference tok/s | titanlite / reference "
        "| titanlite MFU % | reference MFU % | titanlite / reference eager fp32 "
        "| titanlite data wait % |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|", flush=True)
    rows = []
    for i, (flavor, name) in enumerate(
        (f, n)
        for f in args.flavors
        for n in args.cases
        if not (CASES[n].dtype == "bfloat16" and f not in args.bf16_flavors)
    ):
        case = CASES[name]
        bf16 = case.dtype == "bfloat16"
        steps, warm = (args.bf16_steps, args.bf16_warmup) if bf16 else (args.steps, args.warmup)
        case_args = argparse.Namespace(**{**vars(args), "steps": steps})
        tokens = args.batch * args.seq_len * case.ranks
        # Alternate which goes first (ABBA over repeats), so that a machine getting busier
        # does not hurt one side only; the measured steps of all repeats are pooled.
        ours, ref = [], []
        for r in range(args.repeats):
            if (i + r) % 2 == 0:
                ours += titanlite_run(case, flavor, case_args, tmp)[warm:]
                ref += reference_times(case, flavor, case_args, tmp)[warm:]
            else:
                ref += reference_times(case, flavor, case_args, tmp)[warm:]
                ours += titanlite_run(case, flavor, case_args, tmp)[warm:]
        # Logged tokens/s is per rank over its step (data wait and logging included).
        ours_tps = tokens / statistics.median(args.batch * args.seq_len / r["tps"] for r in ours)
        ref_tps = tokens / statistics.median(ref)
        a = LLAMA.make_args(flavor, args.vocab_size, args.seq_len, {})
        fpt = LLAMA.flops_per_token(a, args.seq_len)
        baseline = next(
            (
                r["reference_tps"]
                for r in rows
                if r["flavor"] == flavor and r["name"] == "1p-eager-fp32"
            ),
            None,
        )
        row = {
            "flavor": flavor,
            "params": count_ref_params(a),
            "flops_per_token": fpt,
            **asdict(case),
            "steps_measured": len(ours),
            "titanlite_tps": ours_tps,
            "reference_tps": ref_tps,
            "ratio": ours_tps / ref_tps,
            "titanlite_mfu_pct": 100 * ours_tps * fpt / peaks[case.dtype],
            "reference_mfu_pct": 100 * ref_tps * fpt / peaks[case.dtype],
            "vs_reference_eager_fp32": ours_tps / baseline if baseline else None,
            "data_wait_pct": statistics.median(r["data_wait_pct"] for r in ours),
        }
        rows.append(row)
        vs = f"{row['vs_reference_eager_fp32']:.2f}" if baseline else "-"
        print(
            f"| {flavor} | {name} | {ours_tps:,.0f} | {ref_tps:,.0f} | {row['ratio']:.3f} | "
            f"{row['titanlite_mfu_pct']:.1f} | {row['reference_mfu_pct']:.1f} | {vs} | "
            f"{row['data_wait_pct']:.2f} |",
            flush=True,
        )
    return rows


def data_supply(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """How many tokens/s the loader alone hands one rank, against what training consumes."""
    from bench_data import bench as bench_loader

    from titanlite.data import DataSpec

    print("\n## Data loader supply vs training demand\n")
    print("| flavor | ranks | loader tok/s per rank | training tok/s per rank | supply / demand |")
    print("|---|---|---|---|---|")
    out = []
    tokenizer = args.tokenizer
    spec = DataSpec(dataset="sotu", seq_len=args.seq_len, local_batch_size=args.batch)
    for row in rows:
        if row["dtype"] != "float32" or row["compile"]:
            continue
        measured = bench_loader(tokenizer, spec, row["ranks"], args.data_seconds, prefetch=True)
        supply = measured["rank_tok_s"]
        demand = row["titanlite_tps"] / row["ranks"]
        out.append(
            {"flavor": row["flavor"], "ranks": row["ranks"], "supply": supply, "demand": demand}
        )
        print(
            f"| {row['flavor']} | {row['ranks']} ({row['data_parallel']}) | {supply:,.0f} | "
            f"{demand:,.0f} | {supply / demand:,.0f}x |",
            flush=True,
        )
    return out


def startup(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Seconds from ./run_train.sh to the end of the first step, debug config, caches warm
    (the first of the runs warms them and is not counted)."""
    print("\n## Start-up: ./run_train.sh to the end of the first step (debug config)\n")
    records = []
    for i in range(args.startup_runs + 1):
        dump = tmp / f"startup-{i}"
        cmd = [
            str(REPO / "run_train.sh"),
            "--training.steps",
            "1",
            "--job.dump_folder",
            str(dump),
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
        ]
        env = dict(os.environ, TITANLITE_LAUNCH_TIME=f"{time.time():.6f}")
        env.pop("OMP_NUM_THREADS", None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"run_train.sh exited {proc.returncode}: {proc.stderr[-2000:]}")
        if i:
            first = next(r for r in read_records(dump) if "startup_s" in r)
            records.append({**first["startup_phases_s"], "total": first["startup_s"]})
    print("| phase | " + " | ".join(f"run {i + 1} s" for i in range(len(records))) + " |")
    print("|---" * (len(records) + 1) + "|")
    for k in records[0]:
        label = "**total**" if k == "total" else k
        print(f"| {label} | " + " | ".join(f"{r[k]:.2f}" for r in records) + " |")
    return records


def count_ref_params(a: ModelArgs) -> int:
    with torch.device("meta"):
        return count_params(RefLlama(a))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sections",
        nargs="+",
        default=["throughput", "data", "startup"],
        choices=["throughput", "data", "startup"],
    )
    p.add_argument("--flavors", nargs="+", default=["bench", "debugmodel"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=8, help="steps per run, warmup included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation)")
    p.add_argument(
        "--bf16-flavors",
        nargs="*",
        default=["debugmodel"],
        help="flavors that run the bf16 cases (bf16 is emulated on most CPUs)",
    )
    p.add_argument("--bf16-steps", type=int, default=4)
    p.add_argument("--bf16-warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per side and case, alternating")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--data-seconds", type=float, default=3.0)
    p.add_argument("--startup-runs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json", help="also write every number here")
    # reference worker mode
    p.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--flavor", help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reference_worker:
        reference_worker(args)
        return 0
    if args.warmup >= args.steps or args.bf16_warmup >= args.bf16_steps:
        p.error("warmup steps must be fewer than steps")
    args.tokenizer = load_tokenizer(str(TOKENIZER))
    args.vocab_size = args.tokenizer.vocab_size

    torch.set_num_threads(args.cores)
    peaks = {
        dtype: measure_matmul_flops(torch.device("cpu"), getattr(torch, dtype))
        for dtype in ("float32", "bfloat16")
    }
    print(f"# titanlite benchmarks, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    print(
        f"machine: {args.cores} cores {platform.machine()}, torch {torch.__version__}; "
        f"matmul peak (all cores): fp32 {peaks['float32'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict = {"peaks": peaks}
    with tempfile.TemporaryDirectory(prefix="titanlite-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if "throughput" in args.sections:
            results["throughput"] = throughput(args, peaks, tmp)
            if "data" in args.sections:
                results["data"] = data_supply(args, results["throughput"])
        if "startup" in args.sections:
            results["startup"] = startup(args, tmp)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
