"""The artifact store, on a local directory and on a real S3 endpoint (moto's server) alike."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.artifacts.store import ArtifactIntegrityError, ArtifactStore, ArtifactStoreError, StoreOutage
from shared.ports import free_port
from tests.conftest import FakeClock
from tests.services import S3_CREDENTIALS, LoopbackS3


@pytest.fixture(scope="module")
def s3() -> Iterator[LoopbackS3]:
    server = LoopbackS3().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "store"))
    s3: LoopbackS3 = request.getfixturevalue("s3")
    bucket = f"artifacts-{os.getpid()}-{abs(hash(tmp_path)) % 10**8}"
    s3.client().create_bucket(Bucket=bucket)
    return ArtifactStore(f"s3://{bucket}/tuneq", s3_endpoint_url=s3.endpoint)


def test_a_published_file_reads_back_whole_and_in_part(store: ArtifactStore, tmp_path: Path) -> None:
    store.check()
    source = tmp_path / "weights.bin"
    body = os.urandom(3 * 1024 * 1024 + 17)
    source.write_bytes(body)
    stored = store.put_file(source, "job/model/weights.bin")
    assert (stored.size, stored.sha256) == (len(body), hashlib.sha256(body).hexdigest())
    with store.open("job/model/weights.bin") as f:
        f.seek(1024 * 1024)
        assert f.read(100) == body[1024 * 1024 : 1024 * 1024 + 100]
    copy = tmp_path / "copy" / "weights.bin"
    store.get_file("job/model/weights.bin", copy, sha256=stored.sha256)
    assert copy.read_bytes() == body
    if store.is_s3:
        assert store.uri_of("job/model/weights.bin").startswith("s3://") and store.local_path("x") is None
    else:  # through a temporary name: nothing else is left beside it
        assert [p.name for p in (tmp_path / "store" / "job" / "model").iterdir()] == ["weights.bin"]
    store.delete(["job/model/weights.bin", "job/model/never-there"])
    with pytest.raises(FileNotFoundError):
        store.open("job/model/weights.bin").close()


def test_a_file_changed_in_the_store_never_takes_the_name(store: ArtifactStore, tmp_path: Path) -> None:
    source = tmp_path / "mp_rank_00_model_states.pt"
    source.write_bytes(b"the published state")
    stored = store.put_file(source, "job/checkpoints/step-1/mp_rank_00_model_states.pt")
    source.write_bytes(b"import os; os.system('evil')")  # someone rewrites the object
    store.put_file(source, "job/checkpoints/step-1/mp_rank_00_model_states.pt")
    target = tmp_path / "resume" / "mp_rank_00_model_states.pt"
    with pytest.raises(ArtifactIntegrityError, match="not the file that was published"):
        store.get_file("job/checkpoints/step-1/mp_rank_00_model_states.pt", target, sha256=stored.sha256)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_a_file_already_where_the_store_keeps_it_is_only_hashed(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    store = ArtifactStore(str(runs))  # the default: the directory the ranks write into
    saved = runs / "job" / "model" / "model.safetensors"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"weights")
    before = saved.stat()
    stored = store.put_file(saved, "job/model/model.safetensors")
    assert stored.sha256 == hashlib.sha256(b"weights").hexdigest()
    after = saved.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_keys_never_leave_the_store(store: ArtifactStore) -> None:
    for key in ("../outside", "job/../../outside", "/etc/passwd"):
        with pytest.raises(ValueError, match="not a key"):
            store.uri_of(key)


def test_presigned_urls_on_s3_only(store: ArtifactStore, tmp_path: Path) -> None:
    source = tmp_path / "train.log"
    source.write_text("a line\n")
    store.put_file(source, "job/train.log")
    url = store.presigned_url("job/train.log", seconds=60)
    if not store.is_s3:
        assert url is None
        return
    assert url is not None and "Signature" in url
    assert httpx.get(url).content == b"a line\n"  # no credentials needed


def test_a_store_that_cannot_be_used_is_named_with_the_problem(s3: LoopbackS3, tmp_path: Path) -> None:
    def problem(uri: str, endpoint: str = s3.endpoint) -> str:
        with pytest.raises(ArtifactStoreError) as caught:
            ArtifactStore(uri, s3_endpoint_url=endpoint).check()
        return str(caught.value)

    assert "bucket 'no-such-bucket' does not exist" in problem("s3://no-such-bucket/x")
    down = problem("s3://any/x", endpoint=f"http://127.0.0.1:{free_port()}")
    assert down.startswith("TUNEQ_ARTIFACTS_URI s3://any/x") and "cannot be reached" in down
    assert "names no bucket" in problem("s3://")
    assert "unsupported scheme 'gs'" in problem("gs://bucket/x")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        assert "not writable" in problem(str(read_only))


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_refuse_a_store_they_cannot_use(command: str, s3: LoopbackS3, tmp_path: Path) -> None:
    """One line naming the setting and the problem, exit 1, no traceback, nothing started."""
    env = {
        **os.environ,
        **S3_CREDENTIALS,
        "TUNEQ_HOME": str(tmp_path / "home"),
        "TUNEQ_ARTIFACTS_URI": "s3://no-such-bucket/runs",
        "TUNEQ_S3_ENDPOINT_URL": s3.endpoint,
        "TUNEQ_LOG_LEVEL": "WARNING",
    }
    args = ["--port", str(free_port())] if command == "serve" else []
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", command, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"tuneq: TUNEQ_ARTIFACTS_URI s3://no-such-bucket/runs (endpoint {s3.endpoint}): "
        "bucket 'no-such-bucket' does not exist"
    )
    assert "Traceback" not in result.stderr


def test_a_long_backoff_calls_the_keep_alive_every_second(store_clock: FakeClock) -> None:
    """A job's lease (10 s, say) must not lapse while a resume waits 30 s for its next try: one
    keep-alive per try left 30 s between them (issue 41)."""
    outage = StoreOutage()
    outage.failed()
    outage.delay = StoreOutage.MAX_SECONDS
    kept_alive: list[float] = []
    outage.wait(lambda: kept_alive.append(store_clock.now))
    assert kept_alive == [float(second) for second in range(30)]
    assert store_clock.now == 30.0 and outage.delay == StoreOutage.MAX_SECONDS

    def lease_lost() -> None:  # a keep-alive that raises ends the wait there
        if store_clock.now >= 32:
            raise RuntimeError("lease lost")

    with pytest.raises(RuntimeError, match="lease lost"):
        outage.wait(lease_lost)
    assert store_clock.now == 32.0
