"""Record formats, file types, packing, validation data and the tokenized cache, end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cli.samples import (
    seed_config,
    write_messages_dataset,
    write_prompt_completion_dataset,
    write_text_dataset,
)
from tests.services import S3_CREDENTIALS, LoopbackS3

from .harness import Tuneq, job_body

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    data = home / "data"
    write_text_dataset(data / "text.jsonl", records=200)
    write_prompt_completion_dataset(data / "qa.jsonl", records=60)
    # Every fourth conversation calls a tool, after a turn not trained on (weight 0).
    conversations = write_messages_dataset(data / "chat.jsonl", records=60)
    rows = [json.loads(line) for line in conversations.read_text(encoding="utf-8").splitlines()]
    pq.write_table(pa.Table.from_pylist(rows[:48]), data / "chat-train.parquet")
    write_messages_dataset(data / "chat-eval.jsonl", records=8, seed=5)
    # The tiny model with a chat template that knows nothing of tools.
    tokenizer = AutoTokenizer.from_pretrained(data / "tiny-gpt-neo")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    shutil.copytree(data / "tiny-gpt-neo", data / "tiny-no-tools")
    tokenizer.save_pretrained(data / "tiny-no-tools")
    return home


@pytest.fixture(scope="module")
def s3_endpoint(home: Path, loopback_s3: LoopbackS3) -> str:
    """A real S3 API on loopback (moto's server), holding one good and one bad dataset."""
    client = loopback_s3.client()
    client.create_bucket(Bucket="corpus")
    client.upload_file(str(home / "data" / "qa.jsonl"), "corpus", "sets/qa.jsonl")
    client.put_object(
        Bucket="corpus", Key="sets/bad.jsonl", Body=b'{"prompt": "q", "completion": "a"}\n{"prompt": 1}\n'
    )
    return loopback_s3.endpoint


@pytest.fixture(scope="module")
def service_env(s3_endpoint: str) -> dict[str, str]:
    """The service reads ``s3://`` datasets from the loopback S3 above, with its test credentials."""
    return {**S3_CREDENTIALS, "TUNEQ_S3_ENDPOINT_URL": s3_endpoint}


def run(service: Tuneq, home: Path, dataset: str, **fields: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = service.wait(service.submit(body(home, dataset, **fields))["id"], timeout=300)
    assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
    return job, service.get(f"/jobs/{job['id']}/metrics")["data"]


def body(home: Path, dataset: str, **fields: Any) -> dict[str, Any]:
    return job_body(home, dataset, deepspeed_config=seed_config(fp16=False, train_batch_size=2, lr=1e-3)) | fields


def test_prompt_completion_with_a_validation_split(service: Tuneq, home: Path) -> None:
    training = {"max_steps": 6, "max_seq_length": 64, "validation_split": 0.2, "eval_every_steps": 3}
    job, metrics = run(service, home, "qa.jsonl", training=training)
    stats = job["dataset_stats"]
    assert stats["train"]["format"] == "prompt_completion" and stats["train"]["records"] == 60
    assert stats["validation_samples"] == 12
    assert stats["train"]["target_tokens"] < stats["train"]["tokens"]  # the prompts are not trained on
    evaluated = {m["step"]: m["eval_loss"] for m in metrics if m["eval_loss"] is not None}
    assert sorted(evaluated) == [3, 6] and all(0 < loss < 20 for loss in evaluated.values())
    assert all(0 < m["real_token_share"] <= 1 for m in metrics)


def test_messages_from_parquet_on_two_ranks_packed_with_a_validation_file(service: Tuneq, home: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=2, zero_stage=3, lr=1e-3)
    job, metrics = run(
        service,
        home,
        "chat-train.parquet",
        num_gpus=2,
        deepspeed_config=config,
        validation_dataset=str(home / "data" / "chat-eval.jsonl"),
        training={"max_steps": 4, "max_seq_length": 128, "packing": True},
    )
    stats = job["dataset_stats"]
    assert stats["train"]["format"] == "messages" and stats["train"]["records"] == 48 == stats["train"]["samples"]
    assert stats["validation"]["format"] == "messages" and stats["validation"]["records"] == 8
    assert [m["step"] for m in metrics if m["eval_loss"] is not None] == [4]
    assert job["total_steps"] == 4
    events = service.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
    [plan] = [e["data"] for e in events if e["type"] == "plan"]
    # ZeRO-3 built the model partitioned (zero.Init through HfDeepSpeedConfig): no rank held it whole.
    assert plan["model_load"] == "partitioned" and plan["world_size"] == 2 and plan["packing"] is True


def test_text_is_packed_by_default_and_tokenized_once(service: Tuneq, home: Path) -> None:
    training = {"max_steps": 5, "max_seq_length": 64}
    job, metrics = run(service, home, "text.jsonl", training=training)
    assert job["dataset_stats"]["train"]["cached"] is False
    packed_share = sum(m["real_token_share"] for m in metrics) / len(metrics)
    _, unpacked = run(service, home, "text.jsonl", training={**training, "packing": False})
    unpacked_share = sum(m["real_token_share"] for m in unpacked) / len(unpacked)
    assert packed_share > 0.9 > unpacked_share
    # Padding-free: the unpacked job's samples and steps, end to end in one row, so its losses.
    flat_job, flat = run(service, home, "text.jsonl", training={**training, "packing": False, "padding_free": True})
    assert flat_job["dataset_stats"]["padding_free"] is True and flat_job["total_steps"] == len(unpacked)
    assert sum(m["real_token_share"] for m in flat) / len(flat) > unpacked_share
    assert [m["loss"] for m in flat] == pytest.approx([m["loss"] for m in unpacked], rel=1e-3)
    again, _ = run(service, home, "text.jsonl", training={**training, "max_steps": 2})
    assert again["dataset_stats"]["train"]["cached"] is True
    assert again["dataset_stats"]["train"]["tokens"] == job["dataset_stats"]["train"]["tokens"]


def test_s3_dataset_is_downloaded_once_with_progress_and_bad_records_fail_fast(service: Tuneq, home: Path) -> None:
    training = {"max_steps": 3, "max_seq_length": 64}
    job, _ = run(service, home, "s3://corpus/sets/qa.jsonl", training=training)
    assert job["dataset_stats"]["train"]["records"] == 60
    events = service.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
    downloads = [e["data"] for e in events if e["type"] == "download"]
    assert downloads[-1]["finished"] and downloads[-1]["bytes_done"] == (home / "data" / "qa.jsonl").stat().st_size
    assert downloads[-1]["uri"] == "s3://corpus/sets/qa.jsonl"
    # A second job finds the download and the tokenized data in the caches.
    again, _ = run(service, home, "s3://corpus/sets/qa.jsonl", training=training)
    assert again["dataset_stats"]["train"]["cached"] is True

    bad = service.wait(service.submit(body(home, "s3://corpus/sets/bad.jsonl", training=training))["id"], timeout=120)
    assert bad["status"] == "failed" and bad["error"]["code"] == "invalid_input"
    assert 'line 2 field "prompt" must be a string' in bad["error"]["message"]
    assert bad["started_at"] is not None and not (Path(service.home) / "runs" / bad["id"] / "train.log").exists()
    missing = service.wait(service.submit(body(home, "s3://corpus/sets/nope.jsonl"))["id"], timeout=120)
    assert missing["status"] == "failed" and missing["error"]["code"] == "invalid_input"
    assert "nope.jsonl" in missing["error"]["message"]


def test_plan_matches_the_run_that_follows(service: Tuneq, home: Path) -> None:
    from transformers import AutoModelForCausalLM

    request = body(
        home,
        "qa.jsonl",
        deepspeed_config={**seed_config(fp16=False, train_batch_size=4), "gradient_accumulation_steps": 2},
        training={"epochs": 2, "max_seq_length": 64, "validation_split": 0.25, "packing": True},
    )
    jobs_before = service.get("/jobs")["count"]
    answer = service.client.post("/jobs/plan", json=request)
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    assert service.get("/jobs")["count"] == jobs_before  # a plan makes no job
    model = AutoModelForCausalLM.from_pretrained(home / "data" / "tiny-gpt-neo")
    assert plan["parameters"] == plan["trainable_parameters"] == sum(p.numel() for p in model.parameters())
    assert (plan["train_batch_size"], plan["micro_batch_per_gpu"], plan["gradient_accumulation_steps"]) == (4, 2, 2)
    # ZeRO-2 with the optimizer on the CPU: DeepSpeed's estimator says 2 bytes per parameter on the device.
    assert plan["memory"]["zero_stage"] == 2 and plan["memory"]["offload_optimizer"] is True
    assert plan["memory"]["per_device_bytes"] == 2 * plan["parameters"]

    job = service.wait(service.submit(request)["id"], timeout=300)
    assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
    events = service.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
    [ran] = [e["data"] for e in events if e["type"] == "plan"]
    assert plan["total_steps"] == job["total_steps"] == job["step"] == 2 * plan["steps_per_epoch"]
    assert plan["steps_per_epoch"] == ran["steps_per_epoch"]
    assert plan["resolved_deepspeed_config"] == job["resolved_deepspeed_config"]
    stats = job["dataset_stats"]
    assert stats["train"]["cached"] is True  # the plan tokenized it; the run found it in the cache
    for part in ("train", "validation"):
        if stats[part] is not None:
            stats[part]["cached"] = plan["dataset_stats"][part]["cached"]
    assert plan["dataset_stats"] == stats


def test_plan_refuses_what_the_run_would(service: Tuneq, home: Path) -> None:
    bad_lora = body(home, "qa.jsonl", training={"lora": {"target_modules": ["nope"]}})
    answer = service.client.post("/jobs/plan", json=bad_lora)
    assert answer.status_code == 422
    [problem] = answer.json()["detail"]
    assert problem["loc"] == ["body", "training", "lora"] and "q_proj" in problem["msg"]
    missing = service.client.post("/jobs/plan", json=body(home, "nope.jsonl"))
    assert missing.status_code == 422 and "does not exist" in missing.text

    # Tool calls for a model whose chat template has no tool support: refused by the plan, and
    # the job fails as the user's error, naming the first such record.
    no_tools = body(home, "chat.jsonl", model=str(home / "data" / "tiny-no-tools"))
    answer = service.client.post("/jobs/plan", json=no_tools)
    assert answer.status_code == 422
    [problem] = answer.json()["detail"]
    refusal = "dataset: chat.jsonl: line 4 has a tools list and tool calls, but the model's chat template does not"
    assert problem["loc"] == ["body", "dataset"] and problem["msg"].startswith(refusal)
    assert "pick a model whose chat template supports tools" in problem["msg"]
    failed = service.wait(service.submit(no_tools)["id"], timeout=300)
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_input"
    assert failed["error"]["message"].startswith(refusal) and "Traceback" not in failed["error"]["message"]
