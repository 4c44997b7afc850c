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

from cli.client import ClientError, ClientSettings, FollowState, TuneqClient, follow_job
from cli.samples import build_tiny_model, seed_config, write_text_dataset
from shared.ports import free_port
from shared.settings import get_settings


def wait_until_ready(client: TuneqClient, *, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.request("GET", "/readyz")
            return
        except ClientError:
            time.sleep(0.5)
    raise TimeoutError("tuneq did not become ready")


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
    service_log = settings.home / "demo-services.log"
    echo(f"starting tuneq dev on port {port} (its logs: {service_log})")
    settings.home.mkdir(parents=True, exist_ok=True)
    with service_log.open("ab") as log:
        dev = subprocess.Popen(
            [sys.executable, "-P", "-m", "cli.main", "dev", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with TuneqClient(ClientSettings(url=f"http://127.0.0.1:{port}")) as client:
            wait_until_ready(client)
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
            try:
                job = client.submit(body)
            except ClientError as e:
                echo(f"submit refused: {e}")
                return 1
            echo(f"submitted job {job['id']}")
            # A progress bar with the loss on a terminal, a line per event of note otherwise.
            job = follow_job(client, job, live=sys.stdout.isatty())
            echo(FollowState.from_job(job).outcome_line())
            metrics = client.metrics(job["id"], points=40)
            checkpoints = client.checkpoints(job["id"])
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
        echo(f"or download it: TUNEQ_URL=http://127.0.0.1:{port} tuneq download {job['id']} DEST")
        return 0
    finally:
        os.killpg(dev.pid, signal.SIGTERM)
        dev.wait(timeout=60)
