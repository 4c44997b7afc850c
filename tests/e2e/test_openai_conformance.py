"""The check that holds /v1's answers to the openai SDK's types (tests/e2e/openai_conformance.py)
finds what it must: a missing field, a null the type has none for, an illegal enum value."""

from __future__ import annotations

from typing import Any

from .openai_conformance import violations_of

FILE: dict[str, Any] = {
    "id": "file-abc",
    "object": "file",
    "bytes": 10,
    "created_at": 1_700_000_000,
    "filename": "train.jsonl",
    "purpose": "fine-tune",
    "status": "processed",
}


def test_a_conforming_answer_and_page_pass() -> None:
    assert violations_of("GET", "/v1/files/file-abc", FILE) == []
    assert violations_of("GET", "/v1/files", {"object": "list", "data": [FILE], "has_more": False}) == []
    assert violations_of("GET", "/v1/files/file-abc/content", b"x") == []  # not JSON: not checked


def test_each_kind_of_violation_is_named() -> None:
    missing = {k: v for k, v in FILE.items() if k != "bytes"}
    assert violations_of("GET", "/v1/files/file-abc", missing) == [
        "GET /v1/files/file-abc: the answer.bytes: Field required (got {'id': 'file-abc', 'object': 'file', "
        "'created_at': 1700000000, 'filename': 'train.jsonl', 'purpose': 'fine-tune', 'status': 'processed'})"
    ]
    (null,) = violations_of("GET", "/v1/files", {"data": [{**FILE, "status": None}], "has_more": False})
    assert null.startswith("GET /v1/files: data[0].status: Input should be") and "(got None)" in null
    (enum,) = violations_of("POST", "/v1/files", {**FILE, "purpose": "weights"})
    assert enum.startswith("POST /v1/files: the answer.purpose: Input should be 'assistants'")
    assert violations_of("GET", "/v1/files", {"data": "nope"}) == [
        "GET /v1/files: a list page needs data (a list) and has_more (a bool)"
    ]
    assert violations_of("GET", "/v1/batches", {}) == ["GET /v1/batches: no SDK type known for this route"]


def test_a_paused_jobs_status_is_the_one_known_extension() -> None:
    """The SDK's FineTuningJob.status has no "paused"; tuneq's paused jobs say so all the same."""
    job = {
        "id": "ftjob-1",
        "object": "fine_tuning.job",
        "created_at": 1,
        "error": None,
        "fine_tuned_model": None,
        "finished_at": None,
        "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 0.05},
        "model": "m",
        "organization_id": "local",
        "result_files": [],
        "seed": 1,
        "status": "paused",
        "trained_tokens": None,
        "training_file": "file-1",
        "validation_file": None,
    }
    assert violations_of("POST", "/v1/fine_tuning/jobs/ftjob-1/pause", job) == []
    (other,) = violations_of("GET", "/v1/fine_tuning/jobs/ftjob-1", {**job, "status": "sleeping"})
    assert "status" in other and "sleeping" in other
