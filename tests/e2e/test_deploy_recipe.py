"""docs/deploying.md's plain-process recipe ("Several hosts without Docker"), run as written.

The recipe's shell blocks are the fenced ``bash`` blocks under ``<!-- recipe: NAME -->``
comments. This runs them, in order, against this machine's Postgres (a fresh role and database,
dropped at the end) and Redis (a database number no other test uses), with each "host" (the API
host and two worker hosts) a ``STATE`` directory of its own on loopback: the blocks the docs say
run on every host run once per host, with that host's ``STATE``. Only the values block is
replaced, by this test's own values for the same variables. Then a tiny job is submitted with the
key the recipe created, and must succeed on a worker whose home is not the API's.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from shared.ports import free_port
from tests.conftest import POSTGRES_URL

pytestmark = pytest.mark.slow

DEPLOYING = Path(__file__).resolve().parents[2] / "docs" / "deploying.md"
RECIPE_BLOCK = re.compile(r"<!-- recipe: ([\w-]+) -->\n```bash\n(.*?)```", re.DOTALL)
# A Redis database no other test takes (tests/conftest.py: 15, 13, 11, 9; the soak: 14).
RECIPE_REDIS_DB = 12
WORKER_HOSTS = ("worker-1", "worker-2")


def recipe_blocks() -> dict[str, str]:
    blocks = dict(RECIPE_BLOCK.findall(DEPLOYING.read_text()))
    assert list(blocks) == ["values", "services", "host-env", "api-setup", "api", "worker", "check"], (
        f"docs/deploying.md's recipe blocks changed: {list(blocks)}"
    )
    return blocks


def assigned_names(block: str) -> set[str]:
    return set(re.findall(r"^([A-Z_]+)=", block, re.MULTILINE))


def recipe_env(values: dict[str, str]) -> dict[str, str]:
    """This environment without tuneq's own settings (the recipe's environment file gives them),
    with the installed ``tuneq`` first on PATH, as the recipe asks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEQ_") or k == "TUNEQ_API_WORKERS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **values}


def run_block(block: str, env: dict[str, str], cwd: Path, *, timeout: float = 120) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"recipe block failed ({done.returncode}):\n{block}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def deployment_values(tmp_path: Path, postgres_url: str, redis_url: str) -> Iterator[dict[str, str]]:
    """The values block's variables for this machine; the role and database are dropped after."""
    from sqlalchemy.engine import make_url

    name = f"tuneq_recipe_{uuid.uuid4().hex[:10]}"
    postgres = make_url(POSTGRES_URL)
    redis = urlsplit(redis_url)
    data = tmp_path / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=32)
    values = {
        "DB_HOST": postgres.host or "127.0.0.1",
        "DB_NAME": name,
        "DB_USER": name,
        "DB_PASSWORD": uuid.uuid4().hex,
        "REDIS_URL": f"redis://{redis.hostname}:{redis.port or 6379}/{RECIPE_REDIS_DB}",
        "STORE": str(tmp_path / "store"),
        "DATA": str(data),
        "STATE": "",  # each host's, below
        "API_HOST": "127.0.0.1",
        "API_PORT": str(free_port()),
        "QUEUE": f"tuneq-recipe-{name[-10:]}",
    }
    yield values
    drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
    subprocess.run(
        ["psql", "-h", values["DB_HOST"], "-U", "postgres", "-c", drop, "-c", f'DROP ROLE IF EXISTS "{name}"'],
        check=False,
        capture_output=True,
        timeout=60,
    )
    import redis as redis_client

    connection = redis_client.Redis.from_url(values["REDIS_URL"])
    for key in connection.scan_iter(f"*{values['QUEUE']}*"):
        connection.delete(key)
    connection.close()


def start_block(block: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """A block that ends in a long-running process, started as a process manager would."""
    with (cwd / "process.log").open("ab") as log:
        return subprocess.Popen(
            ["bash", "-eu", "-c", block], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def logs(hosts: dict[str, Path]) -> str:
    return "\n".join(
        f"--- {host}:\n" + "\n".join((path / "process.log").read_text(errors="replace").splitlines()[-30:])
        for host, path in hosts.items()
        if (path / "process.log").exists()
    )


def test_the_plain_process_recipe_deploys_a_working_service(tmp_path: Path, deployment_values: dict[str, str]) -> None:
    blocks = recipe_blocks()
    assert assigned_names(blocks["values"]) == set(deployment_values), "the recipe's values changed: update this test"
    hosts = {host: tmp_path / host for host in ("api", *WORKER_HOSTS)}
    for path in hosts.values():
        path.mkdir()

    def host_env(host: str) -> dict[str, str]:
        return recipe_env({**deployment_values, "STATE": str(hosts[host] / "state")})

    run_block(blocks["services"], recipe_env(deployment_values), tmp_path)
    for host in hosts:
        run_block(blocks["host-env"], host_env(host), hosts[host])
    key = run_block(blocks["api-setup"], host_env("api"), hosts["api"]).strip().splitlines()[-1]
    assert key.startswith("tq_"), key

    processes = [start_block(blocks["api"], host_env("api"), hosts["api"])]
    try:
        processes += [start_block(blocks["worker"], host_env(host), hosts[host]) for host in WORKER_HOSTS]
        deadline = time.monotonic() + 60
        check = ["bash", "-euo", "pipefail", "-c", blocks["check"]]
        while subprocess.run(check, env=recipe_env(deployment_values), capture_output=True, check=False).returncode:
            assert time.monotonic() < deadline, f"the API never became ready:\n{logs(hosts)}"
            assert processes[0].poll() is None, f"tuneq serve exited:\n{logs(hosts)}"
            time.sleep(0.5)

        base_url = f"http://{deployment_values['API_HOST']}:{deployment_values['API_PORT']}"
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            assert client.get("/jobs").status_code == 200
            assert httpx.get(f"{base_url}/jobs", timeout=30).status_code == 401  # keys are on off loopback
            data = Path(deployment_values["DATA"])
            response = client.post(
                "/jobs",
                json={
                    "model": str(data / "tiny-gpt-neo"),
                    "dataset": str(data / "train.jsonl"),
                    "deepspeed_config": seed_config(fp16=False, train_batch_size=2),
                    "training": {"max_steps": 2, "max_seq_length": 64},
                },
            )
            assert response.status_code == 201, response.text
            job_id = response.json()["id"]
            deadline = time.monotonic() + 180
            while (job := client.get(f"/jobs/{job_id}").json())["status"] not in {"succeeded", "failed", "cancelled"}:
                assert time.monotonic() < deadline, f"job still {job['status']}:\n{logs(hosts)}"
                time.sleep(0.5)
            assert job["status"] == "succeeded", f"{job['error']}\n{logs(hosts)}"
            # The model came through the shared store: the API host's own home holds no run.
            artifacts = client.get(f"/jobs/{job_id}/artifacts").json()["data"]
            config = next(a for a in artifacts if a["path"] == "model/config.json")
            assert client.get(f"/jobs/{job_id}/artifacts/{config['path']}").status_code == 200
            assert not (hosts["api"] / "state" / "runs" / job_id).exists()
            assert (Path(deployment_values["STORE"]) / job_id / "model" / "config.json").exists()
    finally:
        stop(processes)
