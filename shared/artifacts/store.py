"""The artifact store: where checkpoints, exported models, adapters and training logs live.

``TUNEQ_ARTIFACTS_URI`` names it: ``s3://bucket/prefix`` on any S3 store (through s3fs, against
``TUNEQ_S3_ENDPOINT_URL`` or AWS, with the usual AWS credential chain), or a local or mounted
directory (through fsspec's local filesystem). The default is ``TUNEQ_HOME/runs``, the very
directory the ranks write into, so the embedded default stores nothing twice: publishing a
file that is already where the store keeps it only hashes it.

Keys are ``<job id>/<path in the job>`` (``<job>/checkpoints/step-00000010/...``,
``<job>/model/model.safetensors``, ``<job>/train.log``), and ``files/<file id>`` for the files
uploaded through the OpenAI-compatible API. What is in the store counts only once
SQL lists it (``shared.db.models.Artifact``, with each file's SHA-256): a file the store holds
that SQL does not list is an upload that never finished, and nothing reads it.

Torch-free; s3fs is imported only for an ``s3://`` store.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlparse

from shared.settings import Settings

logger = logging.getLogger(__name__)

HASH_CHUNK_BYTES = 8 * 1024 * 1024


class ArtifactStoreError(RuntimeError):
    """The store could not be reached or refused an operation; the message names the store."""


class ArtifactIntegrityError(RuntimeError):
    """A file read back from the store is not the file that was published (its SHA-256 differs)."""


@dataclass(frozen=True)
class StoredFile:
    """One published file: its key in the store, its size and its SHA-256."""

    key: str
    size: int
    sha256: str


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


D = TypeVar("D", bound=Digest)


def hash_into(digest: D, path: Path) -> D:
    """``digest`` updated with the bytes of ``path``, read a chunk at a time."""
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest


def sha256_of(path: Path) -> str:
    return hash_into(hashlib.sha256(), path).hexdigest()


class StoreOutage:
    """Failures of the store with no success between them, retried with backoff (1 s doubling
    to 30 s): how long the outage has lasted decides when its caller gives up. The worker's
    uploads (worker.publisher) and a resume's fetch (worker.checkpoint_fetch) share it."""

    FIRST_SECONDS = 1.0
    MAX_SECONDS = 30.0
    # How often a wait calls its keep-alive, whatever the backoff: a job's lease (60 s by
    # default, a few seconds in tests) must outlive every gap between keep-alives, and one call
    # per try left 30 s gaps, past a 10 s lease (issue 41).
    KEEP_ALIVE_SECONDS = 1.0

    def __init__(self) -> None:
        self.since: float | None = None
        self.delay = self.FIRST_SECONDS

    def failed(self) -> bool:
        """Note a failure; True when it begins an outage."""
        if self.since is not None:
            return False
        self.since = time.monotonic()
        return True

    def would_outlast(self, deadline_seconds: float) -> bool:
        """Whether waiting for the next try would take the outage past ``deadline_seconds``."""
        return self.since is not None and time.monotonic() + self.delay - self.since > deadline_seconds

    def wait(self, keep_alive: Callable[[], None] = lambda: None) -> None:
        """Sleep until the next try, calling ``keep_alive`` every ``KEEP_ALIVE_SECONDS`` meanwhile
        (first at once; it may raise to end the wait)."""
        end = time.monotonic() + self.delay
        while (left := end - time.monotonic()) > 0:
            keep_alive()
            time.sleep(min(left, self.KEEP_ALIVE_SECONDS))
        self.delay = min(self.delay * 2, self.MAX_SECONDS)

    def recovered(self) -> float | None:
        """Note a success: how long the outage it ends lasted (None when there was none)."""
        if self.since is None:
            return None
        lasted = time.monotonic() - self.since
        self.since, self.delay = None, self.FIRST_SECONDS
        return lasted


def s3_filesystem(settings: Settings) -> Any:
    """An s3fs filesystem on the configured endpoint (AWS when unset)."""
    return _s3_filesystem(settings.s3_endpoint_url)


def _s3_filesystem(endpoint_url: str) -> Any:
    # One per caller: fsspec's instance cache would share a client across forked processes.
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint_url or None, skip_instance_cache=True)


def job_key(job_id: uuid.UUID | str, path: str) -> str:
    """The store key of ``path`` (relative, ``/``-separated) in a job's artifacts."""
    return f"{job_id}/{path}"


def file_key(file_id: str) -> str:
    """The store key of a file uploaded through the OpenAI-compatible API (``shared.db.models.File``)."""
    return f"files/{file_id}"


class ArtifactStore:
    """One interface over an S3 bucket prefix and a local directory, used by the API (listing,
    downloads) and the worker (publishing, resuming) alike."""

    def __init__(self, uri: str, *, s3_endpoint_url: str = "") -> None:
        parsed = urlparse(uri)
        self.uri = uri.rstrip("/")
        self.is_s3 = parsed.scheme == "s3"
        if self.is_s3:
            if not parsed.netloc:
                raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {uri!r} names no bucket: give s3://bucket[/prefix]")
            self._root = f"{parsed.netloc}{parsed.path}".rstrip("/")
            self._fs = _s3_filesystem(s3_endpoint_url)
            self._endpoint = s3_endpoint_url or "AWS"
        elif parsed.scheme in ("", "file"):
            from fsspec.implementations.local import LocalFileSystem

            local = Path(parsed.path if parsed.scheme == "file" else uri).expanduser().resolve()
            self._root = str(local)
            self._fs = LocalFileSystem()
            self._endpoint = ""
        else:
            raise ArtifactStoreError(
                f"TUNEQ_ARTIFACTS_URI {uri!r}: unsupported scheme {parsed.scheme!r}; "
                "use s3://bucket/prefix or a directory"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> ArtifactStore:
        return cls(settings.artifacts_uri, s3_endpoint_url=settings.s3_endpoint_url)

    def __str__(self) -> str:
        return f"{self.uri} (endpoint {self._endpoint})" if self.is_s3 else self.uri

    # ---- names ----------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"not a key in the store: {key!r}")
        return f"{self._root}/{key}"

    def uri_of(self, key: str) -> str:
        """What users see for a key: ``s3://bucket/prefix/key`` or a local path."""
        return f"s3://{self._path(key)}" if self.is_s3 else self._path(key)

    def local_path(self, key: str) -> Path | None:
        """The file of ``key`` on this host, for a local store; None on S3."""
        return None if self.is_s3 else Path(self._path(key))

    # ---- checks ---------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ArtifactStoreError (naming the setting and the problem) unless a file can be
        written to the store and removed: what `tuneq serve` and `tuneq worker` check before
        they start."""
        try:
            if self.is_s3:
                probe = f"{self._root}/.tuneq-write-check-{uuid.uuid4().hex}"
                self._fs.pipe_file(probe, b"ok")
                self._fs.rm_file(probe)
            else:
                Path(self._root).mkdir(parents=True, exist_ok=True)
                if not os.access(self._root, os.W_OK):
                    raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {self}: the directory is not writable")
        except ArtifactStoreError:
            raise
        except FileNotFoundError:
            bucket = self._root.split("/", 1)[0]
            raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {self}: bucket {bucket!r} does not exist") from None
        except PermissionError as e:
            raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {self}: access denied ({_reason(e)})") from None
        except Exception as e:
            problem = f"the store cannot be reached ({_reason(e)})"
            raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {self}: {problem}") from None

    # ---- writing --------------------------------------------------------------------------

    def put_file(self, source: Path, key: str) -> StoredFile:
        """Publish one local file under ``key``. Written through a temporary name on a local
        store (an S3 object appears only once its upload completes), so a reader never sees
        half of it. A file that already is where the store keeps it is only hashed."""
        size, sha256 = source.stat().st_size, sha256_of(source)
        target = self._path(key)
        if self.is_s3:
            self._fs.put_file(str(source), target)
        elif not _same_file(source, Path(target)):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            staging = f"{target}.{os.getpid()}.partial"
            try:
                self._fs.put_file(str(source), staging)
                os.replace(staging, target)
            except BaseException:
                Path(staging).unlink(missing_ok=True)
                raise
        return StoredFile(key=key, size=size, sha256=sha256)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object (a marker) under ``key``."""
        target = self._path(key)
        if not self.is_s3:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        self._fs.pipe_file(target, data)

    def delete(self, keys: list[str]) -> None:
        """Remove files (a missing one is no error)."""
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        if self.is_s3:
            self._fs.rm(paths)
            return
        for path in paths:
            Path(path).unlink(missing_ok=True)

    # ---- reading --------------------------------------------------------------------------

    def open(self, key: str) -> IO[bytes]:
        """A seekable binary file of ``key`` (ranged reads on S3)."""
        if self.is_s3:
            return self._fs.open(self._path(key), "rb", block_size=HASH_CHUNK_BYTES, cache_type="readahead")
        return Path(self._path(key)).open("rb")

    def read_bytes(self, key: str) -> bytes:
        """The whole of a small object; FileNotFoundError when the store has no ``key``."""
        return bytes(self._fs.cat_file(self._path(key)))

    def get_file(self, key: str, target: Path, *, sha256: str) -> None:
        """Copy ``key`` to ``target`` and check it is the file that was published before it
        takes the name: ranks load checkpoints with pickle, so a changed file must never reach one."""
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            self._fs.get_file(self._path(key), str(staging))
            found = sha256_of(staging)
            if found != sha256:
                raise ArtifactIntegrityError(
                    f"{self.uri_of(key)} is not the file that was published (SHA-256 {found[:12]}…, "
                    f"recorded {sha256[:12]}…): it was changed in the store"
                )
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)

    def presigned_url(self, key: str, *, seconds: int) -> str | None:
        """A URL anyone may GET ``key`` from for ``seconds``; None for a local store."""
        if not self.is_s3:
            return None
        return str(self._fs.sign(self._path(key), expiration=seconds))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _reason(error: BaseException) -> str:
    """The innermost message of an error (botocore and aiohttp wrap the useful one)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__ or error
    return str(error) or type(error).__name__
