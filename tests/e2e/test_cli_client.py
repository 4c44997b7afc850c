"""The ``tuneq`` client commands as a user runs them: real processes against a real service.

One module-scoped ``tuneq dev`` and two jobs: a short one followed to success (then shown,
listed, logged, downloaded and loaded with transformers) and a long one cancelled while a
follow watches it; then a second API alone (no worker) that requires keys, for the 401s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cli.samples import seed_config, write_text_dataset
from shared.ports import free_port

from .harness import Tuneq

pytestmark = pytest.mark.slow

EXIT_FAILED, EXIT_CANCELLED, EXIT_API_ERROR, EXIT_UNREACHABLE = 1, 3, 4, 5


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    write_text_dataset(home / "data" / "varied.jsonl", records=48)
    return home


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the user runs the client: their DeepSpeed config lives here, downloads land here."""
    workdir = tmp_path_factory.mktemp("client")
    (workdir / "ds.json").write_text(json.dumps(seed_config(fp16=False)))
    return workdir


def tuneq(
    service: Tuneq | None, workdir: Path, *args: str, timeout: float = 60, api_key: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=workdir,
        env=_env(service, api_key),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _env(service: Tuneq | None, api_key: str | None = None) -> dict[str, str]:
    """The client's environment: only TUNEQ_URL (nothing there when no service) and the key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEQ_")}
    env["TUNEQ_URL"] = f"http://127.0.0.1:{service.port if service else free_port()}"
    if api_key is not None:
        env["TUNEQ_API_KEY"] = api_key
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


def submit_args(home: Path, training: dict[str, object], *extra: str) -> list[str]:
    return [
        "submit",
        "--model",
        str(home / "data" / "tiny-gpt-neo"),
        "--dataset",
        str(home / "data" / "varied.jsonl"),
        "--deepspeed",
        "ds.json",
        "--training",
        json.dumps({"max_seq_length": 64, **training}),
        *extra,
    ]


def test_submit_follow_show_jobs_logs_download(service: Tuneq, home: Path, workdir: Path) -> None:
    run = tuneq(service, workdir, *submit_args(home, {"max_steps": 5}, "--name", "cli-short", "--follow"), timeout=600)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{service.log_tail()}"
    match = re.search(r"submitted job ([0-9a-f-]{36})", run.stdout)
    assert match, run.stdout
    job_id = match.group(1)
    assert "plan: 5 steps" in run.stdout
    assert re.search(r"step 5/5 loss \d+\.\d{4} \S+ tok/s eta", run.stdout), run.stdout
    assert f"job {job_id} succeeded at step 5/5" in run.stdout

    shown = tuneq(service, workdir, "show", job_id, "--json")
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert job["id"] == job_id and job["status"] == "succeeded" and job["step"] == 5 and job["name"] == "cli-short"

    human = tuneq(service, workdir, "show", job_id)
    assert human.returncode == 0 and job_id in human.stdout and "succeeded" in human.stdout
    assert "step 5/5" in human.stdout and "checkpoint" in human.stdout

    listed = tuneq(service, workdir, "jobs")
    assert listed.returncode == 0 and job_id in listed.stdout and "cli-short" in listed.stdout
    page = json.loads(tuneq(service, workdir, "jobs", "--status", "succeeded", "--json").stdout)
    assert job_id in [j["id"] for j in page["data"]] and page["count"] >= 1
    assert json.loads(tuneq(service, workdir, "jobs", "--status", "queued", "--json").stdout)["data"] == []

    logs = tuneq(service, workdir, "logs", job_id, "--tail", "15")
    assert logs.returncode == 0 and 0 < len(logs.stdout.splitlines()) <= 15

    run_dir = home / "runs" / job_id
    done = tuneq(service, workdir, "download", job_id, "exported")  # over HTTP, checked file by file
    assert done.returncode == 0, done.stderr
    exported = workdir / "exported"
    assert "downloaded the model checkpoint at step 5 to exported (" in done.stdout and exported.is_dir()
    assert not exported.resolve().is_relative_to(run_dir)
    manifest = json.loads((exported / "tuneq-manifest.json").read_text())
    assert sorted(p.name for p in exported.iterdir()) == sorted([*manifest["files"], "tuneq-manifest.json"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported, use_safetensors=True)
    assert sum(p.numel() for p in model.parameters()) > 0
    again = tuneq(service, workdir, "download", job_id, "--output", "exported")
    # Run again: every file checked against the server's sizes and SHA-256, nothing fetched.
    assert again.returncode == 0 and "nothing fetched" in again.stdout, again.stderr

    # What the server refuses, and a server that is not there.
    finished = tuneq(service, workdir, "cancel", job_id)
    assert finished.returncode == EXIT_API_ERROR and "conflict (409)" in finished.stderr
    missing = tuneq(service, workdir, "show", str(uuid.uuid4()))
    assert missing.returncode == EXIT_API_ERROR and "not found (404)" in missing.stderr
    (workdir / "typo.json").write_text(json.dumps({**seed_config(fp16=False), "gradient_acumulation_steps": 1}))
    args = submit_args(home, {"max_steps": 5})
    args[args.index("ds.json")] = "typo.json"
    refused = tuneq(service, workdir, *args)
    assert refused.returncode == EXIT_API_ERROR
    assert "body.deepspeed_config.gradient_acumulation_steps: DeepSpeed does not know" in refused.stderr
    nobody = tuneq(None, workdir, "jobs")
    assert nobody.returncode == EXIT_UNREACHABLE and "is `tuneq serve` running at http://127.0.0.1:" in nobody.stderr


def test_cancel_ends_a_follow_with_cancelled(service: Tuneq, home: Path, workdir: Path) -> None:
    submitted = tuneq(service, workdir, *submit_args(home, {"epochs": 1000, "max_steps": 100000}, "--json"))
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    popen = {"cwd": workdir, "env": _env(service), "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    follow = subprocess.Popen([sys.executable, "-m", "cli.main", "show", job_id, "--follow"], text=True, **popen)
    logs = subprocess.Popen([sys.executable, "-m", "cli.main", "logs", job_id, "--follow"], text=True, **popen)
    try:
        assert service.wait(job_id, until={"running"}, timeout=300)["status"] == "running"
        _wait_for_step(service, job_id)
        cancelled = tuneq(service, workdir, "cancel", job_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert re.search(rf"job {job_id}: cancell(ing|ed)", cancelled.stdout)
        out, err = follow.communicate(timeout=300)
        assert follow.returncode == EXIT_CANCELLED, f"{out}\n{err}\n{service.log_tail()}"
        assert f"job {job_id} cancelled" in err and "step " in out
        log_out, _ = logs.communicate(timeout=120)
        assert logs.returncode == 0 and log_out.strip()
    finally:
        for process in (follow, logs):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert service.job(job_id)["status"] == "cancelled"


def _wait_for_step(service: Tuneq, job_id: str, *, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.job(job_id)["step"] >= 1:
            return
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} made no step:\n{service.log_tail()}")


def test_api_keys(tmp_path_factory: pytest.TempPathFactory, workdir: Path) -> None:
    """Against an API that requires keys (no worker needed): none, a wrong one, a good one."""
    api = Tuneq(home=tmp_path_factory.mktemp("cli-auth") / "home", env={"TUNEQ_AUTH": "on"}, split=True)
    api.start(workers=0)
    try:
        key = api.create_key("alice")
        missing = tuneq(api, workdir, "jobs")
        assert missing.returncode == EXIT_API_ERROR
        assert "the server wants an API key (401 unauthorized): set TUNEQ_API_KEY" in missing.stderr
        wrong = tuneq(api, workdir, "jobs", api_key=key[:-4] + "xxxx")
        assert wrong.returncode == EXIT_API_ERROR and "refused the API key in TUNEQ_API_KEY" in wrong.stderr
        good = tuneq(api, workdir, "jobs", "--json", api_key=key)
        assert good.returncode == 0, good.stderr
        assert json.loads(good.stdout) == {"data": [], "count": 0, "count_capped": False}
    finally:
        api.stop()
