"""The GPU benchmark (``benchmarks/gpu.sh``): the core issue's config on a GPT-Neo-2.7B-shaped
model on one GPU, through tuneq and through the bare loop.

Two configs, each run both ways (``benchmarks/bare_loop.py`` under DeepSpeed's launcher, and
a job through a real ``tuneq dev``), same model, rows, config and steps:

- ``fp16-offload``: the core issue's config as given (fp16, ZeRO-2, optimizer offloaded to
  the CPU);
- ``bf16``: bf16, ZeRO-2, no offload.

Printed per run: tokens per second, model FLOPs utilisation and peak GPU memory (the memory
in use on the GPU, from ``nvidia-smi``, above what was in use before the run).

No downloads: the model is built from its config with random weights and the tokenizer is
trained locally, like the tests'. Every record is longer than ``--max-seq-length``, so each
row is cut to exactly that length: every step holds ``train_batch_size x max_seq_length``
tokens on both sides, and tokens/s = steps/s x that.

MFU = tokens/s x FLOPs per token ÷ the GPU's peak dense bf16/fp16 FLOP/s, with FLOPs per
token = 6 N + 12 L h s (N parameters, L layers, h hidden size, s sequence length: the
matmuls forward and backward plus attention scores, as in the PaLM paper's appendix B).
The peak comes from the GPU's name (``PEAK_TFLOPS``) or ``TUNEQ_BENCH_PEAK_TFLOPS``.

On a host without CUDA it runs the CPU path instead, to show the script works there: a small
shape (``--shape small``), fp16 off (no fp16 on CPU; the row says so), no MFU or GPU memory.
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

# GPT-Neo 2.7B (EleutherAI/gpt-neo-2.7B's config): 2.7 B parameters.
SHAPES: dict[str, dict[str, int]] = {
    "2.7B": {
        "hidden_size": 2560,
        "layers": 32,
        "heads": 20,
        "vocab_size": 50257,
        "max_positions": 2048,
        "window_size": 256,
    },
    "small": {"hidden_size": 256, "layers": 4, "heads": 4, "vocab_size": 600, "max_positions": 256, "window_size": 64},
}
# Dense bf16/fp16 tensor-core peaks, by a substring of the GPU's name (vendor data sheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}
WARMUP_STEPS = 3


@dataclass
class Row:
    config: str
    side: str  # "tuneq" or "bare"
    tokens_per_second: float
    mfu: float | None
    peak_gpu_memory_gib: float | None
    peak_host_memory_gib: float


def configs(*, cuda: bool, train_batch_size: int) -> dict[str, dict[str, Any]]:
    offload = seed_config(fp16=cuda, train_batch_size=train_batch_size)  # the core issue's, fp16 as given
    bf16 = seed_config(fp16=False, train_batch_size=train_batch_size)
    bf16["bf16"] = {"enabled": True}
    del bf16["zero_optimization"]["offload_optimizer"]  # type: ignore[attr-defined]
    return {"fp16-offload" if cuda else "fp32-offload (no fp16 on CPU)": offload, "bf16": bf16}


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
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="2.7B on CUDA, small on CPU")
    parser.add_argument("--only", default="", help="config names, comma-separated, in run order")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-seq-length", type=int, default=None, help="1024 on CUDA, 128 on CPU")
    parser.add_argument("--train-batch-size", type=int, default=None, help="8 on CUDA, 2 on CPU")
    parser.add_argument("--output", type=Path, default=None, help="JSON (default results/gpu-<date>.json)")
    args = parser.parse_args(argv)
    console = Console()
    env = workload.rank_environment()
    cuda = env.get("DS_ACCELERATOR") != "cpu"
    shape_name = args.shape or ("2.7B" if cuda else "small")
    shape = SHAPES[shape_name]
    seq = args.max_seq_length or (1024 if cuda else 128)
    batch = args.train_batch_size or (8 if cuda else 2)
    available = configs(cuda=cuda, train_batch_size=batch)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()] or list(available)  # in the order given
    unknown = [w for w in wanted if w not in available]
    if unknown:
        parser.error(f"--only: unknown config {', '.join(unknown)}; choose from {', '.join(available)}")
    chosen = {w: available[w] for w in wanted}
    name = gpu_name() if cuda else None
    peak = peak_flops(name) if cuda else None
    rows: list[Row] = []
    path = args.output or RESULTS_DIR / f"gpu-{datetime.now(UTC).date().isoformat()}.json"
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-gpu-", dir=os.environ.get("TUNEQ_BENCH_TMP")) as tmp:
        work = Path(tmp)
        console.print(f"building a {shape_name} GPT-Neo (random weights) in {work}")
        build_tiny_model(work / "model", **shape)
        parameters = workload.parameter_count(work / "model")
        per_token = flops_per_token(
            parameters=parameters, layers=shape["layers"], hidden_size=shape["hidden_size"], seq_length=seq
        )
        write_long_records(work / "data.jsonl", records=batch * (args.steps + 2))
        document: dict[str, Any] = {
            "machine": machine(),
            "shape": {"name": shape_name, **shape, "parameters": parameters},
            "max_seq_length": seq,
            "train_batch_size": batch,
            "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "flops_per_token": per_token,
            "peak_flops": peak,
            "configs": chosen,
        }
        launcher.build_ops(launcher.detect_hardware())
        with tuneq_dev(work, env) as dev:
            for label, config in chosen.items():
                config_path = work / f"{label.split()[0]}.json"
                config_path.write_text(json.dumps(config))
                out = work / f"bare-{label.split()[0]}"
                out.mkdir()
                times = out / "times.json"
                console.print(f"{label}: bare loop")
                memory = launch_script(
                    REPO / "benchmarks" / "bare_loop.py",
                    [
                        *("--model", str(work / "model"), "--data", str(work / "data.jsonl")),
                        *("--config", str(config_path), "--max-seq-length", str(seq)),
                        *("--steps", str(args.steps), "--times", str(times)),
                    ],
                    ranks=1,
                    env=env,
                    cwd=out,
                    timeout=3600,
                )
                rows.append(_row(label, "bare", json.loads(times.read_text())["step_times"], memory, batch * seq))
                _write(path, rows, document=document)
                console.print(f"{label}: tuneq")
                job_id, memory = dev.run_job(
                    {
                        "name": f"gpu-{label.split()[0]}",
                        "model": str(work / "model"),
                        "dataset": str(work / "data.jsonl"),
                        "deepspeed_config": config,
                        "num_gpus": 1,
                        "training": {"max_steps": args.steps, "max_seq_length": seq, "packing": False, "seed": 0},
                    }
                )
                rows.append(_row(label, "tuneq", metric_times(dev.metrics(job_id)), memory, batch * seq))
                # A 2.7B job's final checkpoint (weights, fp32 master copy, Adam moments) is ~40 GB:
                # two of them would fill a GPU host's disk, and only the step times are needed.
                shutil.rmtree(dev.run_dir(job_id), ignore_errors=True)
                _write(path, rows, document=document)
    _print(console, rows, title=f"{shape_name} GPT-Neo ({parameters / 1e6:,.0f} M parameters) on {name or 'CPU'}")
    console.print(f"written: {path}")
    return 0


def _write(path: Path, rows: list[Row], *, document: dict[str, Any]) -> None:
    """The results so far (after every run, so a run cut short still leaves the rows it finished)."""
    per_token, peak = document["flops_per_token"], document["peak_flops"]
    for row in rows:
        row.mfu = row.tokens_per_second * per_token / peak if peak else None
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**document, "written_at": datetime.now(UTC).isoformat(timespec="seconds")}
    document["rows"] = [asdict(r) for r in rows]
    path.write_text(json.dumps(document, indent=2) + "\n")


def _row(label: str, side: str, step_times: list[float], memory: Any, tokens_per_step: int) -> Row:
    gpu = memory.gpu_peak
    return Row(
        config=label,
        side=side,
        tokens_per_second=tokens_per_second(step_times, tokens_per_step),
        mfu=None,
        peak_gpu_memory_gib=gpu / 2**30 if gpu is not None else None,
        peak_host_memory_gib=memory.peak / 2**30,
    )


def _print(console: Console, rows: list[Row], *, title: str) -> None:
    table = Table(title=title)
    for column in ("config", "side", "tokens/s", "MFU", "peak GPU memory", "peak host memory (PSS)"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.config,
            r.side,
            f"{r.tokens_per_second:,.0f}",
            f"{r.mfu:.1%}" if r.mfu is not None else "n/a",
            f"{r.peak_gpu_memory_gib:.1f} GiB" if r.peak_gpu_memory_gib is not None else "n/a",
            f"{r.peak_host_memory_gib:.1f} GiB",
        )
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
