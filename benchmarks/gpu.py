"""The GPU benchmark (``benchmarks/gpu.sh``): the issue's rows on one GPU, each run twice on
the same model, rows, config and steps: the bare loop (``benchmarks/bare_loop.py`` under
DeepSpeed's launcher: eager, the model's default attention, what a user's script does) and a
job through a real ``tuneq dev`` with its defaults (``training.kernels`` and
``training.compile`` auto).

- ``neo-bf16``: GPT-Neo-2.7B shape, bf16, ZeRO-2, no offload;
- ``llama-bf16``: Llama-3.2-3B shape (hidden 3072, 28 layers, 24 heads, 8 KV heads, vocabulary
  128,256, tied embeddings), bf16, ZeRO-2;
- ``neo-fp16-offload``: the core issue's config as given (fp16, ZeRO-2, optimizer offloaded to
  the CPU) at 2.7B.

Printed and written per run: tokens per second, model FLOPs utilisation, peak GPU memory (in use
on the GPU, from ``nvidia-smi``, above what was in use before the run), the loss at every step,
and per row the relative difference of tuneq's loss from the bare loop's at each step (both
report the mean over the micro-batch's label tokens; the data order is the same seed's).

No downloads: the models are built from their configs with random weights and the tokenizer is
trained locally, like the tests'. Every record is longer than ``--max-seq-length``, so each
row is cut to exactly that length: every step holds ``train_batch_size x max_seq_length``
tokens on both sides, and tokens/s = steps/s x that.

MFU = tokens/s x FLOPs per token ÷ the GPU's peak dense bf16/fp16 FLOP/s, with FLOPs per
token = 6 N + 12 L h s (N parameters, L layers, h hidden size, s sequence length: the
matmuls forward and backward plus attention scores, as in the PaLM paper's appendix B).
The peak comes from the GPU's name (``PEAK_TFLOPS``) or ``TUNEQ_BENCH_PEAK_TFLOPS``.

Fitting a short device lease: ``--only`` picks rows (in the order given) and ``--steps`` the
step count; results are written after every run, so a run cut short keeps what it finished;
compiled code lands in the tuneq home's cache (``TUNEQ_BENCH_TMP`` keeps it across runs).

On a host without CUDA it runs the CPU path instead, to show the script works there: small
shapes (``--shape small``), fp32 where the row says fp16 (no fp16 on CPU; the row says so),
no MFU or GPU memory, and tuneq's kernels and compile stay off there by their ``auto`` rules.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/gpu.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from benchmarks import workload
from benchmarks.common import REPO
from benchmarks.results import RESULTS_DIR, machine
from benchmarks.training_runs import launch_script, metric_times, tuneq_dev
from cli.samples import build_tiny_model, sample_texts, seed_config
from worker import launcher

# Model shapes by size: GPT-Neo 2.7B (EleutherAI/gpt-neo-2.7B's config, 2.7 B parameters) and
# Llama 3.2 3B (meta-llama/Llama-3.2-3B's config, 3.2 B parameters), or small ones for the CPU path.
NEO_SHAPES: dict[str, dict[str, int]] = {
    "large": {
        "hidden_size": 2560,
        "layers": 32,
        "heads": 20,
        "vocab_size": 50257,
        "max_positions": 2048,
        "window_size": 256,
    },
    "small": {"hidden_size": 256, "layers": 4, "heads": 4, "vocab_size": 600, "max_positions": 256, "window_size": 64},
}
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "large": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "layers": 28,
        "heads": 24,
        "kv_heads": 8,
        "vocab_size": 128256,
        "max_positions": 2048,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "vocab_size": 600,
        "max_positions": 256,
    },
}
SHAPES = ("2.7B", "small")  # --shape: 2.7B means the large shapes (GPT-Neo 2.7B, Llama 3.2 3B)
# Row -> (model, config).
RUNS: dict[str, tuple[str, str]] = {
    "neo-bf16": ("gpt-neo", "bf16"),
    "llama-bf16": ("llama", "bf16"),
    "neo-fp16-offload": ("gpt-neo", "fp16-offload"),
}
# Dense bf16/fp16 tensor-core peaks, by a substring of the GPU's name (vendor data sheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
WARMUP_STEPS = 3


@dataclass
class Row:
    run: str  # a RUNS key
    side: str  # "tuneq" or "bare"
    tokens_per_second: float
    mfu: float | None
    peak_gpu_memory_gib: float | None
    peak_host_memory_gib: float
    losses: list[float]  # the loss at each step, from the first
    kernels: list[str] | None = None  # tuneq: what its plan says it applied
    compiled: bool | None = None


def deepspeed_config(name: str, *, cuda: bool, train_batch_size: int) -> dict[str, Any]:
    """``fp16-offload``: the core issue's, fp16 as given (fp32 on a CPU); ``bf16``: bf16, ZeRO-2, no offload."""
    if name == "fp16-offload":
        return seed_config(fp16=cuda, train_batch_size=train_batch_size)
    bf16 = seed_config(fp16=False, train_batch_size=train_batch_size)
    bf16["bf16"] = {"enabled": True}
    del bf16["zero_optimization"]["offload_optimizer"]  # type: ignore[attr-defined]
    return bf16


def build_llama_model(directory: Path, *, tokenizer_from: Path, shape: dict[str, int]) -> Path:
    """A randomly initialised Llama of ``shape`` with the tokenizer of ``tokenizer_from``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["max_positions"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def loss_differences(bare: Row, tuneq: Row) -> list[float]:
    """|tuneq - bare| / |bare| at each step both reported."""
    return [abs(t - b) / abs(b) for b, t in zip(bare.losses, tuneq.losses, strict=False) if b]


def write_long_records(path: Path, *, records: int, seed: int = 0) -> Path:
    """Texts of about 2 000 tokens (more than any row), so every row is cut to full length."""
    rng = random.Random(seed)
    sentences = sample_texts(500, seed=seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(records):
            f.write(json.dumps({"text": " ".join(rng.choice(sentences) for _ in range(300))}) + "\n")
    return path


def flops_per_token(*, parameters: int, layers: int, hidden_size: int, seq_length: int) -> float:
    return 6.0 * parameters + 12.0 * layers * hidden_size * seq_length


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def peak_flops(name: str | None) -> float | None:
    if os.environ.get("TUNEQ_BENCH_PEAK_TFLOPS"):
        return float(os.environ["TUNEQ_BENCH_PEAK_TFLOPS"]) * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if name and key in name:
            return tflops * 1e12
    return None


def tokens_per_second(step_times: list[float], tokens_per_step: int) -> float:
    timed = step_times[WARMUP_STEPS - 1 :]
    if len(timed) < 2:
        raise ValueError(f"{len(step_times)} steps: too few to time past {WARMUP_STEPS} warm-up steps")
    return (len(timed) - 1) * tokens_per_step / (timed[-1] - timed[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default=None, help="2.7B on CUDA, small on CPU")
    parser.add_argument("--only", default="", help=f"rows, comma-separated, in run order: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-seq-length", type=int, default=None, help="1024 on CUDA, 128 on CPU")
    parser.add_argument("--train-batch-size", type=int, default=None, help="8 on CUDA, 2 on CPU")
    parser.add_argument("--output", type=Path, default=None, help="JSON (default results/gpu-<date>.json)")
    args = parser.parse_args(argv)
    console = Console()
    env = workload.rank_environment()
    cuda = env.get("DS_ACCELERATOR") != "cpu"
    shape_name = args.shape or ("2.7B" if cuda else "small")
    size = "large" if shape_name == "2.7B" else "small"
    seq = args.max_seq_length or (1024 if cuda else 128)
    batch = args.train_batch_size or (8 if cuda else 2)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()] or list(RUNS)  # in the order given
    unknown = [w for w in wanted if w not in RUNS]
    if unknown:
        parser.error(f"--only: unknown row {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if args.steps < WARMUP_STEPS + 1:
        # Refused before any model is built or run: on a short device lease, a row that trains
        # and only then finds it has nothing to time costs minutes of it.
        parser.error(
            f"--steps {args.steps}: tokens/s is timed past {WARMUP_STEPS} warm-up steps; "
            f"use at least {WARMUP_STEPS + 1}"
        )
    name = gpu_name() if cuda else None
    peak = peak_flops(name) if cuda else None
    rows: list[Row] = []
    path = args.output or RESULTS_DIR / f"gpu-{datetime.now(UTC).date().isoformat()}.json"
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-gpu-", dir=os.environ.get("TUNEQ_BENCH_TMP")) as tmp:
        work = Path(tmp)
        write_long_records(work / "data.jsonl", records=batch * (args.steps + 2))
        models: dict[str, dict[str, Any]] = {}  # built once, for the rows that use them
        document: dict[str, Any] = {
            "machine": machine(),
            "gpu": name,
            "versions": versions(),
            "max_seq_length": seq,
            "train_batch_size": batch,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "peak_flops": peak,
            "models": models,
            "runs": {run: {"model": RUNS[run][0], "config": RUNS[run][1]} for run in wanted},
        }
        launcher.build_ops(launcher.detect_hardware())
        with tuneq_dev(work, env) as dev:
            for run in wanted:
                model_name, config_name = RUNS[run]
                if model_name not in models:
                    models[model_name] = _build(model_name, size, work=work, seq=seq, console=console)
                model = models[model_name]
                config = deepspeed_config(config_name, cuda=cuda, train_batch_size=batch)
                document["runs"][run]["deepspeed_config"] = config
                config_path = work / f"{run}.json"
                config_path.write_text(json.dumps(config))
                out = work / f"bare-{run}"
                out.mkdir()
                times = out / "times.json"
                console.print(f"{run}: bare loop")
                memory = launch_script(
                    REPO / "benchmarks" / "bare_loop.py",
                    [
                        *("--model", model["path"], "--data", str(work / "data.jsonl")),
                        *("--config", str(config_path), "--max-seq-length", str(seq)),
                        *("--steps", str(args.steps), "--times", str(times)),
                    ],
                    ranks=1,
                    env=env,
                    cwd=out,
                    timeout=3600,
                )
                bare = json.loads(times.read_text())
                rows.append(_row(run, "bare", bare["step_times"], bare["losses"], memory, batch * seq))
                _write(path, rows, document=document)
                console.print(f"{run}: tuneq")
                job_id, memory = dev.run_job(
                    {
                        "name": f"gpu-{run}",
                        "model": model["path"],
                        "dataset": str(work / "data.jsonl"),
                        "deepspeed_config": config,
                        "num_gpus": 1,
                        "training": {"max_steps": args.steps, "max_seq_length": seq, "packing": False, "seed": 0},
                    }
                )
                metrics = dev.metrics(job_id)
                losses = [float(m["loss"]) for m in metrics]
                row = _row(run, "tuneq", metric_times(metrics), losses, memory, batch * seq)
                plan = dev.plan(job_id)
                row.kernels, row.compiled = plan.get("kernels", []), plan.get("compiled", False)
                rows.append(row)
                # A 2.7B job's final checkpoint (weights, fp32 master copy, Adam moments) is ~40 GB:
                # two of them would fill a GPU host's disk, and only the step times are needed.
                shutil.rmtree(dev.run_dir(job_id), ignore_errors=True)
                _write(path, rows, document=document)
    _print(console, rows, title=f"{shape_name} shapes on {name or 'CPU'}, {batch} x {seq} tokens a step")
    console.print(f"written: {path}")
    return 0


def _build(model_name: str, size: str, *, work: Path, seq: int, console: Console) -> dict[str, Any]:
    """The row's model (the Llama borrows the GPT-Neo's tokenizer, built first) and its FLOPs per token."""
    neo = work / "gpt-neo"
    if not neo.exists():
        console.print(f"building a {size} GPT-Neo (random weights) in {neo}")
        build_tiny_model(neo, **NEO_SHAPES[size])
    if model_name == "gpt-neo":
        directory, shape = neo, NEO_SHAPES[size]
    else:
        directory, shape = work / "llama", LLAMA_SHAPES[size]
        console.print(f"building a {size} Llama (random weights) in {directory}")
        build_llama_model(directory, tokenizer_from=neo, shape=shape)
    parameters = workload.parameter_count(directory)
    per_token = flops_per_token(
        parameters=parameters, layers=shape["layers"], hidden_size=shape["hidden_size"], seq_length=seq
    )
    return {"path": str(directory), "shape": shape, "parameters": parameters, "flops_per_token": per_token}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in ("torch", "deepspeed", "transformers", "liger-kernel", "triton"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _write(path: Path, rows: list[Row], *, document: dict[str, Any]) -> None:
    """The results so far (after every run, so a run cut short still leaves the rows it finished)."""
    peak = document["peak_flops"]
    for row in rows:
        per_token = document["models"][RUNS[row.run][0]]["flops_per_token"]
        row.mfu = row.tokens_per_second * per_token / peak if peak else None
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**document, "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    document["rows"] = [asdict(r) for r in rows]
    document["loss_differences"] = {run: loss_differences(bare, tuneq) for run, (bare, tuneq) in _pairs(rows).items()}
    path.write_text(json.dumps(document, indent=2) + "\n")


def _pairs(rows: list[Row]) -> dict[str, tuple[Row, Row]]:
    sides = {(r.run, r.side): r for r in rows}
    return {run: (sides[run, "bare"], sides[run, "tuneq"]) for run, side in sides if side == "tuneq"}


def _row(run: str, side: str, step_times: list[float], losses: list[float], memory: Any, tokens_per_step: int) -> Row:
    gpu = memory.gpu_peak
    return Row(
        run=run,
        side=side,
        tokens_per_second=tokens_per_second(step_times, tokens_per_step),
        mfu=None,
        peak_gpu_memory_gib=gpu / 2**30 if gpu is not None else None,
        peak_host_memory_gib=memory.peak / 2**30,
        losses=losses,
    )


def _print(console: Console, rows: list[Row], *, title: str) -> None:
    table = Table(title=title)
    columns = ("row", "side", "tokens/s", "MFU", "peak GPU memory", "peak host memory (PSS)", "kernels, compiled")
    for column in columns:
        table.add_column(column)
    for r in rows:
        applied = "" if r.side == "bare" else f"{', '.join(r.kernels or []) or 'none'}; compiled: {r.compiled}"
        table.add_row(
            r.run,
            r.side,
            f"{r.tokens_per_second:,.0f}",
            f"{r.mfu:.1%}" if r.mfu is not None else "n/a",
            f"{r.peak_gpu_memory_gib:.1f} GiB" if r.peak_gpu_memory_gib is not None else "n/a",
            f"{r.peak_host_memory_gib:.1f} GiB",
            applied,
        )
    console.print(table)
    losses = Table(title="loss per step: bare / tuneq (relative difference)")
    losses.add_column("row")
    losses.add_column("steps")
    losses.add_column("largest difference")
    for run, (bare, tuneq) in _pairs(rows).items():
        steps = " ".join(f"{b:.4f}/{t:.4f}" for b, t in zip(bare.losses, tuneq.losses, strict=False))
        differences = loss_differences(bare, tuneq)
        losses.add_row(run, steps, f"{max(differences):.2%}" if differences else "n/a")
    console.print(losses)


if __name__ == "__main__":
    sys.exit(main())
