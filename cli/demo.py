"""``tuneq demo``: the whole product on a laptop in a few minutes.

Builds a tiny GPT-Neo and a JSONL dataset under $TUNEQ_HOME/data/demo, starts ``tuneq dev``,
submits the core issue's seed config (fp16 off when there is no GPU), follows the job to the
end, prints the loss curve and where the model is, and stops the service. Its last line is a
command that runs the fine-tuned model, which works once the service has stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cli.client import ClientError, ClientSettings, FollowState, TuneqClient, follow_job
from cli.samples import build_tiny_model, seed_config, write_text_dataset
from shared.jobs.run_layout import RunLayout
from shared.ports import free_port
from shared.settings import Settings, get_settings

# 40 steps: packed, the 128 short records fill about 40 rows, so a few passes.
DEMO_TRAINING = {"max_steps": 40, "max_seq_length": 64, "checkpoint_every_steps": 20}
# What the last line's command asks the fine-tuned model to continue.
DEMO_PROMPT = "The cat"


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


@contextlib.contextmanager
def dev_service(settings: Settings, port: int, *, echo: Callable[[str], None]) -> Iterator[TuneqClient]:
    """``tuneq dev`` on ``port``, its output in a log file it names; a client of it once it is
    ready. Stopped (SIGTERM, as Ctrl-C would) on the way out."""
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
            yield client
    finally:
        os.killpg(dev.pid, signal.SIGTERM)
        dev.wait(timeout=60)


def environment_command(name: str) -> str:
    """A command of this interpreter's environment as a shell runs it from here, whether or not
    the environment is activated: ``.venv/bin/tuneq`` in a checkout, else its absolute path."""
    command = Path(sys.executable).with_name(name)
    with contextlib.suppress(ValueError):
        command = command.relative_to(Path.cwd())
    return shlex.quote(str(command))


def try_model_command(model: Path, *, prompt: str = DEMO_PROMPT) -> str:
    """A shell command that loads the fine-tuned model with transformers and prints its greedy
    continuation of ``prompt``, with no service."""
    # Python's strings in double quotes (JSON's are Python's too), so the shell's single quotes
    # around the code need no escapes.
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer; "
        f"path = {json.dumps(str(model))}; "
        "tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path); "
        f'ids = model.generate(**tokenizer({json.dumps(prompt)}, return_tensors="pt"), max_new_tokens=12, '
        "do_sample=False); print(tokenizer.decode(ids[0], skip_special_tokens=True))"
    )
    return f"{environment_command('python')} -c {shlex.quote(code)}"


def local_model(settings: Settings, job: dict[str, Any], checkpoints: list[dict[str, Any]]) -> Path | None:
    """Where the job's exported model is on this host's disk: the worker's run directory (the
    store's copy, where TUNEQ_ARTIFACTS_URI is a local directory, is the same files)."""
    exported = RunLayout.for_job(settings, str(job["id"])).model_dir
    if (exported / "config.json").is_file():
        return exported
    stored = next((Path(c["uri"]) for c in checkpoints if c["kind"] == "model" and "://" not in c["uri"]), None)
    return stored if stored is not None and (stored / "config.json").is_file() else None


def run_demo(*, port: int, echo: Callable[[str], None]) -> int:
    settings = get_settings()
    data = settings.allowed_root_paths[0] / "demo"
    model_dir = data / "tiny-gpt-neo"
    if not (model_dir / "config.json").exists():
        echo(f"building a tiny GPT-Neo in {model_dir}")
        build_tiny_model(model_dir)
    dataset = write_text_dataset(data / "train.jsonl", records=128)
    with dev_service(settings, port or free_port(), echo=echo) as client:
        # The seed config runs as given on a GPU host; CPUs have no fp16.
        has_gpu = os.path.exists("/dev/nvidia0")
        body = {
            "name": "demo",
            "model": str(model_dir),
            "dataset": str(dataset),
            "deepspeed_config": seed_config(fp16=has_gpu, lr=1e-3),
            "num_gpus": 1,
            "training": DEMO_TRAINING,
        }
        try:
            job = client.submit(body)
        except ClientError as e:
            echo(f"submit refused: {e}")
            return 1
        echo(f"submitted job {job['id']}")
        # A progress bar with the loss on a terminal, a line per event of note otherwise.
        job = follow_job(client, job, live=sys.stdout.isatty(), echo=echo)
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
    tuneq = environment_command("tuneq")
    model = local_model(settings, job, checkpoints)
    if model is None:  # exported to a store elsewhere, and not kept here
        echo(f"fine-tuned model: `{tuneq} download {job['id']} DEST` fetches it while `{tuneq} dev` runs")
        return 0
    echo(f"fine-tuned model: {model} (transformers' AutoModelForCausalLM.from_pretrained loads it)")
    echo(f"the service has stopped: `{tuneq} dev` starts it again, this job included")
    echo(f"try it: {try_model_command(model)}")
    return 0
