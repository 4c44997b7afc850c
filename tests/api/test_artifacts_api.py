"""GET /jobs/{id}/artifacts and /artifacts/{path}: listing, Range, presigned redirects on S3."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient
from sqlmodel import Session

from api.artifact_download import byte_range
from shared.artifacts.store import ArtifactStore, job_key
from shared.db.artifacts import publish_files
from shared.db.engine import get_engine
from shared.db.models import ArtifactKind
from shared.settings import get_settings
from tests.conftest import clear_caches
from tests.services import S3_CREDENTIALS, LoopbackS3

BODY = bytes(range(256)) * 40  # 10 240 bytes


@pytest.fixture(scope="module")
def s3() -> Iterator[LoopbackS3]:
    server = LoopbackS3().start()
    server.client().create_bucket(Bucket="artifacts")
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3-streamed", "s3-presigned"])
def client(
    request: pytest.FixtureRequest, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    from api.main import create_app

    if request.param != "local":
        s3: LoopbackS3 = request.getfixturevalue("s3")
        for name, value in S3_CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("TUNEQ_ARTIFACTS_URI", f"s3://artifacts/{uuid.uuid4().hex}")
        monkeypatch.setenv("TUNEQ_S3_ENDPOINT_URL", s3.endpoint)
        monkeypatch.setenv("TUNEQ_ARTIFACTS_PRESIGN", str(request.param == "s3-presigned").lower())
        clear_caches()
    with TestClient(create_app()) as c:
        yield c


def published_job(client: TestClient, body: dict[str, Any], tmp_path: Path) -> str:
    job_id: str = client.post("/jobs", json=body).json()["id"]
    source = tmp_path / "model.safetensors"
    source.write_bytes(BODY)
    stored = ArtifactStore.from_settings(get_settings()).put_file(source, job_key(job_id, "model/model.safetensors"))
    with Session(get_engine()) as session:
        publish_files(
            session,
            job_id=uuid.UUID(job_id),
            files=[("model/model.safetensors", stored)],
            kind=ArtifactKind.model,
            step=8,
        )
        session.commit()
    return job_id


def test_a_published_file_is_listed_and_served_whole_or_in_part(
    client: TestClient, body: dict[str, Any], tmp_path: Path
) -> None:
    job_id = published_job(client, body, tmp_path)
    (listed,) = client.get(f"/jobs/{job_id}/artifacts").json()["data"]
    assert {k: listed[k] for k in ("path", "kind", "step", "size")} == {
        "path": "model/model.safetensors",
        "kind": "model",
        "step": 8,
        "size": len(BODY),
    }
    url = f"/jobs/{job_id}/artifacts/model/model.safetensors"
    if get_settings().artifacts_presign:  # a redirect the client follows without its key
        answer = client.get(url, follow_redirects=False)
        assert answer.status_code == 307
        location = answer.headers["location"]
        assert location.startswith(get_settings().s3_endpoint_url) and "Signature" in location
        assert httpx.get(location).content == BODY
        return
    whole = client.get(url)
    assert whole.status_code == 200 and whole.content == BODY
    assert whole.headers["etag"] == f'"{listed["sha256"]}"' and whole.headers["accept-ranges"] == "bytes"
    part = client.get(url, headers={"Range": "bytes=1000-1999"})
    assert part.status_code == 206 and part.content == BODY[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{len(BODY)}"
    tail = client.get(url, headers={"Range": "bytes=-24"})
    assert tail.status_code == 206 and tail.content == BODY[-24:]
    # The copy changed since the client's partial one: If-Range sends all of it.
    stale = client.get(url, headers={"Range": "bytes=1000-", "If-Range": '"an-older-version"'})
    assert stale.status_code == 200 and stale.content == BODY
    past = client.get(url, headers={"Range": f"bytes={len(BODY)}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(BODY)}"
    for other in ("model/other.bin", "model/../spec.json", "spec.json"):
        assert client.get(f"/jobs/{job_id}/artifacts/{other}").status_code == 404


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-", (0, 99)),
        ("bytes=10-19", (10, 19)),
        ("bytes=90-500", (90, 99)),  # clipped to the file
        ("bytes=-10", (90, 99)),
        ("bytes=-500", (0, 99)),
        ("bytes=0-1,5-9", None),  # several ranges: the whole file
        ("items=0-5", None),  # another unit: the whole file
    ],
)
def test_byte_ranges(header: str | None, expected: tuple[int, int] | None) -> None:
    assert byte_range(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=20-10", "bytes=-0"])
def test_unsatisfiable_ranges(header: str) -> None:
    with pytest.raises(HTTPException) as caught:
        byte_range(header, 100)
    assert caught.value.status_code == 416
