"""The product as a user meets it: real ``tuneq`` processes, HTTP, Celery, DeepSpeed ranks.

Nothing is mocked. Each module-scoped service runs several jobs, one after another, the way
a worker would.
"""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cli.samples import seed_config, write_text_dataset
from tests.services import LoopbackS3, fresh_postgres_schema

from .conftest import ARTIFACTS_BUCKET, s3_artifacts_env
from .harness import Tuneq, job_body, wait_gone

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    write_text_dataset(home / "data" / "varied.jsonl", records=96)
    write_text_dataset(home / "data" / "repeated.jsonl", records=48, vary=False)
    return home


def body(home: Path, **overrides: Any) -> dict[str, Any]:
    # Text is packed by default: several records per row, so an epoch has few steps.
    training = {"epochs": 20, "max_steps": 12, "max_seq_length": 64, "checkpoint_every_steps": 5}
    return job_body(home, "varied.jsonl", deepspeed_config=seed_config(fp16=False), training=training) | overrides


def check_succeeded(service: Tuneq, job: dict[str, Any], *, steps: int) -> list[dict[str, Any]]:
    assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
    assert job["step"] == steps and job["total_steps"] == steps
    assert job["started_at"] and job["finished_at"] and job["error"] is None
    metrics: list[dict[str, Any]] = service.get(f"/jobs/{job['id']}/metrics")["data"]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # ordered, each step once
    for m in metrics:
        assert m["loss"] is not None and m["learning_rate"] is not None and m["tokens_per_second"] > 0
        assert m["time"].endswith(("Z", "+00:00"))
    assert job["latest_metrics"]["step"] == steps
    return metrics


def check_exported_model(exported: Path | str, original: Path) -> None:
    """The export loads with transformers, holds every full weight, and training changed them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported, use_safetensors=True)
    AutoTokenizer.from_pretrained(exported)
    before = AutoModelForCausalLM.from_pretrained(original, use_safetensors=True).state_dict()
    after = model.state_dict()
    assert before.keys() == after.keys()
    changed = 0
    for name, tensor in before.items():
        assert after[name].shape == tensor.shape, name  # no ZeRO-3 placeholders
        changed += int(not torch.equal(after[name].float(), tensor.float()))
    assert changed > len(before) // 2, f"only {changed} of {len(before)} tensors changed"


def exported_model(service: Tuneq, job: dict[str, Any]) -> str:
    """Where the job's one model checkpoint is (a path: this module's store is the default)."""
    checkpoints = service.get(f"/jobs/{job['id']}/checkpoints")["data"]
    model_ckpt = [c for c in checkpoints if c["kind"] == "model"]
    assert len(model_ckpt) == 1 and model_ckpt[0]["bytes"] > 0
    return str(model_ckpt[0]["uri"])


def test_seed_config_as_given_with_fp16_off(service: Tuneq, home: Path) -> None:
    """ZeRO-2, CPU optimizer offload, Adam at 3e-5: the core issue's config, fp16 off."""
    job = service.submit(body(home, dataset=str(home / "data" / "repeated.jsonl"), name="seed"))
    job = service.wait(job["id"])
    metrics = check_succeeded(service, job, steps=12)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    checkpoints = service.get(f"/jobs/{job['id']}/checkpoints")["data"]
    assert [(c["step"], c["kind"]) for c in checkpoints] == [
        (5, "deepspeed"),
        (10, "deepspeed"),
        (12, "deepspeed"),
        (12, "model"),
    ]
    for c in checkpoints:
        assert Path(c["uri"], "tuneq-manifest.json").is_file() and c["bytes"] > 0
    check_exported_model(exported_model(service, job), home / "data" / "tiny-gpt-neo")
    logs = service.get(f"/jobs/{job['id']}/logs?tail=5")["lines"]
    assert len(logs) == 5
    # The rank's exit, in the job log's last lines (the default launcher: the warm start)
    assert any("rank 0 (pid" in line and "exited with status 0" in line for line in logs)


@pytest.mark.parametrize(
    ("stage", "ranks", "offload"),
    [(0, 1, False), (2, 2, False), (2, 2, True), (3, 2, False), (3, 1, True)],
    ids=["zero0-1rank", "zero2-2ranks", "zero2-offload-2ranks", "zero3-2ranks", "zero3-offload-1rank"],
)
def test_zero_stages_and_rank_counts(service: Tuneq, home: Path, stage: int, ranks: int, offload: bool) -> None:
    config = seed_config(fp16=False, train_batch_size=2 * ranks, zero_stage=stage, lr=2e-3)
    zero: dict[str, Any] = config["zero_optimization"]  # type: ignore[assignment]
    if not offload:
        del zero["offload_optimizer"]
    elif stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    steps = 16
    job = service.submit(
        body(
            home,
            deepspeed_config=config,
            num_gpus=ranks,
            training={"epochs": 20, "max_steps": steps, "max_seq_length": 64, "log_every_steps": 1, "seed": 7},
        )
    )
    job = service.wait(job["id"])
    metrics = check_succeeded(service, job, steps=steps)
    first, last = metrics[:4], metrics[-4:]
    assert sum(m["loss"] for m in last) < sum(m["loss"] for m in first), [m["loss"] for m in metrics]
    check_exported_model(exported_model(service, job), home / "data" / "tiny-gpt-neo")


def test_a_sequence_length_past_a_local_models_limit_is_refused_at_submit(service: Tuneq, home: Path) -> None:
    """It used to be accepted and to fail the job at step 0; the ranks still check it for hub
    models (tests/worker/rank/test_model_loading.py)."""
    response = service.client.post("/jobs", json=body(home, training={"max_steps": 3, "max_seq_length": 4096}))
    assert response.status_code == 422, response.text
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "training", "max_seq_length"]
    assert "max_seq_length 4096 exceeds the model's 256 positions" in problem["msg"]


def test_fp16_is_refused_at_submit_once_the_cpu_worker_is_known(service: Tuneq, home: Path) -> None:
    response = service.client.post("/jobs", json=body(home, deepspeed_config=seed_config(fp16=True)))
    assert response.status_code == 422
    assert "fp16 needs a CUDA GPU" in response.json()["detail"][0]["msg"]


def test_dev_stops_the_whole_tree_even_while_a_job_runs(tmp_path: Path, home: Path) -> None:
    service = Tuneq(home=tmp_path / "home", env={"TUNEQ_ALLOWED_ROOTS": str(home / "data")}).start()
    job = service.submit(body(home, training={"max_steps": 100_000, "epochs": 1000, "max_seq_length": 64}))
    deadline = time.monotonic() + 180
    while service.job(job["id"])["step"] < 2:
        assert time.monotonic() < deadline, service.log_tail()
        time.sleep(0.5)
    tree = service.descendants()
    assert any("worker.rank.train" in " ".join(p.cmdline()) for p in tree), "no rank among the service's processes"
    dev = service.processes[0]
    dev.send_signal(signal.SIGTERM)
    dev.wait(timeout=60)
    assert wait_gone(tree, timeout=30) == []
    service.client.close()
    # The interrupted job went back to the queue, to resume on the next start.
    import sqlite3

    with sqlite3.connect(service.home / "tuneq.sqlite") as db:
        (status,) = db.execute("SELECT status FROM jobs WHERE id = ?", (job["id"].replace("-", ""),)).fetchone()
    assert status == "queued"


def test_max_steps_repeats_the_data_and_max_seq_length_follows_the_model(service: Tuneq, home: Path) -> None:
    """No epochs and no max_seq_length given: max_steps is the run's length (the data repeats,
    as with the HF Trainer's max_steps) and the sequence length is the model's (256 positions)."""
    job_body = body(home, dataset=str(home / "data" / "repeated.jsonl"), training={"max_steps": 12})
    plan = service.client.post("/jobs/plan", json=job_body).json()
    assert plan["steps_per_epoch"] < 12 and plan["total_steps"] == 12, plan
    job = service.submit(job_body)
    assert job["training"]["max_seq_length"] == 256  # the tiny model's max_position_embeddings
    job = service.wait(job["id"])
    check_succeeded(service, job, steps=12)
    assert job["latest_metrics"]["epoch"] > 1  # more than one pass over the data


def test_no_tuneq_process_depends_on_the_directory_it_is_started_from(tmp_path: Path, home: Path) -> None:
    """A user's project with shared/, api/ and worker/ folders of its own: `tuneq dev` started
    there used to import those instead of tuneq's packages (python -m puts the working
    directory first on sys.path), in the API, the worker, the warm start and the ranks."""
    project = tmp_path / "project"
    for package in ("shared", "api", "worker"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text('raise ImportError("imported from the working directory")\n')
    env = {"TUNEQ_ALLOWED_ROOTS": str(home / "data")}
    service = Tuneq(home=tmp_path / "home", env=env, cwd=project).start()
    try:
        job = service.wait(service.submit(body(home, training={"max_steps": 2, "max_seq_length": 64}))["id"])
        check_succeeded(service, job, steps=2)
        assert "imported from the working directory" not in service.log.read_text(errors="replace")
    finally:
        service.stop()


def test_postgres_and_redis_with_separate_api_and_worker(
    tmp_path: Path, home: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> None:
    """The production stack on two "hosts" that share no disk: the API and the worker have
    their own TUNEQ_HOME, artifacts go to S3, and the model comes back over HTTP."""
    env = {
        "TUNEQ_DATABASE_URL": fresh_postgres_schema(postgres_url),
        "TUNEQ_BROKER_URL": redis_url,
        "TUNEQ_ALLOWED_ROOTS": str(home / "data"),
        # The production stack with DeepSpeed's own launcher, which every other end-to-end
        # test replaces with the default warm start: both ways of starting ranks stay covered.
        "TUNEQ_LAUNCHER": "deepspeed",
        **s3_artifacts_env(loopback_s3, "separate"),
    }
    api_home, worker_home = tmp_path / "api-host", tmp_path / "worker-host"
    service = Tuneq(home=api_home, env=env, split=True, worker_env={"TUNEQ_HOME": str(worker_home)}).start()
    try:
        job = service.submit(
            body(
                home,
                num_gpus=2,
                deepspeed_config=seed_config(fp16=False, train_batch_size=2),
                training={"epochs": 20, "max_steps": 8, "max_seq_length": 64, "checkpoint_every_steps": 4},
            )
        )
        job = service.wait(job["id"])
        check_succeeded(service, job, steps=8)
        logs = service.get(f"/jobs/{job['id']}/logs?tail=5")["lines"]  # from SQL: the API has no train.log
        assert any("exits successfully" in line for line in logs)  # DeepSpeed's launch.py, at the end
        listed = service.get("/jobs?status=succeeded")
        assert [j["id"] for j in listed["data"]] == [job["id"]]

        checkpoints = service.get(f"/jobs/{job['id']}/checkpoints")["data"]
        assert [(c["step"], c["kind"]) for c in checkpoints] == [(4, "deepspeed"), (8, "deepspeed"), (8, "model")]
        assert all(c["uri"].startswith(f"s3://{ARTIFACTS_BUCKET}/separate/{job['id']}/") for c in checkpoints)
        artifacts = service.get(f"/jobs/{job['id']}/artifacts")["data"]
        assert {(a["kind"], a["step"]) for a in artifacts} == {
            ("deepspeed", 4),
            ("deepspeed", 8),
            ("model", 8),
            ("log", None),
        }
        in_s3 = {
            o["Key"]: o["Size"]
            for o in loopback_s3.client().list_objects_v2(Bucket=ARTIFACTS_BUCKET, Prefix=f"separate/{job['id']}/")[
                "Contents"
            ]
        }
        assert in_s3 == {f"separate/{job['id']}/{a['path']}": a["size"] for a in artifacts}
        assert not (api_home / "runs" / job["id"]).exists()  # nothing of the job on the API's disk

        # The model over HTTP, as a user on another machine gets it; it loads with transformers.
        exported = tmp_path / "downloaded"
        for artifact in (a for a in artifacts if a["kind"] == "model"):
            got = service.client.get(f"/jobs/{job['id']}/artifacts/{artifact['path']}")
            assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == artifact["sha256"]
            target = exported / artifact["path"].removeprefix("model/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(got.content)
        check_exported_model(exported, home / "data" / "tiny-gpt-neo")

        # A download cut short resumes with Range; a range past the end and a path outside are refused.
        weights = next(a for a in artifacts if a["path"] == "model/model.safetensors")
        url = f"/jobs/{job['id']}/artifacts/model/model.safetensors"
        rest = service.client.get(url, headers={"Range": "bytes=1000-", "If-Range": f'"{weights["sha256"]}"'})
        assert (
            rest.status_code == 206
            and rest.headers["content-range"] == f"bytes 1000-{weights['size'] - 1}/{weights['size']}"
        )
        assert rest.content == (exported / "model.safetensors").read_bytes()[1000:]
        assert service.client.get(url, headers={"Range": f"bytes={weights['size']}-"}).status_code == 416
        for outside in ("model/../../../etc/passwd", "spec.json", "model/nothing.bin"):
            assert service.client.get(f"/jobs/{job['id']}/artifacts/{outside}").status_code == 404
    finally:
        service.stop()


def test_a_hugging_face_docs_config_with_auto_values(service: Tuneq, home: Path) -> None:
    """The ZeRO-3 config from the Hugging Face docs, "auto" everywhere, on 2 ranks."""
    from tests.shared.deepspeed.test_auto_values import HF_ZERO3

    training = {
        "epochs": 20,
        "max_steps": 10,
        "max_seq_length": 64,
        "micro_batch_size": 2,
        "learning_rate": 2e-3,
        "warmup_steps": 4,
        "precision": "bf16",
    }
    # A monitor writing to a path of the user's choosing is moved under the job's run directory.
    elsewhere = home.parent / "not-the-run-dir"
    config = {**HF_ZERO3, "csv_monitor": {"enabled": True, "output_path": str(elsewhere), "job_name": "x"}}
    job = service.submit(body(home, deepspeed_config=config, num_gpus=2, training=training))
    assert job["resolved_deepspeed_config"]["train_batch_size"] == 4
    assert job["resolved_deepspeed_config"]["scheduler"]["params"]["total_num_steps"] == "auto"
    job = service.wait(job["id"])
    metrics = check_succeeded(service, job, steps=10)
    resolved = job["resolved_deepspeed_config"]
    assert resolved["scheduler"]["params"]["total_num_steps"] == 10  # filled by the worker
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # the tiny model's hidden size
    rates = [m["learning_rate"] for m in metrics]
    assert rates[0] < rates[3] and max(rates) == pytest.approx(2e-3) and rates[-1] < max(rates)  # warmup, decay
    check_exported_model(exported_model(service, job), home / "data" / "tiny-gpt-neo")
    assert not elsewhere.exists()
    monitor = Path(resolved["csv_monitor"]["output_path"])
    assert monitor.is_relative_to(home / "runs" / job["id"]) and any(monitor.rglob("*.csv"))


def test_a_job_without_deepspeed_config_runs_the_config_tuneq_chooses(service: Tuneq, home: Path) -> None:
    """No DeepSpeed knowledge needed: the plan and the job show the chosen config, and it trains."""
    training = {"max_steps": 6, "max_seq_length": 64, "learning_rate": 2e-3, "warmup_steps": 2}
    request = job_body(home, "varied.jsonl", training=training)
    plan = service.client.post("/jobs/plan", json=request)
    assert plan.status_code == 200, plan.text
    assert plan.json()["deepspeed_config_chosen"] is True and plan.json()["total_steps"] == 6
    job = service.submit(request)
    chosen = job["deepspeed_config"]
    assert job["deepspeed_config_chosen"] is True
    # The tiny model on a CPU worker: ZeRO-2, nothing offloaded, bf16 (fp16 needs a GPU).
    assert chosen["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in chosen["zero_optimization"]
    assert chosen["bf16"] == {"enabled": True} and chosen["fp16"] == {"enabled": False}
    # What the choice planned for: the worker recorded its host memory and bf16 when it started.
    import sqlite3

    with sqlite3.connect(service.home / "tuneq.sqlite") as db:
        rows = db.execute("SELECT accelerator, device_memory_bytes, bf16_supported FROM workers").fetchall()
    assert rows and all(a == "cpu" and memory > 0 and bf16 == 1 for a, memory, bf16 in rows), rows
    job = service.wait(job["id"])
    metrics = check_succeeded(service, job, steps=6)
    resolved = job["resolved_deepspeed_config"]
    assert resolved["scheduler"]["type"] == "WarmupDecayLR"
    assert resolved["scheduler"]["params"]["total_num_steps"] == 6  # filled by the worker
    rates = [m["learning_rate"] for m in metrics]
    assert rates[0] < rates[1] == pytest.approx(2e-3) and rates[-1] < rates[1]  # warmup, then linear decay
    check_exported_model(exported_model(service, job), home / "data" / "tiny-gpt-neo")
