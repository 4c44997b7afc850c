"""B7: the artifact store's upload path (issue 22): what publishing a checkpoint to S3 costs.

Both parts use moto's S3 server on loopback, in its own process (``python -m moto.server``,
the server ``tests.services.LoopbackS3`` runs in a thread: in this process it would share the
interpreter lock with the uploads being timed), with ``tests.services.S3_CREDENTIALS``.

Publish time share: a checkpoint-like directory of ``CHECKPOINT_FILES`` files of random bytes
(about 1 GB) is written locally, each file fsynced, then published file by file with the
worker's own ``ArtifactStore.put_file`` (SHA-256, then the upload) to ``s3://BUCKET/share``;
the figure is publish time ÷ write time, reported without a target. The random bytes are
drawn between writes, off the clock (a checkpoint's tensors are in memory before a save). The
objects and the local files are deleted after each repeat (moto keeps what it is sent).

Training with uploads: B1's tuneq job (same workload, ``STEPS`` steps, steps/s from the
metrics' times past the warm-up) with a DeepSpeed checkpoint every ``CHECKPOINT_EVERY_STEPS``
steps and ``KEEP_CHECKPOINTS`` kept, on two ``tuneq dev`` side by side: one on the default
local store (``TUNEQ_HOME/runs``: publishing only hashes), one with
``TUNEQ_ARTIFACTS_URI=s3://BUCKET/runs`` on the moto server; each repeat runs both, alternating
which goes first. The figure is S3 steps/s ÷ local steps/s (target ≥ 0.95). The ranks wait
before each save until the previous checkpoint is published, so an upload slower than
``CHECKPOINT_EVERY_STEPS`` steps shows as lost steps/s; on one host the store's CPU (moto) and
the upload's are taken from the ranks' cores too, which the details record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks import workload
from benchmarks.b1_training import STEPS, WARMUP_STEPS, steps_per_second
from benchmarks.common import Server
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import TuneqDev, alternate, metric_times, tuneq_dev
from shared.artifacts.store import ArtifactStore
from shared.ports import free_port

logger = logging.getLogger(__name__)

BUCKET = "tuneq-bench"
CHECKPOINT_FILES = 4
FILE_BYTES = 256 * 2**20  # 4 x 256 MiB: about 1 GB, as a DeepSpeed checkpoint's few large files
CHUNK_BYTES = 16 * 2**20
CHECKPOINT_EVERY_STEPS = 3
KEEP_CHECKPOINTS = 2
JOB_TIMEOUT_SECONDS = 1800
STORE_VARIABLES = ("TUNEQ_ARTIFACTS_URI", "TUNEQ_S3_ENDPOINT_URL")

# Rank 0's line after it waited for the previous checkpoint's upload (worker/rank/checkpointing.py).
_WAITED = re.compile(r"\brank0 .*waited (\d+(?:\.\d+)?)s for the upload of step-(\d+)")


def s3_credentials() -> dict[str, str]:
    from tests.services import S3_CREDENTIALS

    return dict(S3_CREDENTIALS)


@contextlib.contextmanager
def moto_s3(work: Path) -> Iterator[Server]:
    """moto's S3 server on loopback in its own process, with ``BUCKET`` created."""
    import boto3

    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with Server(argv, env={**os.environ, **s3_credentials()}, log=work / "moto.log", port=port) as server:
        server.wait_ready("/moto-api/")
        keys = {k.lower(): v for k, v in s3_credentials().items() if "KEY" in k}
        boto3.client("s3", endpoint_url=server.base_url, region_name="us-east-1", **keys).create_bucket(Bucket=BUCKET)
        yield server


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


# ---- publish time share ----------------------------------------------------------------------


def write_checkpoint_like(
    directory: Path, *, files: int = CHECKPOINT_FILES, file_bytes: int = FILE_BYTES, chunk_bytes: int = CHUNK_BYTES
) -> float:
    """``files`` files of ``file_bytes`` random bytes in the new ``directory``, each fsynced, then
    the directory itself: the seconds spent writing and syncing. Each chunk of random bytes is
    drawn before its write, off the clock."""
    directory.mkdir()
    spent = 0.0
    for i in range(files):
        with (directory / f"part-{i:02d}.pt").open("wb") as f:
            left = file_bytes
            while left > 0:
                chunk = os.urandom(min(chunk_bytes, left))
                started = time.perf_counter()
                f.write(chunk)
                spent += time.perf_counter() - started
                left -= len(chunk)
            started = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
            spent += time.perf_counter() - started
    started = time.perf_counter()
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return spent + time.perf_counter() - started


def publish(store: ArtifactStore, directory: Path, prefix: str) -> tuple[float, list[str]]:
    """Every file of ``directory`` through ``put_file`` (hash, then upload), one after the
    other as the worker's publisher does: the seconds it took, and the keys written."""
    started = time.perf_counter()
    keys = [store.put_file(path, f"{prefix}/{path.name}").key for path in sorted(directory.iterdir())]
    return time.perf_counter() - started, keys


@dataclass
class Share:
    write_seconds: float
    publish_seconds: float
    store_cpu_seconds: float  # moto's, during the publish


def _share_run(work: Path, store: ArtifactStore, moto: psutil.Process, repeat: int) -> Share:
    directory = work / f"checkpoint-{repeat}"
    try:
        written = write_checkpoint_like(directory)
        cpu_before = cpu_seconds(moto)
        published, keys = publish(store, directory, f"share/{repeat}")
        store_cpu = cpu_seconds(moto) - cpu_before
        store.delete(keys)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    logger.info("B7 share %d: write %.2fs, publish %.2fs", repeat, written, published)
    return Share(written, published, store_cpu)


# ---- training with uploads -------------------------------------------------------------------


@dataclass
class TrainingRun:
    steps_per_second: float
    window_seconds: float  # the timed steps' wall-clock time
    upload_waits: dict[int, float]  # the checkpoint waited for → rank 0's seconds waiting, from the log
    timed_wait_seconds: float  # the part of those waits inside the timed steps
    checkpoint_bytes: int  # one DeepSpeed checkpoint, as published
    store_cpu_seconds: float | None  # moto's CPU time during the job (S3 side only)


def upload_waits(lines: list[str]) -> dict[int, float]:
    """From a job's log: for each checkpoint a save had to wait for (its step), rank 0's seconds
    waiting until it was published."""
    return {int(m.group(2)): float(m.group(1)) for line in lines if (m := _WAITED.search(line))}


def timed_wait_seconds(
    waits: dict[int, float], *, every: int = CHECKPOINT_EVERY_STEPS, warmup: int = WARMUP_STEPS, steps: int = STEPS
) -> float:
    """The waits that fall inside the timed steps. A wait for the checkpoint of step ``t`` comes
    before the save of step ``t + every``, which follows that step's metric: it is timed when
    that save is one of ``warmup .. steps - 1`` (the final save comes after the last metric)."""
    return sum(seconds for t, seconds in waits.items() if warmup <= t + every < steps)


def checkpoint_bytes(artifacts: list[dict[str, Any]]) -> int:
    """The size of the newest DeepSpeed checkpoint among a job's published files."""
    steps = [a["step"] for a in artifacts if a["kind"] == "deepspeed"]
    if not steps:
        return 0
    newest = max(steps)
    return sum(int(a["size"]) for a in artifacts if a["kind"] == "deepspeed" and a["step"] == newest)


def _training_run(dev: TuneqDev, work: Path, side: str, repeat: int, moto: psutil.Process | None) -> TrainingRun:
    body = workload.job_body(
        work,
        name=f"b7-{side}-{repeat}",
        max_steps=STEPS,
        log_every_steps=1,
        checkpoint_every_steps=CHECKPOINT_EVERY_STEPS,
        keep_checkpoints=KEEP_CHECKPOINTS,
    )
    cpu_before = cpu_seconds(moto) if moto is not None else 0.0
    job_id, _ = dev.run_job(body, timeout=JOB_TIMEOUT_SECONDS)
    store_cpu = cpu_seconds(moto) - cpu_before if moto is not None else None
    lines = dev.client.get(f"/jobs/{job_id}/logs", params={"tail": 10_000}).json()["lines"]
    artifacts = dev.client.get(f"/jobs/{job_id}/artifacts").json()["data"]
    speed = steps_per_second(metric_times(dev.metrics(job_id)))
    waits = upload_waits(lines)
    run = TrainingRun(
        steps_per_second=speed,
        window_seconds=(STEPS - WARMUP_STEPS) / speed,
        upload_waits=waits,
        timed_wait_seconds=timed_wait_seconds(waits),
        checkpoint_bytes=checkpoint_bytes(artifacts),
        store_cpu_seconds=store_cpu,
    )
    logger.info("B7 %s %d: %s", side, repeat, run)
    return run


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def run(repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b7-") as tmp:
        work = Path(tmp)
        env = workload.prepare(work)
        local_env = {k: v for k, v in env.items() if k not in STORE_VARIABLES}
        with moto_s3(work) as moto_server:
            moto = psutil.Process(moto_server.process.pid)
            s3_env = {
                **local_env,
                **s3_credentials(),
                "TUNEQ_ARTIFACTS_URI": f"s3://{BUCKET}/runs",
                "TUNEQ_S3_ENDPOINT_URL": moto_server.base_url,
            }
            with _environment(s3_credentials()):  # this process's store reads the AWS chain
                store = ArtifactStore(f"s3://{BUCKET}", s3_endpoint_url=moto_server.base_url)
                shares = [_share_run(work, store, moto, r) for r in range(repeats)]
            with (
                tuneq_dev(work, local_env, home_name="home-local") as local,
                tuneq_dev(work, s3_env, home_name="home-s3") as s3,
            ):
                local_runs, s3_runs = alternate(
                    repeats,
                    lambda r: _training_run(local, work, "local", r, None),
                    lambda r: _training_run(s3, work, "s3", r, moto),
                )
    share = [s.publish_seconds / s.write_seconds for s in shares]
    speed = [s.steps_per_second / b.steps_per_second for s, b in zip(s3_runs, local_runs, strict=True)]
    checkpoint_mib = _median([r.checkpoint_bytes / 2**20 for r in s3_runs])
    return [
        Result(
            id="B7",
            title="artifact store on S3 (moto on loopback): publish ÷ local write time; training steps/s, S3 ÷ local",
            checks=[
                Check.reported("publish ÷ local write time, 1 GiB", Stat.of(share)),
                Check("steps/s ratio, S3 ÷ local store", Stat.of(speed), ">=", 0.95),
            ],
            details={
                "store": "moto S3 server on loopback, own process",
                "share_files": CHECKPOINT_FILES,
                "share_file_mib": FILE_BYTES / 2**20,
                "write_seconds": Stat.of([s.write_seconds for s in shares]).__dict__,
                "publish_seconds": Stat.of([s.publish_seconds for s in shares]).__dict__,
                "publish_mib_per_second": Stat.of(
                    [CHECKPOINT_FILES * FILE_BYTES / 2**20 / s.publish_seconds for s in shares]
                ).__dict__,
                "share_store_cpu_seconds": Stat.of([s.store_cpu_seconds for s in shares]).__dict__,
                "steps": STEPS,
                "warmup_steps": WARMUP_STEPS,
                "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
                "keep_checkpoints": KEEP_CHECKPOINTS,
                "checkpoint_mib": checkpoint_mib,
                "local_steps_per_second": Stat.of([r.steps_per_second for r in local_runs]).__dict__,
                "s3_steps_per_second": Stat.of([r.steps_per_second for r in s3_runs]).__dict__,
                "local_window_seconds": [r.window_seconds for r in local_runs],
                "s3_window_seconds": [r.window_seconds for r in s3_runs],
                "s3_upload_waits": [r.upload_waits for r in s3_runs],
                "s3_timed_wait_seconds": [r.timed_wait_seconds for r in s3_runs],
                "local_upload_waits": [r.upload_waits for r in local_runs],
                "s3_store_cpu_seconds": [r.store_cpu_seconds for r in s3_runs],
            },
        )
    ]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block, the old ones put back."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
