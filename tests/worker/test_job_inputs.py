"""A job's remote dataset, downloaded by the worker from a real S3 endpoint (moto's, on loopback)
and checked for the job's method before any rank starts, as the API checks a local one at submit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.settings import Settings
from tests.services import S3_CREDENTIALS, LoopbackS3
from worker.job_inputs import DownloadProgress, InputProblem, local_dataset

PAIRS = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}] * 2
CHAT = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}] * 2


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = LoopbackS3().start()
    server.client().create_bucket(Bucket="datasets")
    yield server.endpoint
    server.stop()


@pytest.fixture
def settings(tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return Settings(home=tmp_path / "home", s3_endpoint_url=s3_endpoint, allowed_https_hosts="", ca_bundle="")


def put(s3_endpoint: str, key: str, records: list[dict[str, Any]]) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.put_object(Bucket="datasets", Key=key, Body="".join(json.dumps(r) + "\n" for r in records).encode())
    return f"s3://datasets/{key}"


def fetch(uri: str, settings: Settings, method: Any) -> str:
    reports: list[DownloadProgress] = []
    return local_dataset("dataset", uri, dataset_format=None, method=method, settings=settings, report=reports.append)


def test_a_dpo_job_s_remote_pairs_are_checked_as_preference_records(settings: Settings, s3_endpoint: str) -> None:
    pairs = put(s3_endpoint, "dpo/pairs.jsonl", PAIRS)
    assert Path(fetch(pairs, settings, "dpo")).read_text().count("chosen") == 2
    # An SFT job refuses the same file, whole, naming the method.
    with pytest.raises(InputProblem) as refused:
        fetch(pairs, settings, "sft")
    assert "pairs.jsonl holds preference records (line 1 has" in str(refused.value)


def test_a_dpo_job_refuses_remote_supervised_records_naming_the_method(settings: Settings, s3_endpoint: str) -> None:
    chat = put(s3_endpoint, "sft/chat.jsonl", CHAT)
    with pytest.raises(InputProblem) as refused:
        fetch(chat, settings, "dpo")
    assert str(refused.value).startswith(
        "dataset 's3://datasets/sft/chat.jsonl': chat.jsonl holds supervised records (line 1 has \"messages\"), "
        "for supervised fine-tuning (SFT), which a DPO job cannot train on"
    ), str(refused.value)
    assert Path(fetch(chat, settings, "sft")).is_file()
