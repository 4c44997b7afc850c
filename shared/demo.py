"""``tuneq demo``: the whole product on a laptop in a few minutes.

Builds a tiny GPT-Neo and a JSONL dataset under $TUNEQ_HOME/data/demo, starts ``tuneq dev``,
submits the core issue's seed config (fp16 off when there is no GPU), follows the job to the
end, prints the loss curve and where the model is, and stops the service.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from shared.ports import free_port
from shared.samples import build_tiny_model, seed_config, write_text_dataset
from shared.settings import get_settings

TERMINAL = {"succeeded", "failed", "cancelled"}


def wait_until_healthy(client: httpx.Client, *, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("tuneq did not become ready")


def follow_job(
    client: httpx.Client, job_id: str, *, timeout: float, on_step: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last_step = -1
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/jobs/{job_id}").raise_for_status().json()
        if job["step"] != last_step:
            last_step = job["step"]
            on_step(job)
        if job["status"] in TERMINAL:
            return job
        time.sleep(1.0)
    raise TimeoutError(f"job {job_id} did not finish in {timeout:.0f}s")


def loss_curve(metrics: list[dict[str, Any]], *, width: int = 40) -> list[str]:
    losses = [m["loss"] for m in metrics if m["loss"] is not None]
    if not losses:
        return []
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0
    return [
        f"step {m['step']:>4}  loss {m['loss']:.4f}  " + "#" * (1 + round((m["loss"] - lo) / span * (width - 1)))
        for m in metrics
        if m["loss"] is not None
    ]


def run_demo(*, port: int, echo: Callable[[str], None]) -> int:
    settings = get_settings()
    data = settings.allowed_root_paths[0] / "demo"
    model_dir = data / "tiny-gpt-neo"
    if not (model_dir / "config.json").exists():
        echo(f"building a tiny GPT-Neo in {model_dir}")
        build_tiny_model(model_dir)
    dataset = write_text_dataset(data / "train.jsonl", records=128)
    port = port or free_port()
    echo(f"starting tuneq dev on port {port}")
    dev = subprocess.Popen(
        [sys.executable, "-P", "-m", "shared.cli", "dev", "--port", str(port)], start_new_session=True
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            wait_until_healthy(client)
            # The seed config runs as given on a GPU host; CPUs have no fp16.
            has_gpu = os.path.exists("/dev/nvidia0")
            body = {
                "name": "demo",
                "model": str(model_dir),
                "dataset": str(dataset),
                "deepspeed_config": seed_config(fp16=has_gpu, lr=1e-3),
                "num_gpus": 1,
                # 40 steps: packed, the 128 short records fill about 40 rows, so a few passes.
                "training": {"max_steps": 40, "max_seq_length": 64, "checkpoint_every_steps": 20},
            }
            response = client.post("/jobs", json=body)
            if response.status_code != 201:
                echo(f"submit refused ({response.status_code}): {response.text}")
                return 1
            job_id = response.json()["id"]
            echo(f"submitted job {job_id}; following it")

            def on_step(job: dict[str, Any]) -> None:
                loss = (job.get("latest_metrics") or {}).get("loss")
                shown = f" loss {loss:.4f}" if loss is not None else ""
                echo(f"  {job['status']:<9} step {job['step']}/{job['total_steps'] or '?'}{shown}")

            job = follow_job(client, job_id, timeout=1800, on_step=on_step)
            metrics = client.get(f"/jobs/{job_id}/metrics", params={"points": 40}).json()["data"]
            checkpoints = client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
        if job["status"] != "succeeded":
            echo(f"job {job['status']}: {job['error']}")
            return 1
        echo("loss curve:")
        for line in loss_curve(metrics):
            echo("  " + line)
        for ckpt in checkpoints:
            echo(f"checkpoint step {ckpt['step']:>4} {ckpt['kind']:<9} {ckpt['uri']}")
        model = next(c["uri"] for c in checkpoints if c["kind"] == "model")
        echo(f"fine-tuned model: {model}")
        echo(f'load it with: AutoModelForCausalLM.from_pretrained("{model}")')
        return 0
    finally:
        os.killpg(dev.pid, signal.SIGTERM)
        dev.wait(timeout=60)
