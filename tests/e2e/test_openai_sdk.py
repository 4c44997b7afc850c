"""The unmodified official ``openai`` SDK against a real ``tuneq dev``: OpenAI's Files and
fine-tuning APIs at /v1.

What a team moving off OpenAI runs: ``OpenAI(base_url=".../v1", api_key=<a tuneq key>)``,
``client.files`` and ``client.fine_tuning.jobs``, unchanged, training the tiny model for real.
API keys are on, so two owners see only their own files and jobs. Every answer the SDK gets is
held to the SDK's own response types (tests/e2e/openai_conformance.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from cli.samples import write_preference_dataset

from .harness import Tuneq
from .openai_conformance import ConformanceRecorder

pytestmark = pytest.mark.slow

WEATHER_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
# A system message, a tool call (content null) and its result, and a turn not trained on (weight 0).
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a terse weather bot."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "weight": 0},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'},
        {"role": "assistant", "content": "3 degrees, cold.", "weight": 1},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"TUNEQ_AUTH": "on"}  # on loopback too: the SDK sends its api_key as a Bearer key


# Every /v1 answer the SDK receives here, held to the SDK's own types after each test.
RECORDER = ConformanceRecorder()


@pytest.fixture(autouse=True)
def answers_conform_to_the_sdks_types() -> Iterator[None]:
    RECORDER.answers.clear()
    yield
    assert RECORDER.violations() == []


def sdk(service: Tuneq, key: str) -> OpenAI:
    # No retries: a refusal must surface as the exception it is, at once.
    return OpenAI(
        base_url=f"http://127.0.0.1:{service.port}/v1", api_key=key, max_retries=0, http_client=RECORDER.client()
    )


@pytest.fixture(scope="module")
def alice(service: Tuneq) -> OpenAI:
    return sdk(service, service.create_key("alice"))


@pytest.fixture(scope="module")
def bob(service: Tuneq) -> OpenAI:
    return sdk(service, service.create_key("bob"))


def chat_file(path: Path, records: int = 12, *, line_7: str | None = None) -> Path:
    """``records`` copies of CHAT (a job on /v1 needs at least 10, as on OpenAI's)."""
    lines = [json.dumps(CHAT)] * records
    if line_7 is not None:
        lines[6] = line_7
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_the_sdk_uploads_lists_reads_back_and_deletes_a_chat_file(alice: OpenAI, tmp_path: Path) -> None:
    path = chat_file(tmp_path / "weather.jsonl")
    with path.open("rb") as f:
        created = alice.files.create(file=f, purpose="fine-tune")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.filename, created.purpose, created.bytes) == ("weather.jsonl", "fine-tune", path.stat().st_size)
    assert created.status == "processed" and created.created_at > 1_700_000_000
    assert alice.files.retrieve(created.id) == created
    assert alice.files.content(created.id).read() == path.read_bytes()

    # A second file, then the SDK's own paging (limit 1, following has_more with after=<last id>).
    with chat_file(tmp_path / "more.jsonl", 3).open("rb") as f:
        second = alice.files.create(file=f, purpose="fine-tune")
    ours = {created.id, second.id}
    paged = [file.id for file in alice.files.list(limit=1) if file.id in ours]
    assert paged == [second.id, created.id]  # newest first
    ascending = [file.id for file in alice.files.list(purpose="fine-tune", order="asc") if file.id in ours]
    assert ascending == [created.id, second.id]

    deleted = alice.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError) as gone:
        alice.files.retrieve(created.id)
    assert gone.value.param == "id" and created.id in gone.value.message
    assert created.id not in {file.id for file in alice.files.list()}


def test_a_malformed_line_7_is_a_bad_request_naming_it(alice: OpenAI, tmp_path: Path) -> None:
    bad = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]})
    with chat_file(tmp_path / "bad.jsonl", line_7=bad).open("rb") as f, pytest.raises(openai.BadRequestError) as e:
        alice.files.create(file=f, purpose="fine-tune")
    assert "line 7: messages[1].role must be one of system, developer, user, assistant, tool" in e.value.message
    assert (e.value.type, e.value.param) == ("invalid_request_error", "file")
    assert "bad.jsonl" not in {file.filename for file in alice.files.list()}  # nothing kept


def test_another_owners_file_is_not_found(alice: OpenAI, bob: OpenAI, tmp_path: Path) -> None:
    with chat_file(tmp_path / "alices.jsonl").open("rb") as f:
        file = alice.files.create(file=f, purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(file.id)
    assert file.id not in {f.id for f in bob.files.list()}
    assert alice.files.retrieve(file.id) == file  # bob's delete removed nothing


def test_an_unknown_key_is_an_authentication_error(service: Tuneq) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(service, "tq_unknown_key").files.list()
    assert e.value.code == "invalid_api_key"


TERMINAL = {"succeeded", "failed", "cancelled"}


def follow(client: OpenAI, job_id: str, *, timeout: float = 300) -> list[str]:
    """Retrieve the job until it ends, as a caller's poll loop does: the statuses seen, in order."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.fine_tuning.jobs.retrieve(job_id).status
        if not seen or seen[-1] != status:
            seen.append(status)
        if status in TERMINAL:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end within {timeout}s: {seen}")


def test_the_sdk_fine_tunes_follows_lists_and_cancels(
    alice: OpenAI, bob: OpenAI, service: Tuneq, tmp_path: Path
) -> None:
    # A system message, a tool call and its result, a weight-0 turn: trained as OpenAI would.
    with chat_file(tmp_path / "weather.jsonl").open("rb") as f:
        file = alice.files.create(file=f, purpose="fine-tune")
    model = str(service.home / "data" / "tiny-gpt-neo")
    job = alice.fine_tuning.jobs.create(
        model=model,
        training_file=file.id,
        suffix="weather",
        seed=3,
        metadata={"team": "forecast"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 3}}},
    )
    assert job.object == "fine_tuning.job" and job.status == "queued" and job.training_file == file.id
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 3
    assert job.hyperparameters.learning_rate_multiplier == 0.05  # "auto" for a batch of 3

    statuses = follow(alice, job.id)
    done = alice.fine_tuning.jobs.retrieve(job.id)
    assert statuses[-1] == "succeeded", (statuses, done.error, service.log_tail())
    assert set(statuses) <= {"queued", "validating_files", "running", "succeeded"}
    assert done.fine_tuned_model is not None and done.fine_tuned_model.startswith("ft:tiny-gpt-neo:")
    assert ":weather:" in done.fine_tuned_model and done.trained_tokens and done.finished_at
    assert done.seed == 3 and done.metadata == {"team": "forecast"}
    # Its results file: the loss of every step, as CSV.
    (results,) = done.result_files
    table = alice.files.content(results).read().decode().splitlines()
    assert table[0].startswith("step,train_loss,") and [row.split(",")[0] for row in table[1:]] == [
        str(step) for step in range(1, 9)
    ]
    assert alice.files.retrieve(results).purpose == "fine-tune-results"

    # Every event once, newest first, following the SDK's own paging (limit 3, after=<last id>).
    events = list(alice.fine_tuning.jobs.list_events(job.id, limit=3))
    assert len({e.id for e in events}) == len(events)
    assert events[0].message.startswith("The job has successfully completed")
    metrics = [e for e in events if e.type == "metrics"]
    # 12 examples in batches of 3, twice: 8 steps, newest first.
    assert [e.data["step"] for e in metrics] == list(range(8, 0, -1))  # type: ignore[index]
    assert all(e.data["train_loss"] > 0 for e in metrics)  # type: ignore[index]

    checkpoints = list(alice.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [8, 4]  # one an epoch, newest first
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-8"
    assert checkpoints[0].metrics.train_loss is not None

    # A second job, cancelled while queued or running; the list pages and filters both.
    second = alice.fine_tuning.jobs.create(model=model, training_file=file.id, metadata={"team": "other"})
    assert alice.fine_tuning.jobs.cancel(second.id).status == "cancelled"
    paged = [j.id for j in alice.fine_tuning.jobs.list(limit=1)]
    assert paged[:2] == [second.id, job.id]
    assert [j.id for j in alice.fine_tuning.jobs.list(metadata={"team": "forecast"})] == [job.id]

    # The fine-tuned model beside the base model the deployment offers; bob sees neither job's.
    assert [m.id for m in alice.models.list()] == [model, done.fine_tuned_model]
    assert alice.models.retrieve(done.fine_tuned_model).owned_by == "alice"
    with pytest.raises(openai.NotFoundError):
        bob.models.retrieve(done.fine_tuned_model)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.cancel(second.id)
    with pytest.raises(openai.BadRequestError) as e:
        bob.fine_tuning.jobs.create(model=model, training_file=file.id)  # alice's file
    assert e.value.param == "training_file"
    # The answers above were recorded, each to be held to the SDK's type after the test.
    assert {path.split("/")[2] for _, path, _ in RECORDER.answers} >= {"files", "fine_tuning", "models"}


def events_of(client: OpenAI, job_id: str) -> list[openai.types.fine_tuning.FineTuningJobEvent]:
    return list(client.fine_tuning.jobs.list_events(job_id, limit=100))


def test_the_sdk_pauses_a_running_job_and_resumes_it_from_its_checkpoint(
    alice: OpenAI, service: Tuneq, tmp_path: Path
) -> None:
    with chat_file(tmp_path / "weather.jsonl", 10).open("rb") as f:
        file = alice.files.create(file=f, purpose="fine-tune")
    job = alice.fine_tuning.jobs.create(
        model=str(service.home / "data" / "tiny-gpt-neo"),
        training_file=file.id,
        hyperparameters={"n_epochs": 8, "batch_size": 1},  # 80 steps, a checkpoint every 10
    )
    deadline = time.monotonic() + 240
    while not any(e.type == "metrics" for e in events_of(alice, job.id)):
        assert time.monotonic() < deadline, service.log_tail()
        time.sleep(0.5)
    assert alice.fine_tuning.jobs.pause(job.id).status == "paused"
    # The pause is done once its event says at which step: the checkpoint is saved, the worker free.
    paused_at = None
    while paused_at is None:
        assert time.monotonic() < deadline, service.log_tail()
        done = [e for e in events_of(alice, job.id) if e.message.startswith("Fine-tuning job paused at step")]
        paused_at = int(done[0].message.split("at step ")[1].split(":")[0]) if done else None
        time.sleep(0.5)
    assert 0 < paused_at < 80
    assert paused_at in {c.step_number for c in alice.fine_tuning.jobs.checkpoints.list(job.id)}
    assert alice.fine_tuning.jobs.retrieve(job.id).status == "paused"

    assert alice.fine_tuning.jobs.resume(job.id).status in {"queued", "validating_files", "running"}
    statuses = follow(alice, job.id)
    assert statuses[-1] == "succeeded", (statuses, service.log_tail())
    events = events_of(alice, job.id)
    steps = [e.data["step"] for e in events if e.type == "metrics"]  # type: ignore[index]
    assert sorted(steps) == list(range(1, 81))  # every step once: none repeated after the resume
    assert any(e.message == f"Resumed from the checkpoint at step {paused_at}" for e in events)


def first_train_loss(client: OpenAI, job_id: str) -> float:
    (step_1,) = [e for e in events_of(client, job_id) if e.type == "metrics" and e.data["step"] == 1]  # type: ignore[index]
    return float(step_1.data["train_loss"])  # type: ignore[index]


def test_the_sdk_continues_from_a_fine_tuned_model_and_from_a_checkpoint(
    alice: OpenAI, bob: OpenAI, service: Tuneq, tmp_path: Path
) -> None:
    with chat_file(tmp_path / "weather.jsonl").open("rb") as f:
        file = alice.files.create(file=f, purpose="fine-tune")
    hyperparameters = {"n_epochs": 2, "batch_size": 3, "learning_rate_multiplier": 10}  # 4 steps an epoch
    first = alice.fine_tuning.jobs.create(
        model=str(service.home / "data" / "tiny-gpt-neo"),
        training_file=file.id,
        suffix="first",
        method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    )
    assert follow(alice, first.id)[-1] == "succeeded", service.log_tail()
    fine_tuned = alice.fine_tuning.jobs.retrieve(first.id).fine_tuned_model
    assert fine_tuned is not None

    # The fine-tuned model as the next job's base, as OpenAI's users name it.
    second = alice.fine_tuning.jobs.create(
        model=fine_tuned, training_file=file.id, suffix="second", hyperparameters={"n_epochs": 1, "batch_size": 2}
    )
    assert second.model == fine_tuned
    assert follow(alice, second.id)[-1] == "succeeded", service.log_tail()
    done = alice.fine_tuning.jobs.retrieve(second.id)
    # Named after the base model, as OpenAI names a model fine-tuned from a fine-tuned one.
    assert done.fine_tuned_model is not None and done.fine_tuned_model.startswith("ft:tiny-gpt-neo:alice:second:")
    # It starts from the trained weights: its first loss is below the first job's first.
    assert first_train_loss(alice, second.id) < first_train_loss(alice, first.id)

    # A checkpoint, by its fine_tuned_model_checkpoint: a model to retrieve and to continue from.
    (_, earliest) = alice.fine_tuning.jobs.checkpoints.list(first.id)
    checkpoint = earliest.fine_tuned_model_checkpoint
    assert checkpoint == f"{fine_tuned}:ckpt-step-4"
    assert alice.models.retrieve(checkpoint).id == checkpoint
    third = alice.fine_tuning.jobs.create(model=checkpoint, training_file=file.id, hyperparameters={"n_epochs": 1})
    assert follow(alice, third.id)[-1] == "succeeded", service.log_tail()

    # Bob can neither see alice's models nor continue from them: OpenAI's 400 naming model.
    with chat_file(tmp_path / "bobs.jsonl").open("rb") as f:
        bobs_file = bob.files.create(file=f, purpose="fine-tune")
    for name in (fine_tuned, checkpoint):
        with pytest.raises(openai.BadRequestError) as refused:
            bob.fine_tuning.jobs.create(model=name, training_file=bobs_file.id)
        assert refused.value.param == "model" and "not found: name one of yours" in refused.value.message
        with pytest.raises(openai.NotFoundError):
            bob.models.retrieve(name)
    assert bob.fine_tuning.jobs.list().data == []


def test_the_sdk_runs_dpo_on_a_fine_tuned_model_with_a_dpo_file_of_tool_calls(
    alice: OpenAI, service: Tuneq, tmp_path: Path
) -> None:
    """OpenAI's recipe: supervised first, then DPO on the fine-tuned model, through the SDK
    unchanged, on OpenAI's DPO format with a preferred tool call in every fourth pair."""
    with chat_file(tmp_path / "weather.jsonl").open("rb") as f:
        chat = alice.files.create(file=f, purpose="fine-tune")
    sft = alice.fine_tuning.jobs.create(
        model=str(service.home / "data" / "tiny-gpt-neo"), training_file=chat.id, hyperparameters={"n_epochs": 1}
    )
    assert follow(alice, sft.id)[-1] == "succeeded", service.log_tail()
    fine_tuned = alice.fine_tuning.jobs.retrieve(sft.id).fine_tuned_model
    assert fine_tuned is not None

    pairs = write_preference_dataset(tmp_path / "pairs.jsonl", records=32, shape="openai")
    assert any("tool_calls" in line for line in pairs.read_text().splitlines())
    with pairs.open("rb") as f:
        preference = alice.files.create(file=f, purpose="fine-tune")
    hyperparameters = {"n_epochs": 2, "batch_size": 8, "beta": "auto", "learning_rate_multiplier": "auto"}
    dpo = alice.fine_tuning.jobs.create(
        model=fine_tuned,
        training_file=preference.id,
        suffix="dpo",
        method={"type": "dpo", "dpo": {"hyperparameters": hyperparameters}},
    )
    assert dpo.method is not None and dpo.method.type == "dpo" and dpo.method.dpo is not None
    resolved = dpo.method.dpo.hyperparameters
    assert resolved is not None and (resolved.beta, resolved.batch_size, resolved.n_epochs) == (0.1, 8, 2)
    assert follow(alice, dpo.id)[-1] == "succeeded", service.log_tail()
    done = alice.fine_tuning.jobs.retrieve(dpo.id)
    assert done.fine_tuned_model is not None and done.fine_tuned_model.startswith("ft:tiny-gpt-neo:alice:dpo:")
    steps = [e.data for e in events_of(alice, dpo.id) if e.type == "metrics"]
    assert sorted(s["step"] for s in steps) == list(range(1, 9))  # type: ignore[index]  # 32 pairs / 8 x 2 epochs
    checkpoints = alice.fine_tuning.jobs.checkpoints.list(dpo.id).data
    assert checkpoints and checkpoints[0].metrics.train_loss is not None
