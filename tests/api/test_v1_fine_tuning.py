"""OpenAI's fine-tuning jobs at /v1/fine_tuning/jobs, in process, on SQLite and on Postgres.

The official SDK against a real ``tuneq dev`` that trains is tests/e2e/test_openai_fine_tuning.py;
here the translation into a native job, the shapes, the lists and their cursors, the errors and
what a refused request leaves behind (nothing) are checked request by request.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types.fine_tuning import DpoHyperparametersParam
from sqlmodel import Session, func, select

from api.v1.hyperparameters import pretraining_learning_rate
from shared.artifacts.store import ArtifactStore, job_key
from shared.db.artifacts import commit_checkpoint
from shared.db.engine import get_engine
from shared.db.models import Checkpoint, CheckpointKind, EventType, File, Job, JobEvent, JobMetric, utcnow
from shared.jobs.status import JobStatus
from shared.settings import get_settings
from tests.shared.data.preference_records import OPENAI_DPO

RECORD = {
    "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Cold."},
    ]
}
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def upload(client: TestClient, records: int = 10, record: dict[str, Any] = RECORD) -> str:
    content = "".join(json.dumps(record) + "\n" for _ in range(records)).encode()
    answer = client.post(
        "/v1/files", files={"file": ("train.jsonl", content, "application/jsonl")}, data={"purpose": "fine-tune"}
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def create(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/fine_tuning/jobs", json=body)


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body.keys() == {"error"} and body["error"].keys() == ENVELOPE_KEYS, body
    return dict(body["error"])


def job_rows() -> int:
    with Session(get_engine()) as session:
        return int(session.exec(select(func.count()).select_from(Job)).one())


def native(client: TestClient, fine_tuning_job_id: str) -> dict[str, Any]:
    answer = client.get(f"/jobs/{uuid.UUID(fine_tuning_job_id.removeprefix('ftjob-'))}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_auto_hyperparameters_are_resolved_from_the_file_and_the_job_is_a_native_one(
    client: TestClient, model_dir: Path
) -> None:
    file_id = upload(client, records=10)
    answer = create(client, model=str(model_dir), training_file=file_id, suffix="weather", metadata={"team": "a"})
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert re.fullmatch(r"ftjob-[0-9a-f]{32}", job["id"])
    # 10 examples: epochs so that at least 100 are seen, 0.2 % of them as a batch (at least 1),
    # and the smallest batch's multiplier.
    resolved = {"n_epochs": 10, "batch_size": 1, "learning_rate_multiplier": 0.05}
    assert job | {"id": None, "created_at": None, "seed": None} == {
        "id": None,
        "object": "fine_tuning.job",
        "created_at": None,
        "finished_at": None,
        "model": str(model_dir),
        "fine_tuned_model": None,
        "organization_id": "local",
        "status": "queued",
        "training_file": file_id,
        "validation_file": None,
        "hyperparameters": resolved,
        "method": {"type": "supervised", "supervised": {"hyperparameters": resolved}},
        "result_files": [],
        "trained_tokens": None,
        "error": None,
        "seed": None,
        "estimated_finish": None,
        "metadata": {"team": "a"},
        "user_provided_suffix": "weather",
        "integrations": None,
    }
    assert 0 <= job["seed"] < 2**31
    # The same job on the native API: the file as its dataset, a config tuneq chose.
    same = native(client, job["id"])
    assert same["dataset"] == file_id and same["deepspeed_config_chosen"] is True
    assert same["training"]["epochs"] == 10 and same["training"]["seed"] == job["seed"]
    assert same["training"]["learning_rate"] == pytest.approx(0.05 * pretraining_learning_rate({}))
    assert same["training"]["keep_checkpoints"] == 3 and same["training"]["checkpoint_every_steps"] == 10
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job


def test_given_hyperparameters_set_the_batch_layout_and_the_learning_rate(client: TestClient, model_dir: Path) -> None:
    file_id = upload(client, records=40)
    hyperparameters = {"n_epochs": 2, "batch_size": 12, "learning_rate_multiplier": 0.5}
    answer = create(
        client,
        model=str(model_dir),
        training_file=file_id,
        validation_file=file_id,
        seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    )
    assert answer.status_code == 200, answer.text
    job = answer.json()
    assert job["hyperparameters"] == {**hyperparameters, "learning_rate_multiplier": 0.5}
    assert (job["seed"], job["validation_file"]) == (7, file_id)
    training = native(client, job["id"])["training"]
    # No worker seen: one device, so each step is 12 examples as micro-batches of 6, twice.
    assert (training["micro_batch_size"], training["gradient_accumulation_steps"]) == (6, 2)
    assert training["learning_rate"] == pytest.approx(0.5 * pretraining_learning_rate({}))
    assert training["eval_every_steps"] == training["checkpoint_every_steps"] == 3  # 40 examples / 12: each epoch
    # The deprecated top-level place works too.
    top = create(client, model=str(model_dir), training_file=file_id, hyperparameters={"n_epochs": 1})
    assert top.status_code == 200 and top.json()["hyperparameters"]["n_epochs"] == 1


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"training_file": "file-" + "x" * 24}, "training_file", "no file"),
        ({"training_file": "train.jsonl"}, "training_file", "no file"),
        ({"validation_file": "file-" + "y" * 24}, "validation_file", "no file"),
        ({"method": {"type": "reinforcement"}}, "method.type", "not one tuneq runs yet: use 'supervised' or 'dpo'"),
        ({"method": {"type": "dpo"}}, "training_file", "which method 'dpo' cannot train on"),
        ({"method": {"type": "supervised", "dpo": {}}}, "method.dpo", "is for method.type 'dpo', not 'supervised'"),
        ({"method": {"type": "dpo", "supervised": {}}}, "method.supervised", "set method.type to 'supervised'"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "between 1 and 50"),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 11}}}},
            "method.supervised.hyperparameters.batch_size",
            "more than the 10 examples",
        ),
        (
            {
                "hyperparameters": {"n_epochs": 1},
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
            },
            "hyperparameters",
            "once",
        ),
        ({"hyperparameters": {"learning_rate_multiplier": 11}}, "hyperparameters.learning_rate_multiplier", "at most"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations", "not supported"),
        ({"model": "/no/such/model"}, "model", "/no/such/model"),
        ({"suffix": "a b"}, "suffix", "pattern"),
        ({"seed": "7"}, "seed", "integer"),
        ({"n_epochs": 3}, "n_epochs", "Extra inputs"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_parameter_and_leaves_no_job(
    client: TestClient, model_dir: Path, body: dict[str, Any], param: str, words: str
) -> None:
    file_id = upload(client, records=10)
    request = {"model": str(model_dir), "training_file": file_id} | body
    refused = error_of(create(client, **request), 400)
    assert refused["param"] == param and words in refused["message"], refused
    assert refused["type"] == "invalid_request_error"
    assert job_rows() == 0


def test_a_supervised_job_on_a_dpo_file_is_a_400_naming_the_method_and_leaves_no_job(
    client: TestClient, model_dir: Path, body: dict[str, Any]
) -> None:
    dpo = upload(client, record=OPENAI_DPO)  # accepted at upload, as OpenAI accepts it
    chat = upload(client)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"training_file": dpo}, "training_file"),
        ({"training_file": dpo, "method": {"type": "supervised"}}, "training_file"),
        ({"training_file": chat, "validation_file": dpo}, "validation_file"),
    ]
    for request, param in cases:
        refused = error_of(create(client, model=str(model_dir), **request), 400)
        assert refused["param"] == param, refused
        assert refused["message"] == (
            f"{param} {dpo} holds preference records (OpenAI's DPO format: input, preferred_output, "
            "non_preferred_output), which method 'supervised' cannot train on: a supervised job trains on chat "
            'records like {"messages": [...]}; upload such a file, or train this one with method {"type": "dpo"}'
        ), refused
    # The native API refuses it as a dataset too, naming the field and the method.
    native = client.post("/jobs", json=body | {"dataset": dpo})
    assert native.status_code == 422, native.text
    problem = native.json()["detail"][0]
    assert problem["loc"] == ["body", "dataset"]
    assert problem["msg"].startswith(f"file {dpo} holds preference records (uploaded in OpenAI's DPO format")
    assert "which a supervised fine-tuning (SFT) job cannot train on" in problem["msg"]
    assert job_rows() == 0


def test_a_dpo_job_on_a_chat_file_is_a_400_naming_the_method_and_leaves_no_job(
    client: TestClient, model_dir: Path, body: dict[str, Any]
) -> None:
    dpo = upload(client, record=OPENAI_DPO)
    chat = upload(client)
    for request, param in [
        ({"training_file": chat}, "training_file"),
        ({"training_file": dpo, "validation_file": chat}, "validation_file"),
    ]:
        refused = error_of(create(client, model=str(model_dir), method={"type": "dpo"}, **request), 400)
        assert refused["param"] == param, refused
        assert refused["message"].startswith(
            f"{param} {chat} holds chat records (OpenAI's chat format: messages), which method 'dpo' cannot train "
            'on: a DPO job trains on preference records like {"input": {"messages": '
        ), refused
        assert refused["message"].endswith("upload such a file, or train this one with method 'supervised'")
    # The native API: a DPO job's dataset must be a DPO upload, an SFT job's must not.
    for field in ("dataset", "validation_dataset"):
        native = client.post("/jobs", json=body | {"dataset": dpo, field: chat, "training": {"method": "dpo"}})
        assert native.status_code == 422, native.text
        (problem,) = native.json()["detail"]
        assert problem["loc"] == ["body", field]
        assert problem["msg"].startswith(
            f"file {chat} holds supervised records (uploaded in OpenAI's chat format: messages), for supervised "
            "fine-tuning (SFT), which a DPO job cannot train on: a DPO job trains on preference records, like"
        ), problem
    assert job_rows() == 0
    accepted = client.post("/jobs", json=body | {"dataset": dpo, "training": {"method": "dpo"}})
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["training"]["method"] == "dpo" and accepted.json()["training"]["dpo"]["beta"] == 0.1


def test_the_sdk_creates_a_dpo_job_from_an_openai_dpo_file_with_a_tool_call(
    client: TestClient, model_dir: Path
) -> None:
    """The unmodified official SDK, over the app's HTTP (its http_client is the test client)."""
    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="local", http_client=client, max_retries=0)
    assert OPENAI_DPO["preferred_output"][0]["tool_calls"]  # the preferred answer calls a tool
    content = "".join(json.dumps(OPENAI_DPO) + "\n" for _ in range(10)).encode()
    file = sdk.files.create(file=("dpo.jsonl", content), purpose="fine-tune")
    auto: DpoHyperparametersParam = {
        "beta": "auto",
        "batch_size": "auto",
        "learning_rate_multiplier": "auto",
        "n_epochs": "auto",
    }
    job = sdk.fine_tuning.jobs.create(
        model=str(model_dir), training_file=file.id, method={"type": "dpo", "dpo": {"hyperparameters": auto}}
    )
    # 10 pairs, resolved as 10 supervised examples are; beta "auto" is 0.1.
    resolved = {"n_epochs": 10, "batch_size": 1, "learning_rate_multiplier": 0.05}
    assert job.status == "queued" and job.training_file == file.id
    assert job.method is not None and job.method.type == "dpo" and job.method.supervised is None
    assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
    assert job.method.dpo.hyperparameters.model_dump() == {**resolved, "beta": 0.1}
    assert job.hyperparameters.model_dump() == resolved  # OpenAI's deprecated place: the shared three
    assert sdk.fine_tuning.jobs.retrieve(job.id) == job
    assert [j.id for j in sdk.fine_tuning.jobs.list()] == [job.id]
    shown = client.get(f"/v1/fine_tuning/jobs/{job.id}").json()
    assert shown["method"] == {"type": "dpo", "dpo": {"hyperparameters": {**resolved, "beta": 0.1}}}
    assert shown["hyperparameters"] == resolved
    # The native job: DPO with that beta and DPO's other defaults.
    training = native(client, job.id)["training"]
    assert training["method"] == "dpo" and training["packing"] is None
    assert training["dpo"] == {
        "beta": 0.1,
        "loss_type": "sigmoid",
        "sft_weight": 0.0,
        "label_smoothing": 0.0,
        "normalize_by_length": False,
    }
    assert (training["epochs"], training["micro_batch_size"], training["gradient_accumulation_steps"]) == (10, 1, 1)
    assert training["learning_rate"] == pytest.approx(0.05 * pretraining_learning_rate({}))

    # Given values are kept; the method left without hyperparameters is all "auto".
    given: DpoHyperparametersParam = {"beta": 0.5, "batch_size": 2, "learning_rate_multiplier": 0.2, "n_epochs": 1}
    second = sdk.fine_tuning.jobs.create(
        model=str(model_dir), training_file=file.id, method={"type": "dpo", "dpo": {"hyperparameters": given}}
    )
    assert second.method is not None and second.method.dpo is not None and second.method.dpo.hyperparameters
    assert second.method.dpo.hyperparameters.model_dump() == given
    assert native(client, second.id)["training"]["dpo"]["beta"] == 0.5
    bare = sdk.fine_tuning.jobs.create(model=str(model_dir), training_file=file.id, method={"type": "dpo"})
    assert bare.method is not None and bare.method.dpo is not None and bare.method.dpo.hyperparameters
    assert bare.method.dpo.hyperparameters.beta == 0.1

    # The wrong file for the method: OpenAI's 400, naming the file's parameter and the method.
    chat = sdk.files.create(file=("chat.jsonl", json.dumps(RECORD).encode() + b"\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as on_chat:
        sdk.fine_tuning.jobs.create(model=str(model_dir), training_file=chat.id, method={"type": "dpo"})
    assert on_chat.value.param == "training_file" and "which method 'dpo' cannot train on" in on_chat.value.message
    with pytest.raises(openai.BadRequestError) as on_dpo:
        sdk.fine_tuning.jobs.create(model=str(model_dir), training_file=file.id, method={"type": "supervised"})
    assert on_dpo.value.param == "training_file"
    assert "which method 'supervised' cannot train on" in on_dpo.value.message
    assert job_rows() == 3


@pytest.mark.parametrize(
    ("method", "top", "param", "words"),
    [
        ({"hyperparameters": {"beta": 0}}, None, "method.dpo.hyperparameters.beta", "more than 0 and at most 2"),
        ({"hyperparameters": {"beta": 2.5}}, None, "method.dpo.hyperparameters.beta", "more than 0 and at most 2"),
        ({"hyperparameters": {"beta": "high"}}, None, "method.dpo.hyperparameters.beta", "'auto' or a number"),
        ({"hyperparameters": {"batch_size": 11}}, None, "method.dpo.hyperparameters.batch_size", "the 10 examples"),
        ({"hyperparameters": {"n_epochs": 51}}, None, "method.dpo.hyperparameters.n_epochs", "between 1 and 50"),
        ({"hyperparameters": {"gamma": 1}}, None, "method.dpo.hyperparameters.gamma", "Extra inputs"),
        ({}, {"n_epochs": 2}, "hyperparameters", "under method.dpo.hyperparameters"),
    ],
)
def test_a_bad_dpo_request_is_a_400_naming_the_parameter_and_leaves_no_job(
    client: TestClient,
    model_dir: Path,
    method: dict[str, Any],
    top: dict[str, Any] | None,
    param: str,
    words: str,
) -> None:
    request: dict[str, Any] = {
        "model": str(model_dir),
        "training_file": upload(client, record=OPENAI_DPO),
        "method": {"type": "dpo", "dpo": method},
    }
    if top is not None:
        request["hyperparameters"] = top
    refused = error_of(create(client, **request), 400)
    assert refused["param"] == param and words in refused["message"], refused
    assert job_rows() == 0


def test_a_body_that_is_not_strict_json_is_a_400_in_the_envelope(client: TestClient, model_dir: Path) -> None:
    body = '{"model": "m", "training_file": "f", "seed": NaN}'
    answer = client.post("/v1/fine_tuning/jobs", content=body, headers={"Content-Type": "application/json"})
    refused = error_of(answer, 400)
    assert "NaN" in refused["message"] and refused["param"] == "seed"
    # The native API still answers it as a 422.
    native = client.post("/jobs", content=body, headers={"Content-Type": "application/json"})
    assert native.status_code == 422 and native.json()["detail"][0]["loc"] == ["body", "seed"]


def test_jobs_are_listed_newest_first_a_page_at_a_time_and_by_metadata(client: TestClient, model_dir: Path) -> None:
    file_id = upload(client)
    ids = [
        create(client, model=str(model_dir), training_file=file_id, metadata={"team": team, "n": str(n)}).json()["id"]
        for n, team in enumerate(["a", "b", "a"])
    ]
    first = client.get("/v1/fine_tuning/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["data"]] == [ids[2], ids[1]] and first["has_more"] is True
    rest = client.get("/v1/fine_tuning/jobs", params={"limit": 2, "after": ids[1]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    team_a = client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a"}).json()
    assert [j["id"] for j in team_a["data"]] == [ids[2], ids[0]]
    both = client.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a", "metadata[n]": "0"}).json()
    assert [j["id"] for j in both["data"]] == [ids[0]]
    refused = error_of(client.get("/v1/fine_tuning/jobs", params={"after": "ftjob-" + "0" * 32}), 400)
    assert refused["param"] == "after"


def test_another_owner_s_or_a_missing_job_is_a_404(client: TestClient) -> None:
    for path in (
        "ftjob-" + "0" * 32,
        "nonsense",
        "ftjob-" + "0" * 32 + "/events",
        "ftjob-" + "0" * 32 + "/checkpoints",
    ):
        assert error_of(client.get(f"/v1/fine_tuning/jobs/{path}"), 404)["param"] == "id"
    assert error_of(client.post(f"/v1/fine_tuning/jobs/ftjob-{'0' * 32}/cancel"), 404)["param"] == "id"


def test_cancel_and_the_events_it_leaves_newest_first(client: TestClient, model_dir: Path) -> None:
    file_id = upload(client)
    job = create(client, model=str(model_dir), training_file=file_id).json()
    cancelled = client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert native(client, job["id"])["status"] == "cancelled"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()
    assert [(e["message"], e["level"], e["type"]) for e in events["data"]] == [
        ("Fine-tuning job cancelled", "info", "message"),
        ("Job queued", "info", "message"),
    ]
    assert all(re.fullmatch(r"ftevent-\d+", e["id"]) and e["object"] == "fine_tuning.job.event" for e in events["data"])
    page = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 1}).json()
    older = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"after": page["data"][0]["id"]}).json()
    assert page["has_more"] is True and [e["message"] for e in older["data"]] == ["Job queued"]
    bad = error_of(client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"after": "12"}), 400)
    assert bad["param"] == "after"


def test_a_running_job_s_metrics_checkpoints_and_outcome_read_as_openai_s(client: TestClient, model_dir: Path) -> None:
    """What the worker records (rows written here as it writes them) seen through /v1."""
    file_id = upload(client)
    job = create(client, model=str(model_dir), training_file=file_id, suffix="s1").json()
    job_id = uuid.UUID(job["id"].removeprefix("ftjob-"))
    with Session(get_engine(), expire_on_commit=False) as session:
        row = session.get(Job, job_id)
        assert row is not None
        row.status, row.attempts, row.started_at = JobStatus.running, 1, utcnow()
        session.add(row)
        session.commit()
        assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "validating_files"
        row.total_steps, row.eta_seconds = 4, 60.0
        session.add(row)
        for step, loss in ((1, 2.5), (2, 2.0)):
            session.add(JobMetric(job_id=job_id, step=step, loss=loss, learning_rate=1e-5, time=utcnow()))
            data = {"step": step, "loss": loss, "learning_rate": 1e-5, "time": "t"}
            session.add(JobEvent(job_id=job_id, type=EventType.metric, data=data))
        session.add(JobEvent(job_id=job_id, type=EventType.log, data={"line": "not listed"}))
        for step in (2, 4):
            uri = f"/ckpt/{step}"
            session.add(Checkpoint(job_id=job_id, step=step, kind=CheckpointKind.deepspeed, uri=uri, bytes=1))
        session.add(Checkpoint(job_id=job_id, step=4, kind=CheckpointKind.model, uri="/model", bytes=1))
        session.commit()
        running = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        assert running["status"] == "running" and running["estimated_finish"] >= job["created_at"] + 59
        metrics = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 2}).json()["data"]
        assert [(e["type"], e["message"], e["data"]) for e in metrics] == [
            (
                "metrics",
                "Step 2/4: training loss=2.0000",
                {"step": 2, "train_loss": 2.0, "total_steps": 4, "learning_rate": 1e-5},
            ),
            (
                "metrics",
                "Step 1/4: training loss=2.5000",
                {"step": 1, "train_loss": 2.5, "total_steps": 4, "learning_rate": 1e-5},
            ),
        ]
        checkpoints = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()
        assert [c["step_number"] for c in checkpoints["data"]] == [4, 2]  # resumable ones, newest first
        second = checkpoints["data"][1]
        assert second["metrics"] == {"step": 2.0, "train_loss": 2.0}  # no validation file: no valid_loss (never null)
        assert second["fine_tuning_job_id"] == job["id"] and second["object"] == "fine_tuning.job.checkpoint"
        assert second["fine_tuned_model_checkpoint"] == f"ft:model:local:s1:{job_id.hex[:12]}:ckpt-step-2"
        after = client.get(
            f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", params={"after": checkpoints["first_id"]}
        ).json()
        assert [c["step_number"] for c in after["data"]] == [2]
        row.status, row.finished_at, row.tokens_seen = JobStatus.succeeded, utcnow() + timedelta(seconds=1), 1234
        session.add(row)
        results = File(
            id="file-" + "r" * 24,
            owner="local",
            filename="step_metrics.csv",
            purpose="fine-tune-results",
            bytes=1,
            sha256="0" * 64,
            job_id=job_id,
        )
        session.add(results)
        session.commit()
    done = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["trained_tokens"] == 1234
    assert done["result_files"] == [results.id]
    assert [j["result_files"] for j in client.get("/v1/fine_tuning/jobs").json()["data"]] == [[results.id]]
    listed = client.get("/v1/files", params={"purpose": "fine-tune-results"}).json()["data"]
    assert [f["id"] for f in listed] == [results.id]
    assert done["fine_tuned_model"] == f"ft:model:local:s1:{job_id.hex[:12]}"
    assert done["finished_at"] >= done["created_at"] and done["estimated_finish"] is None


def test_the_native_api_takes_an_uploaded_file_as_its_dataset(client: TestClient, body: dict[str, Any]) -> None:
    file_id = upload(client)
    created = client.post("/jobs", json=body | {"dataset": file_id})
    assert created.status_code == 201, created.text
    assert created.json()["dataset"] == file_id
    missing = client.post("/jobs", json=body | {"dataset": "file-" + "z" * 24})
    assert missing.status_code == 422
    assert (
        missing.json()["detail"][0]["loc"] == ["body", "dataset"] and "not found" in missing.json()["detail"][0]["msg"]
    )
    text_format = client.post("/jobs", json=body | {"dataset": file_id, "training": {"dataset_format": "text"}})
    assert text_format.status_code == 422
    assert text_format.json()["detail"][0]["loc"] == ["body", "training", "dataset_format"]


def test_models_lists_the_offered_base_models_and_the_caller_s_fine_tuned_ones(
    client: TestClient, model_dir: Path
) -> None:
    listed = client.get("/v1/models").json()
    base = {"id": str(model_dir), "object": "model", "created": listed["data"][0]["created"], "owned_by": "system"}
    assert listed == {"object": "list", "data": [base]}  # the model directories under the allowed root
    assert client.get(f"/v1/models/{model_dir}").json() == base  # an id with slashes
    job = create(client, model=str(model_dir), training_file=upload(client), suffix="x").json()
    succeed_with_an_exported_model(job["id"], model_dir)
    name = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["fine_tuned_model"]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [str(model_dir), name]
    assert client.get(f"/v1/models/{name}").json()["owned_by"] == "local"
    assert error_of(client.get("/v1/models/gpt-4o-mini"), 404)["param"] == "model"


def succeed_with_an_exported_model(fine_tuning_job_id: str, model_dir: Path) -> uuid.UUID:
    """The job succeeded and exported its model, as a worker records it: the weights in the
    store, the model's checkpoint row."""
    job_id = uuid.UUID(fine_tuning_job_id.removeprefix("ftjob-"))
    settings = get_settings()
    stored = ArtifactStore.from_settings(settings).put_file(
        model_dir / "model.safetensors", job_key(job_id, "model/model.safetensors")
    )
    with Session(get_engine()) as session:
        row = session.get(Job, job_id)
        assert row is not None
        row.status, row.finished_at = JobStatus.succeeded, utcnow()
        session.add(row)
        commit_checkpoint(
            session,
            job_id=job_id,
            kind=CheckpointKind.model,
            step=1,
            uri=f"{job_id}/model",
            files=[("model/model.safetensors", stored)],
            created_at=utcnow(),
        )
        session.commit()
    return job_id


def test_a_fine_tuned_model_is_deleted_with_its_files_and_leaves_the_list(client: TestClient, model_dir: Path) -> None:
    """The SDK's models.delete: OpenAI's answer; the model's files leave the store, it leaves the
    list, a job can no longer start from it; its job stays. A base model is a 403."""
    job = create(client, model=str(model_dir), training_file=upload(client), suffix="gone").json()
    job_id = succeed_with_an_exported_model(job["id"], model_dir)
    name = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["fine_tuned_model"]
    weights = ArtifactStore.from_settings(get_settings()).local_path(job_key(job_id, "model/model.safetensors"))
    assert weights is not None and weights.is_file()
    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="local", http_client=client, max_retries=0)
    deleted = sdk.models.delete(name)
    assert (deleted.id, deleted.object, deleted.deleted) == (name, "model", True)
    assert not weights.exists()
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [str(model_dir)]
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "succeeded"
    continued = error_of(create(client, model=name, training_file=upload(client)), 400)
    assert continued["param"] == "model" and continued["code"] == "model_not_found"
    assert error_of(client.delete(f"/v1/models/{name}"), 404)["param"] == "model"
    assert error_of(client.delete(f"/v1/models/{model_dir}"), 403)["code"] == "permission_denied"


def test_with_base_models_set_only_those_are_listed_and_trained(
    client: TestClient, model_dir: Path, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import clear_caches

    monkeypatch.setenv("TUNEQ_BASE_MODELS", "EleutherAI/gpt-neo-125m, org/other")
    clear_caches()
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["EleutherAI/gpt-neo-125m", "org/other"]
    refused = error_of(create(client, model=str(model_dir), training_file=upload(client)), 400)
    assert refused["param"] == "model" and "EleutherAI/gpt-neo-125m, org/other" in refused["message"]
    native = client.post("/jobs", json=body)
    assert native.status_code == 422 and native.json()["detail"][0]["loc"] == ["body", "model"]


def test_a_nested_parameter_is_named_by_its_path(client: TestClient, model_dir: Path) -> None:
    hyperparameters = {"n_epochs": "many"}
    body = {"method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}}
    refused = error_of(create(client, model=str(model_dir), training_file="file-x", **body), 400)
    assert refused["param"] == "method.supervised.hyperparameters.n_epochs", refused
    assert refused["message"].endswith("must be 'auto' or an integer")


def test_pause_resume_and_cancel_a_queued_job(client: TestClient, model_dir: Path) -> None:
    job = create(client, model=str(model_dir), training_file=upload(client)).json()
    path = f"/v1/fine_tuning/jobs/{job['id']}"
    assert client.post(f"{path}/pause").json()["status"] == "paused"
    assert client.post(f"{path}/pause").json()["status"] == "paused"  # again: no change
    assert native(client, job["id"])["status"] == "paused"
    assert client.post(f"{path}/resume").json()["status"] == "queued"
    assert error_of(client.post(f"{path}/resume"), 409)["param"] == "id"  # not paused
    client.post(f"{path}/pause")
    assert client.post(f"{path}/cancel").json()["status"] == "cancelled"
    assert error_of(client.post(f"{path}/pause"), 409)["param"] == "id"  # it ended
    messages = [e["message"] for e in client.get(f"{path}/events").json()["data"]]
    assert messages == [
        "Fine-tuning job cancelled",
        "Fine-tuning job paused",
        "Job queued",
        "Fine-tuning job paused",
        "Job queued",
    ]
    for action in ("pause", "resume"):
        assert error_of(client.post(f"/v1/fine_tuning/jobs/ftjob-{'0' * 32}/{action}"), 404)["param"] == "id"


@pytest.mark.parametrize(("accelerator", "devices", "layout"), [("cuda", 8, (6, 2, 1)), ("cpu", 16, (1, 6, 2))])
def test_a_batch_spreads_over_a_gpu_worker_and_stays_one_rank_on_a_cpu_one(
    client: TestClient, model_dir: Path, accelerator: str, devices: int, layout: tuple[int, int, int]
) -> None:
    from shared.db.lifecycle import register_worker

    with Session(get_engine()) as session:
        register_worker(
            session=session,
            worker_id="w1",
            hostname="h",
            accelerator=accelerator,
            device_count=devices,
            queue=f"tuneq-{devices}gpu",
            device_memory_bytes=80 * 2**30,
            bf16_supported=True,
        )
    hyperparameters = {"batch_size": 12}
    job = create(
        client, model=str(model_dir), training_file=upload(client, records=40), hyperparameters=hyperparameters
    )
    assert job.status_code == 200, job.text
    same = native(client, job.json()["id"])
    training = same["training"]
    assert (same["num_gpus"], training["micro_batch_size"], training["gradient_accumulation_steps"]) == layout


def test_a_file_uploaded_before_records_were_counted_is_counted_once(client: TestClient, model_dir: Path) -> None:
    file_id = upload(client, records=40)
    with Session(get_engine()) as session:
        row = session.get(File, file_id)
        assert row is not None
        row.records = None  # as migration 0014 leaves a file uploaded before it
        session.add(row)
        session.commit()
    job = create(client, model=str(model_dir), training_file=file_id).json()
    assert job["hyperparameters"]["n_epochs"] == 3  # 40 examples: 3 epochs see at least 100
    with Session(get_engine()) as session:
        counted = session.get(File, file_id)
        assert counted is not None and counted.records == 40


def test_a_dpo_jobs_reference_pass_is_listed_as_messages(client: TestClient, model_dir: Path) -> None:
    job = create(client, model=str(model_dir), training_file=upload(client)).json()
    job_id = uuid.UUID(job["id"].removeprefix("ftjob-"))
    with Session(get_engine()) as session:
        for done, cached in ((40, False), (96, False), (96, True)):
            data = {"name": "reference_logps", "done": done, "total": 96, "cached": cached, "time": "t"}
            session.add(JobEvent(job_id=job_id, type=EventType.phase, data=data))
        session.commit()
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 3}).json()["data"]
    assert [(e["type"], e["message"], e["data"]) for e in events] == [
        ("message", "Reference log-probabilities found computed (96 pairs)", {"done": 96, "total": 96}),
        ("message", "Computing reference log-probabilities: 96/96 pairs", {"done": 96, "total": 96}),
        ("message", "Computing reference log-probabilities: 40/96 pairs", {"done": 40, "total": 96}),
    ]


# ---- OpenAI's contract (issue 44, part 4) --------------------------------------------------------


def test_refusals_carry_a_stable_code_per_kind(client: TestClient, model_dir: Path) -> None:
    """The SDK's BadRequestError.code: what kind of refusal it is, as OpenAI's errors say."""
    training_file = upload(client)
    cases = [
        ({"training_file": training_file}, "model", "missing_required_parameter"),
        ({"model": str(model_dir), "training_file": training_file, "n_epoch": 2}, "n_epoch", "unknown_parameter"),
        ({"model": str(model_dir), "training_file": training_file, "seed": "7"}, "seed", "invalid_type"),
        ({"model": str(model_dir), "training_file": training_file, "seed": 2**31}, "seed", "invalid_value"),
        ({"model": str(model_dir), "training_file": "file-nope"}, "training_file", "file_not_found"),
    ]
    for body, param, code in cases:
        refused = error_of(create(client, **body), 400)
        assert (refused["param"], refused["code"]) == (param, code), (body, refused)
    assert create(client, model=str(model_dir), training_file=training_file, seed=2**31 - 1).status_code == 200
    # Fewer than 10 examples: OpenAI refuses the job, and so does /v1 (the native API takes them).
    few = error_of(create(client, model=str(model_dir), training_file=upload(client, records=9)), 400)
    assert (few["param"], few["code"]) == ("training_file", "invalid_training_file") and "at least 10" in few["message"]
    assert error_of(client.get("/v1/fine_tuning/jobs/ftjob-nope"), 404)["code"] == "not_found"


def test_a_results_file_is_refused_as_training_data(client: TestClient, model_dir: Path) -> None:
    """A job's results file (purpose fine-tune-results) is not data to train on: refused at
    create, as OpenAI does, rather than failing the job at line 1 with no param."""
    with Session(get_engine()) as session:
        session.add(
            File(
                id="file-results00000000000000000",
                owner="local",
                sha256="0" * 64,
                filename="step_metrics.csv",
                purpose="fine-tune-results",
                bytes=10,
            )
        )
        session.commit()
    before = job_rows()
    refused = error_of(create(client, model=str(model_dir), training_file="file-results00000000000000000"), 400)
    assert (refused["param"], refused["code"]) == ("training_file", "invalid_file_purpose")
    assert "fine-tune-results" in refused["message"] and job_rows() == before
    native = client.post("/jobs", json={"model": str(model_dir), "dataset": "file-results00000000000000000"})
    assert native.status_code == 422 and "a job's results" in native.text, native.text
    assert job_rows() == before


def test_a_429_says_when_to_retry_and_a_409_speaks_v1(
    client: TestClient, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER", "1")
    get_settings.cache_clear()
    training_file = upload(client)
    first = create(client, model=str(model_dir), training_file=training_file).json()
    refused = create(client, model=str(model_dir), training_file=training_file)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "30", refused.text
    assert error_of(refused, 429)["code"] == "rate_limit_exceeded"
    # A resume of a job that is not paused: the message names /v1's status and route, not the native ones.
    conflict = error_of(client.post(f"/v1/fine_tuning/jobs/{first['id']}/resume"), 409)
    assert conflict["message"].startswith(f"fine-tuning job {first['id']} is queued; only a paused job")
    assert (
        f"/v1/fine_tuning/jobs/{first['id']}/pause" in conflict["message"] and "POST /jobs/" not in conflict["message"]
    )
    assert conflict["code"] == "invalid_state"


def test_an_empty_after_is_the_first_page_and_a_message_event_has_no_null_data(
    client: TestClient, model_dir: Path
) -> None:
    job = create(client, model=str(model_dir), training_file=upload(client)).json()
    assert [j["id"] for j in client.get("/v1/fine_tuning/jobs", params={"after": ""}).json()["data"]] == [job["id"]]
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"after": ""}).json()["data"]
    assert events and all("data" not in e or e["data"] is not None for e in events), events


def test_examples_left_out_after_truncation_are_said_in_the_events(client: TestClient, model_dir: Path) -> None:
    """The native API shows them in dataset_stats; /v1 says it in its events, with the count."""
    from shared.db.lifecycle import record_event

    job = create(client, model=str(model_dir), training_file=upload(client)).json()
    stats = {"records": 24, "samples": 18, "dropped": 6, "max_seq_length": 64}
    with Session(get_engine()) as session:
        record_event(
            session,
            job_id=uuid.UUID(job["id"].removeprefix("ftjob-")),
            type=EventType.plan,
            data={"total_steps": 5, "dataset_stats": {"train": stats, "validation": {**stats, "dropped": 0}}},
        )
        session.commit()
    (plan,) = [
        e for e in client.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"] if "plan" in e["message"]
    ]
    assert plan["level"] == "warn" and "6 of 24 training examples were left out" in plan["message"], plan
    assert "validation" not in plan["message"]
