"""A job's ``model`` naming another job's output (``job:<id>``, ``job:<id>@step-<n>``, ``ft:`` names),
in process, on SQLite and on Postgres: what submit resolves and records, what it refuses (a 4xx
naming the field, no row), the plan, and OpenAI's door.

The worker's side (the weights fetched, merged or converted, then trained) is
tests/e2e/test_continue_from.py and tests/worker/rank/test_base_weights.py.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from api.model_sources import fine_tuned_model_name
from cli.samples import seed_config
from shared.artifacts.store import ArtifactStore, job_key
from shared.db.artifacts import commit_checkpoint
from shared.db.engine import get_engine
from shared.db.models import LOCAL_OWNER, CheckpointKind, Job, utcnow
from shared.jobs.model_source import parse_model_reference
from shared.jobs.status import JobStatus
from shared.settings import get_settings

# The exported model's own limit, which the base model's (256) is not: submit reads it from the store.
EXPORTED_POSITIONS = 96


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def add_job(*, model: str, owner: str = LOCAL_OWNER, status: JobStatus = JobStatus.succeeded, **values: Any) -> Job:
    job = Job(
        owner=owner,
        model=model,
        dataset="/data/train.jsonl",
        deepspeed_config=seed_config(fp16=False),
        num_gpus=1,
        status=status,
        **({"training": {}} | values),
    )
    with Session(get_engine()) as session:
        session.add(job)
        session.commit()
        session.refresh(job)
    return job


def publish(job: Job, directory: Path, *, kind: CheckpointKind, step: int, into: str) -> None:
    """Put ``directory``'s files in the store as the job's ``into/`` and commit them, as the
    worker's publisher does."""
    store = ArtifactStore.from_settings(get_settings())
    files = [
        (f"{into}/{path.name}", store.put_file(path, job_key(job.id, f"{into}/{path.name}")))
        for path in sorted(directory.iterdir())
        if path.is_file()
    ]
    with Session(get_engine()) as session:
        commit_checkpoint(
            session, job_id=job.id, kind=kind, step=step, uri=f"{job.id}/{into}", files=files, created_at=utcnow()
        )
        session.commit()


@pytest.fixture
def exported(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model as a job exported it: its config says fewer positions than the base's."""
    export = tmp_path / "export"
    shutil.copytree(tiny_model, export)
    config = json.loads((export / "config.json").read_text())
    config["max_position_embeddings"] = EXPORTED_POSITIONS
    (export / "config.json").write_text(json.dumps(config))
    return export


@pytest.fixture
def source(database_url: str, tiny_model: Path, exported: Path, tmp_path: Path) -> Job:
    """A succeeded full fine-tune of the tiny model: its export, and DeepSpeed checkpoints at 10 and 20."""
    job = add_job(model=str(tiny_model))
    publish(job, exported, kind=CheckpointKind.model, step=20, into="model")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"states")
    for step in (10, 20):
        publish(job, tmp_path / "ds", kind=CheckpointKind.deepspeed, step=step, into=f"checkpoints/step-{step:08d}")
    return job


def job_rows() -> int:
    with Session(get_engine()) as session:
        return int(session.exec(select(func.count()).select_from(Job)).one())


def submit(client: TestClient, body: dict[str, Any], **fields: Any) -> Any:
    return client.post("/jobs", json={**body, "deepspeed_config": seed_config(fp16=False)} | fields)


def refusal(client: TestClient, body: dict[str, Any], **fields: Any) -> dict[str, str]:
    """The 422's messages by field, having checked it left no row behind."""
    before = job_rows()
    answer = submit(client, body, **fields)
    assert answer.status_code == 422, answer.text
    assert job_rows() == before
    return {".".join(map(str, p["loc"])): p["msg"] for p in answer.json()["detail"]}


def test_the_forms_parse_and_malformed_ones_say_what_the_forms_are() -> None:
    job_id = uuid.uuid4()
    assert parse_model_reference(f"job:{job_id}").job_id == job_id
    assert parse_model_reference(f"job:{job_id.hex}@step-20").step == 20
    named = parse_model_reference(f"ft:tiny-gpt-neo:alice:weather:{job_id.hex[:12]}:ckpt-step-8")
    assert (named.fine_tuned_name, named.id_prefix, named.step) == (
        f"ft:tiny-gpt-neo:alice:weather:{job_id.hex[:12]}",
        job_id.hex[:12],
        8,
    )
    for bad in (
        "job:42",
        f"job:{job_id}@step-0",
        f"job:{job_id}@20",
        "ft:tiny-gpt-neo",
        f"ft:x:a:b:{job_id.hex[:12]}:x",
    ):
        with pytest.raises(ValueError, match=r"job:<job id>|ft:<base>:<owner>:<suffix>:<id>"):
            parse_model_reference(bad)


def test_a_job_names_another_jobs_exported_model_and_its_config_comes_from_the_store(
    client: TestClient, body: dict[str, Any], source: Job, tiny_model: Path
) -> None:
    answer = submit(client, body, model=f"job:{source.id}")
    assert answer.status_code == 201, answer.text
    job = answer.json()
    assert job["model"] == f"job:{source.id}"
    expected = {"job_id": str(source.id), "kind": "model", "step": 20, "base_model": str(tiny_model)}
    assert job["model_source"] == expected
    # max_seq_length follows the exported model's config.json, read from the store.
    assert job["training"]["max_seq_length"] == EXPORTED_POSITIONS

    # Its ft: name, as /v1 gives it, names the same; so does a checkpoint, by either spelling.
    by_name = submit(client, body, model=fine_tuned_model_name(source)).json()
    assert by_name["model_source"] == expected
    at_step = submit(client, body, model=f"job:{source.id}@step-10").json()
    assert at_step["model_source"] == expected | {"kind": "deepspeed", "step": 10}
    checkpoint = submit(client, body, model=f"{fine_tuned_model_name(source)}:ckpt-step-10").json()
    assert checkpoint["model_source"] == at_step["model_source"]

    # A job continued from that job is named after the base model the chain started from.
    with Session(get_engine()) as session:
        second = session.get(Job, uuid.UUID(job["id"]))
        assert second is not None
        assert fine_tuned_model_name(second).startswith("ft:tiny-gpt-neo:local::")


def test_a_lora_jobs_adapter_is_named_when_it_exported_no_merged_model(
    client: TestClient, body: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    lora = add_job(model=str(tiny_model), training={"lora": {"r": 4}})
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter")
    publish(lora, tmp_path / "adapter", kind=CheckpointKind.adapter, step=8, into="adapter")
    answer = submit(client, body, model=f"job:{lora.id}")
    assert answer.status_code == 201, answer.text
    assert answer.json()["model_source"] == {
        "job_id": str(lora.id),
        "kind": "adapter",
        "step": 8,
        "base_model": str(tiny_model),
    }
    # The adapter changes no shape: the config is the base's, whose 256 positions max_seq_length follows.
    assert answer.json()["training"]["max_seq_length"] == 256


def test_another_owners_job_is_refused_in_the_words_of_a_missing_one(
    client: TestClient, body: dict[str, Any], tiny_model: Path, exported: Path
) -> None:
    bobs = add_job(model=str(tiny_model), owner="bob")
    publish(bobs, exported, kind=CheckpointKind.model, step=20, into="model")
    missing = uuid.uuid4()
    theirs = refusal(client, body, model=f"job:{bobs.id}")["body.model"]
    nobodys = refusal(client, body, model=f"job:{missing}")["body.model"]
    assert theirs.replace(str(bobs.id), "<id>") == nobodys.replace(str(missing), "<id>")
    assert theirs == f"job {bobs.id} not found: name one of your jobs (GET /jobs lists them)"
    by_name = refusal(client, body, model=fine_tuned_model_name(bobs))["body.model"]
    assert (
        by_name
        == f"fine-tuned model '{fine_tuned_model_name(bobs)}' not found: name one of yours (GET /v1/models lists them)"
    )


def test_what_cannot_be_continued_from_is_a_422_naming_the_field(
    client: TestClient, body: dict[str, Any], source: Job, tiny_model: Path
) -> None:
    running = add_job(model=str(tiny_model), status=JobStatus.running)
    assert refusal(client, body, model=f"job:{running.id}")["body.model"] == (
        f"job {running.id} is running: a job's output can be continued from once the job has succeeded"
    )
    nothing = add_job(model=str(tiny_model))
    assert "has no exported model or adapter" in refusal(client, body, model=f"job:{nothing.id}")["body.model"]
    no_step = refusal(client, body, model=f"job:{source.id}@step-15")["body.model"]
    assert no_step.startswith(f"job {source.id} has no DeepSpeed checkpoint at step 15 (it has 10, 20)")
    with_revision = refusal(client, body, model=f"job:{source.id}", revision="main")
    assert "drop revision" in with_revision["body.revision"] and "body.model" not in with_revision
    assert "job:<job id>@step-<n>" in refusal(client, body, model="job:latest")["body.model"]


def test_a_changed_config_in_the_store_is_refused(client: TestClient, body: dict[str, Any], source: Job) -> None:
    store = ArtifactStore.from_settings(get_settings())
    path = store.local_path(job_key(source.id, "model/config.json"))
    assert path is not None
    path.write_text('{"max_position_embeddings": 4096}')
    problem = refusal(client, body, model=f"job:{source.id}")["body.model"]
    assert "is not the file that was published" in problem and "cannot be continued from" in problem


def test_the_plan_of_a_job_on_another_jobs_output(
    client: TestClient, body: dict[str, Any], source: Job, text_dataset: Path
) -> None:
    answer = client.post(
        "/jobs/plan",
        json={
            **body,
            "model": f"job:{source.id}",
            "dataset": str(text_dataset),
            "deepspeed_config": seed_config(fp16=False),
        },
    )
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    assert plan["parameters"] > 0 and plan["total_steps"] > 0
    refused = client.post("/jobs/plan", json={**body, "model": f"job:{source.id}@step-3"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "model"]


def upload(client: TestClient) -> str:
    record = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    content = "".join(json.dumps(record) + "\n" for _ in range(10)).encode()
    answer = client.post(
        "/v1/files", files={"file": ("train.jsonl", content, "application/jsonl")}, data={"purpose": "fine-tune"}
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def test_openais_door_takes_ft_names_and_checkpoint_names(
    client: TestClient, source: Job, tiny_model: Path, exported: Path
) -> None:
    name = fine_tuned_model_name(source)
    file_id = upload(client)
    created = client.post("/v1/fine_tuning/jobs", json={"model": name, "training_file": file_id, "suffix": "again"})
    assert created.status_code == 200, created.text
    assert created.json()["model"] == name  # as the caller named it, as OpenAI shows it
    job_id = uuid.UUID(created.json()["id"].removeprefix("ftjob-"))
    with Session(get_engine()) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.model_source is not None
        assert job.model_source["kind"] == "model" and job.model_source["job_id"] == str(source.id)
        # Its own fine-tuned model is named after the base model, not after the one it continued.
        assert fine_tuned_model_name(job) == f"ft:tiny-gpt-neo:local:again:{job_id.hex[:12]}"

    checkpoint = f"{name}:ckpt-step-10"
    from_checkpoint = client.post("/v1/fine_tuning/jobs", json={"model": checkpoint, "training_file": file_id})
    assert from_checkpoint.status_code == 200, from_checkpoint.text
    retrieved = client.get(f"/v1/models/{checkpoint}")
    assert retrieved.status_code == 200, retrieved.text
    assert retrieved.json()["id"] == checkpoint and retrieved.json()["owned_by"] == LOCAL_OWNER
    assert client.get(f"/v1/models/{name}:ckpt-step-15").status_code == 404

    # Another owner's fine-tuned model: OpenAI's 400 naming model, in the words of a missing one.
    bobs = add_job(model=str(tiny_model), owner="bob")
    publish(bobs, exported, kind=CheckpointKind.model, step=20, into="model")
    before = job_rows()
    refused = client.post("/v1/fine_tuning/jobs", json={"model": fine_tuned_model_name(bobs), "training_file": file_id})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "model" and "not found: name one of yours" in error["message"]
    assert job_rows() == before
    assert client.get(f"/v1/models/{fine_tuned_model_name(bobs)}:ckpt-step-20").status_code == 404
