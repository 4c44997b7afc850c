"""The training workload B1, B2, B3 and B6 share: model, data, DeepSpeed config, environment.

A GPT-Neo of about 25 M parameters (random weights, built locally) so that a step is compute,
not overhead; JSON Lines of text whose lengths vary widely, like instruction data; the core
issue's ZeRO-2 + CPU-offload config with fp16 off (no fp16 on CPU); 2 ranks.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from benchmarks.common import REPO
from benchmarks.training_runs import PeakMemory, launch_script
from cli.samples import build_tiny_model, sample_texts, seed_config
from worker import launcher

HIDDEN_SIZE = 512
LAYERS = 8
RANKS = 2
MAX_SEQ_LENGTH = 256
TRAIN_BATCH_SIZE = 4  # 2 ranks x micro-batch 2
RECORDS = 256
SEED = 0


def build_model(directory: Path) -> Path:
    if not (directory / "config.json").exists():
        build_tiny_model(directory, hidden_size=HIDDEN_SIZE, layers=LAYERS, seed=SEED)
    return directory


def parameter_count(model_dir: Path) -> int:
    """From the safetensors header, so the benchmark process need not load torch."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def write_variable_length_dataset(path: Path, *, records: int = RECORDS, seed: int = SEED) -> Path:
    """Texts of 1 to 60 sentences (about 5 to 400 tokens), most of them short: the long tail
    of instruction data, so padding to the longest row of a batch wastes a lot."""
    rng = random.Random(seed)
    sentences = sample_texts(records * 8, seed=seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(records):
            count = min(60, max(1, int(rng.lognormvariate(1.6, 1.0))))
            f.write(json.dumps({"text": " ".join(rng.choice(sentences) for _ in range(count))}) + "\n")
    return path


def deepspeed_config() -> dict[str, Any]:
    return seed_config(fp16=False, train_batch_size=TRAIN_BATCH_SIZE)


def rank_environment() -> dict[str, str]:
    """What both sides' ranks get: the environment tuneq's own launcher gives its ranks on this
    host (the CPU accelerator where there is no GPU, one thread set per rank), so only the
    service around the loop differs, and the build directory of DeepSpeed's CPU Adam op."""
    return launcher.rank_environment(launcher.detect_hardware(), num_ranks=RANKS, worker_pid=os.getpid())


def prepare(work: Path, *, records: int = RECORDS) -> dict[str, str]:
    """Model, ``data.jsonl`` and ``ds_config.json`` in ``work``, the op built; the ranks' environment."""
    build_model(work / "model")
    write_variable_length_dataset(work / "data.jsonl", records=records)
    (work / "ds_config.json").write_text(json.dumps(deepspeed_config()))
    launcher.build_ops(launcher.detect_hardware())
    return rank_environment()


def script_args(work: Path, *, times: Path, **extra: object) -> list[str]:
    """The reference scripts' arguments for the workload in ``work`` (``extra``: ``--name value``)."""
    args = [
        *("--model", str(work / "model"), "--data", str(work / "data.jsonl")),
        *("--config", str(work / "ds_config.json"), "--max-seq-length", str(MAX_SEQ_LENGTH)),
        *("--seed", str(SEED), "--times", str(times)),
    ]
    for name, value in extra.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def run_reference_script(
    script: str, work: Path, env: dict[str, str], *, out: Path, timeout: float, **extra: object
) -> tuple[dict[str, Any], PeakMemory]:
    """``deepspeed benchmarks/SCRIPT`` on the workload in ``work``, run in the new directory ``out``
    (``extra``: the script's own ``--name value`` arguments): what rank 0 wrote to ``--times``,
    and the run's peak memory."""
    out.mkdir()
    times = out / "times.json"
    memory = launch_script(
        REPO / "benchmarks" / script,
        script_args(work, times=times, **extra),
        ranks=RANKS,
        env=env,
        cwd=out,
        timeout=timeout,
    )
    recorded: dict[str, Any] = json.loads(times.read_text())
    return recorded, memory


def job_body(work: Path, *, name: str, **training: object) -> dict[str, Any]:
    """The tuneq job for the workload in ``work`` (``training``: the benchmark's own fields). Packing
    is off: the reference scripts' batches, one record per row."""
    return {
        "name": name,
        "model": str(work / "model"),
        "dataset": str(work / "data.jsonl"),
        "deepspeed_config": deepspeed_config(),
        "num_gpus": RANKS,
        "training": {"max_seq_length": MAX_SEQ_LENGTH, "packing": False, "seed": SEED, **training},
    }
