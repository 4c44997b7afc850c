"""Every ``/v1`` answer an SDK client received, checked strictly against the official ``openai``
SDK's own response types: required fields present, no null where the type has none, enum values
legal. The SDK itself parses leniently (it builds its objects without validating them), so a
violation would reach a user's code unnoticed; this check fails the test instead.

``ConformanceRecorder`` is an httpx response hook: give the SDK ``http_client=recorder.client()``,
then assert ``recorder.violations() == []``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import pydantic
from openai.types import FileDeleted, FileObject, Model, ModelDeleted
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

# (method, path pattern under /v1) -> (the SDK's type of the answer, whether it is a list page of it).
_ID = r"[^/]+"
ROUTES: list[tuple[str, re.Pattern[str], type[pydantic.BaseModel], bool]] = [
    (m, re.compile(p), t, listed)
    for m, p, t, listed in [
        ("POST", r"/v1/files", FileObject, False),
        ("GET", r"/v1/files", FileObject, True),
        ("GET", rf"/v1/files/{_ID}", FileObject, False),
        ("DELETE", rf"/v1/files/{_ID}", FileDeleted, False),
        ("POST", r"/v1/fine_tuning/jobs", FineTuningJob, False),
        ("GET", r"/v1/fine_tuning/jobs", FineTuningJob, True),
        ("GET", rf"/v1/fine_tuning/jobs/{_ID}", FineTuningJob, False),
        ("POST", rf"/v1/fine_tuning/jobs/{_ID}/(cancel|pause|resume)", FineTuningJob, False),
        ("GET", rf"/v1/fine_tuning/jobs/{_ID}/events", FineTuningJobEvent, True),
        ("GET", rf"/v1/fine_tuning/jobs/{_ID}/checkpoints", FineTuningJobCheckpoint, True),
        ("GET", r"/v1/models", Model, True),
        ("GET", r"/v1/models/.+", Model, False),
        ("DELETE", r"/v1/models/.+", ModelDeleted, False),
    ]
]


def answer_type(method: str, path: str) -> tuple[type[pydantic.BaseModel], bool] | None:
    """The SDK's type of a successful answer to ``method path``, and whether it is a list page;
    None for an answer that is not JSON (a file's content)."""
    for route_method, pattern, sdk_type, listed in ROUTES:
        if route_method == method and pattern.fullmatch(path):
            return sdk_type, listed
    return None


# The one value tuneq answers that the SDK's types lack, on purpose: a paused job's status.
# OpenAI's API pauses and resumes jobs (the SDK's jobs.pause and jobs.resume), but the SDK's
# FineTuningJob.status Literal (openai 3.63) has no "paused"; calling a paused job "queued" or
# "running" would tell its owner something false. docs/openai.md says so.
KNOWN_EXTENSIONS = {(FineTuningJob, ("status",), "paused")}


def _is_known_extension(sdk_type: type[pydantic.BaseModel], error: Any) -> bool:
    return any(
        sdk_type is known and tuple(error["loc"]) == loc and error.get("input") == value
        for known, loc, value in KNOWN_EXTENSIONS
    )


def violations_of(method: str, path: str, body: Any) -> list[str]:
    """What in one successful answer breaks the SDK's type, as sentences naming the field."""
    found = answer_type(method, path)
    if found is None:
        return [] if path.endswith("/content") else [f"{method} {path}: no SDK type known for this route"]
    sdk_type, listed = found
    items = body.get("data") if listed and isinstance(body, dict) else [body]
    if listed and (not isinstance(items, list) or not isinstance(body.get("has_more", False), bool)):
        return [f"{method} {path}: a list page needs data (a list) and has_more (a bool)"]
    problems = []
    for i, item in enumerate(items or []):
        try:
            sdk_type.model_validate(item)
        except pydantic.ValidationError as e:
            where = f"data[{i}]" if listed else "the answer"
            problems += [
                f"{method} {path}: {where}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
                for err in e.errors()
                if not _is_known_extension(sdk_type, err)
            ]
    return problems


@dataclass
class ConformanceRecorder:
    """The successful JSON answers under /v1 an SDK client received, for ``violations``."""

    answers: list[tuple[str, str, Any]] = field(default_factory=list)

    def record(self, response: httpx.Response) -> None:
        path = response.request.url.path
        if not path.startswith("/v1/") or not response.is_success:
            return
        response.read()
        if response.headers.get("content-type", "").startswith("application/json"):
            self.answers.append((response.request.method, path, json.loads(response.content)))

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"response": [self.record]}, timeout=60)

    def violations(self) -> list[str]:
        return [problem for method, path, body in self.answers for problem in violations_of(method, path, body)]
