"""The real API (uvicorn in a thread, SQLite, the local artifact store) for the commands to talk
to: checkpoints published as the worker publishes them, and every request recorded."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from shared.artifacts.store import ArtifactStore, job_key
from shared.db.artifacts import commit_checkpoint
from shared.db.engine import get_engine, init_db
from shared.db.models import CheckpointKind, Job, utcnow
from shared.jobs.run_layout import CheckpointManifest
from shared.jobs.status import JobStatus
from shared.ports import free_port
from shared.settings import get_settings
from tests.conftest import clear_caches

# Bigger than a chunk of the server (1 MiB) and of the client, so files come in several.
WEIGHTS = bytes(range(256)) * (3 * 4096 + 17)
MODEL_FILES = {"config.json": b'{"model_type": "gpt_neo"}\n', "model.safetensors": WEIGHTS}


@dataclass
class Recorder:
    """The API app, recording each request: its path, headers, status and the body bytes sent."""

    app: Any
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        entry: dict[str, Any] = {"path": scope["path"], "headers": headers, "status": None, "sent": 0}
        self.requests.append(entry)

        async def counting(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            elif message["type"] == "http.response.body":
                entry["sent"] += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counting)

    def downloads(self, name: str) -> list[dict[str, Any]]:
        """The GETs of artifact files whose path ends with ``name``."""
        return [r for r in self.requests if "/artifacts/" in r["path"] and r["path"].endswith(f"/{name}")]


def add_job(job_id: uuid.UUID | None = None, **values: Any) -> str:
    """A job row, as a submit leaves one (a succeeded one unless ``values`` say otherwise)."""
    fields: dict[str, Any] = {
        "model": "m",
        "dataset": "d",
        "deepspeed_config": {},
        "num_gpus": 1,
        "training": {},
        "status": JobStatus.succeeded,
        **values,
    }
    with Session(get_engine()) as session:
        job = Job(**fields) if job_id is None else Job(id=job_id, **fields)
        session.add(job)
        session.commit()
        return str(job.id)


@dataclass
class ServedApi:
    url: str
    recorder: Recorder
    job_id: str
    sources: Path

    def publish(self, kind: str, step: int, directory: str, files: dict[str, bytes]) -> dict[str, bytes]:
        """Publish a checkpoint as the worker does (its files, the manifest last, then one
        commit); returns what its directory holds, manifest included."""
        source = self.sources / directory
        for name, data in files.items():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(data)
        manifest = CheckpointManifest.describe(
            source, step=step, tag=f"step-{step:08d}", kind=kind, world_size=1, created_at=utcnow().isoformat()
        )
        manifest.write(source)
        store = ArtifactStore.from_settings(get_settings())
        names = [*sorted(files), CheckpointManifest.FILENAME]
        stored = [
            (f"{directory}/{n}", store.put_file(source / n, job_key(self.job_id, f"{directory}/{n}"))) for n in names
        ]
        with Session(get_engine()) as session:
            commit_checkpoint(
                session,
                job_id=uuid.UUID(self.job_id),
                kind=CheckpointKind(kind),
                step=step,
                uri=store.uri_of(job_key(self.job_id, directory)),
                files=stored,
                created_at=utcnow(),
            )
            session.commit()
        return {**files, CheckpointManifest.FILENAME: (source / CheckpointManifest.FILENAME).read_bytes()}

    def stored(self, path: str) -> Path:
        """The store's copy of a file of the job (the default store: TUNEQ_HOME/runs)."""
        return get_settings().runs_dir / self.job_id / path


@contextmanager
def serve_api(tuneq_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedApi]:
    import uvicorn

    from api.main import create_app

    monkeypatch.setenv("TUNEQ_DATABASE_URL", f"sqlite:///{tuneq_home / 'tuneq.sqlite'}")
    clear_caches()
    init_db()  # what the app's lifespan does (left off: it also warms DeepSpeed's config parser)
    job_id = add_job()
    recorder = Recorder(create_app())
    port = free_port()
    config = uvicorn.Config(recorder, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.02)
    try:
        yield ServedApi(url=f"http://127.0.0.1:{port}", recorder=recorder, job_id=job_id, sources=tmp_path / "sources")
    finally:
        server.should_exit = True
        thread.join(10)


def tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
