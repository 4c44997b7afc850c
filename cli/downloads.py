"""Downloading a job's checkpoint over HTTP: which checkpoint, its files, and a download that
resumes where one cut short stopped and checks every file's size and SHA-256.

A download collects its files in a staging directory beside its destination
(``.<name>.partial``) and renames it once every file is there and checked; the same command run
again resumes from what the staging directory holds, and, once the destination holds the
checkpoint, checks it again and changes nothing. Logs and raises (``ClientError``), never prints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from cli.api_client import ClientError, ServerUnreachable, TuneqClient
from shared.artifacts.store import hash_into, sha256_of
from shared.jobs.run_layout import CheckpointManifest, write_json_atomic

logger = logging.getLogger(__name__)

KIND_PREFERENCE = ("model", "adapter", "deepspeed")
# Files of a checkpoint as the server lists them (GET /jobs/{id}/artifacts): each checkpoint
# directory holds its manifest at its top level, so the manifest's directory is the checkpoint's.
MANIFEST_NAME = CheckpointManifest.FILENAME
# In a staging directory: the version (SHA-256) each partial file is a copy of, so that its
# resume asks the server to continue only that version (If-Range) and gets the whole file otherwise.
DOWNLOAD_STATE_NAME = ".tuneq-download.json"


class ChecksumMismatch(ClientError):
    """A downloaded file is not the file the server lists (its size or SHA-256 differs)."""


def pick_checkpoint(checkpoints: list[dict[str, Any]], *, step: int | None, kind: str | None) -> dict[str, Any]:
    """The newest checkpoint of ``kind`` (default: ``model``, else ``adapter``), or the one at
    ``step`` (without ``kind``: ``model``, else ``adapter``, else ``deepspeed`` at that step)."""
    if step is not None:
        at_step = [c for c in checkpoints if c["step"] == step]
        kinds: tuple[str, ...] = (kind,) if kind else KIND_PREFERENCE
        for wanted in kinds:
            found = [c for c in at_step if c["kind"] == wanted]
            if found:
                return found[0]
        have = ", ".join(f"{c['kind']}@{c['step']}" for c in checkpoints) or "none"
        raise ClientError(f"no {kind or ''} checkpoint at step {step} (the job has: {have})".replace("  ", " "))
    preferred: tuple[str, ...] = (kind,) if kind else KIND_PREFERENCE[:2]
    for wanted in preferred:
        found = [c for c in checkpoints if c["kind"] == wanted]
        if found:
            return max(found, key=lambda c: int(c["step"]))
    have = ", ".join(f"{c['kind']}@{c['step']}" for c in checkpoints) or "none yet"
    wanted_text = kind or "model or adapter"
    raise ClientError(f"the job has no {wanted_text} checkpoint (it has: {have})")


@dataclass(frozen=True)
class RemoteFile:
    """One file of a checkpoint: ``path`` in the job's artifacts, ``name`` in the checkpoint's
    directory (``/``-separated), with the size and SHA-256 the server lists."""

    path: str
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class FetchResult:
    received: int  # the bytes the server sent this time
    resumed: int  # the bytes kept from the copy that was already there


def partial_bytes(target: Path, size: int) -> int:
    """How much of a file of ``size`` bytes the copy at ``target`` may hold: its length, or 0
    when there is none or it is longer than the file (it is fetched anew)."""
    try:
        have = target.stat().st_size
    except FileNotFoundError:
        return 0
    return have if have <= size else 0


def _range_start(content_range: str | None) -> int | None:
    """The first byte of a ``Content-Range: bytes N-M/T`` answer."""
    match = re.fullmatch(r"bytes (\d+)-\d+/(?:\d+|\*)", (content_range or "").strip())
    return int(match.group(1)) if match else None


def fetch_file(
    client: TuneqClient,
    job_id: str,
    file: RemoteFile,
    target: Path,
    *,
    partial_of: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> FetchResult:
    """Stream one file of the job's artifacts to ``target``, a chunk at a time, and check
    its size and SHA-256 against the listing's.

    What ``target`` holds counts: a whole copy whose SHA-256 matches is not fetched again;
    a shorter one continues with ``Range: bytes=<have>-`` and ``If-Range: "<sha256>"``
    (``partial_of``: the version it is a copy of, default the listed one), and a 200 in
    place of a 206 starts it over. Redirects (a presigned URL) are followed; httpx sends
    the API key to no other host. ``progress`` gets each change in the bytes of ``target``
    that count: the bytes received, and minus what a copy dropped had counted. A file that
    does not match is deleted and raises ChecksumMismatch; a dropped connection raises
    ServerUnreachable and leaves what arrived for the next try."""
    advance = progress or (lambda _n: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    have = partial_bytes(target, file.size)
    if target.is_file() and have == file.size:
        if sha256_of(target) == file.sha256:
            return FetchResult(received=0, resumed=have)
        logger.info("%s is complete but not the listed file: fetching it again", target)
        advance(-have)
        have = 0
    # Identity: the byte offsets of a Range are the file's own, not those of an encoding.
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers.update({"Range": f"bytes={have}-", "If-Range": f'"{partial_of or file.sha256}"'})
    url = f"/jobs/{job_id}/artifacts/{quote(file.path, safe='/')}"
    digest = hashlib.sha256()
    received = 0
    action = f"download {file.path} of job {job_id}"
    try:
        with client.stream("GET", url, headers=headers, follow_redirects=True, action=action) as response:
            if response.status_code == 206 and have:
                start = _range_start(response.headers.get("content-range"))
                if start != have:
                    raise ClientError(f"asked for {file.path} from byte {have}; the server sent from byte {start}")
                hash_into(digest, target)
                mode = "ab"
            elif response.status_code == 200:
                if have:
                    logger.info("%s changed since the partial copy: fetching all of it", file.path)
                    advance(-have)
                    have = 0
                mode = "wb"
            else:
                raise ClientError(f"GET {url} answered {response.status_code} {response.reason_phrase}")
            with target.open(mode) as out:
                for chunk in response.iter_bytes():  # as they arrive: a drop loses nothing received
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    advance(len(chunk))
    except httpx.TooManyRedirects:
        raise ClientError(f"GET {url} redirected too many times") from None
    got = have + received
    if got < file.size:
        raise ServerUnreachable(f"the server sent {got} of the {file.size} bytes of {file.path}")
    found = digest.hexdigest()
    if got != file.size or found != file.sha256:
        target.unlink(missing_ok=True)
        advance(-got)
        raise ChecksumMismatch(
            f"{file.path} is not the file the server lists ({got} bytes with SHA-256 {found[:12]}…, "
            f"listed: {file.size} bytes with SHA-256 {file.sha256[:12]}…): deleted it; the same "
            "command fetches it again"
        )
    return FetchResult(received=received, resumed=have)


def checkpoint_files(artifacts: list[dict[str, Any]], checkpoint: dict[str, Any]) -> list[RemoteFile]:
    """The files of ``checkpoint`` (a row of GET /jobs/{id}/checkpoints) among the job's
    ``artifacts``: those of its kind and step under its manifest's directory, named relative
    to that directory."""
    kind, step = checkpoint["kind"], checkpoint["step"]
    mine = [a for a in artifacts if a.get("kind") == kind and a.get("step") == step]
    manifests = [str(a["path"]) for a in mine if posixpath.basename(str(a["path"])) == MANIFEST_NAME]
    if not manifests:
        raise ClientError(
            f"the server lists no files of the {kind} checkpoint at step {step} "
            f"(no {MANIFEST_NAME} among the job's artifacts)"
        )
    # Two directories of one kind and step (never written by tuneq): the one the checkpoint's uri names.
    uri = str(checkpoint.get("uri") or "").rstrip("/")
    manifest = next((m for m in manifests if uri.endswith(f"/{posixpath.dirname(m)}")), manifests[0])
    directory = posixpath.dirname(manifest)
    prefix = f"{directory}/" if directory else ""
    files: list[RemoteFile] = []
    for artifact in mine:
        path = str(artifact["path"])
        if not path.startswith(prefix):
            continue
        name = path[len(prefix) :]
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise ClientError(f"the server lists a file named {path!r}: not a file name to write here")
        files.append(RemoteFile(path=path, name=name, size=int(artifact["size"]), sha256=str(artifact["sha256"])))
    return sorted(files, key=lambda f: f.name)


def staging_dir(output: Path) -> Path:
    """Where a download into ``output`` collects its files: a stable name beside it, so the
    same command run again finds what a download cut short left."""
    return output.parent / f".{output.name}.partial"


@dataclass(frozen=True)
class DownloadPlan:
    """A checkpoint to download: its files, where they go, and where they are collected.
    ``done``: ``output`` holds the checkpoint's files already (a download run again), to be
    checked, not fetched."""

    job_id: str
    checkpoint: dict[str, Any]
    files: list[RemoteFile]
    output: Path
    staging: Path
    done: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def target(self, file: RemoteFile) -> Path:
        return self.staging.joinpath(*file.name.split("/"))

    def kept_bytes(self) -> int:
        """What an earlier download left in the staging directory (checked as it is used)."""
        if self.done:
            return 0  # the check counts the files as it reads them
        return sum(partial_bytes(self.target(f), f.size) for f in self.files)


@dataclass(frozen=True)
class DownloadResult:
    output: Path
    files: int
    bytes: int  # the size of the checkpoint's files
    received_bytes: int  # what the server sent this time
    resumed_bytes: int  # what was kept from an earlier download
    already_there: bool = False  # the output held the checkpoint already: checked, nothing fetched


def _files_in(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() or p.is_symlink()}


def plan_download(client: TuneqClient, job_id: str, checkpoint: dict[str, Any], output: Path) -> DownloadPlan:
    """What downloading ``checkpoint`` into ``output`` takes; raises ClientError when the
    server lists no files for it, or ``output`` exists and is neither an empty directory nor
    one holding the checkpoint's files (an earlier download of it: ``done``)."""
    output = Path(os.path.abspath(output))
    files = checkpoint_files(client.artifacts(job_id), checkpoint)
    plan = DownloadPlan(job_id=job_id, checkpoint=checkpoint, files=files, output=output, staging=staging_dir(output))
    if not output.exists():
        return plan
    if not output.is_dir():
        raise ClientError(f"{output} already exists and is not a directory: choose another destination")
    present = _files_in(output)
    if not present:
        return plan
    if present == {f.name for f in files}:
        return replace(plan, done=True)
    raise ClientError(
        f"{output} already exists and holds other files than the {checkpoint['kind']} checkpoint at step "
        f"{checkpoint['step']}: choose another destination"
    )


def check_download(plan: DownloadPlan, *, progress: Callable[[int], None] | None = None) -> DownloadResult:
    """Check that the files a download put in ``plan.output`` are still the listed ones (size,
    then SHA-256), fetching and changing nothing; raises ChecksumMismatch naming the first that
    is not. ``progress`` gets the bytes of each file checked."""
    for file in plan.files:
        path = plan.output.joinpath(*file.name.split("/"))
        size = path.stat().st_size
        found = sha256_of(path) if size == file.size else None
        if found != file.sha256:
            what = f"{size} bytes" if found is None else f"SHA-256 {found[:12]}…"
            raise ChecksumMismatch(
                f"{path} is not the file the server lists ({what}; listed: {file.size} bytes with SHA-256 "
                f"{file.sha256[:12]}…): remove {plan.output} to download the checkpoint again"
            )
        if progress is not None:
            progress(file.size)
    logger.info("%s holds the checkpoint's %d files, checked", plan.output, len(plan.files))
    return DownloadResult(
        output=plan.output,
        files=len(plan.files),
        bytes=plan.total_bytes,
        received_bytes=0,
        resumed_bytes=0,
        already_there=True,
    )


def download_checkpoint(
    client: TuneqClient,
    plan: DownloadPlan,
    *,
    progress: Callable[[int], None] | None = None,
    on_file: Callable[[RemoteFile], None] | None = None,
) -> DownloadResult:
    """Fetch the plan's files into its staging directory (resuming what is there), check each
    against its SHA-256, and rename the directory to the plan's output once all are there; a
    plan that is ``done`` is only checked (``check_download``). ``progress`` gets each change in
    the bytes collected (see ``fetch_file``); ``on_file`` is called with each file as its turn
    comes."""
    if plan.done:
        return check_download(plan, progress=progress)
    staging = plan.staging
    staging.mkdir(parents=True, exist_ok=True)
    state_path = staging / DOWNLOAD_STATE_NAME
    versions = _read_versions(state_path)
    received = resumed = 0
    for file in plan.files:
        if on_file is not None:
            on_file(file)
        target = plan.target(file)
        before = target.stat().st_size if target.exists() else None
        try:
            fetched = fetch_file(
                client, plan.job_id, file, target, partial_of=versions.get(file.path), progress=progress
            )
        except ServerUnreachable as e:
            raise ServerUnreachable(
                f"{e.message}; what arrived is kept in {staging}: the same command resumes the download"
            ) from None
        finally:
            # What this fetch wrote is of the listed version: the server continues a copy (206)
            # only when the copy already was of it.
            if (target.stat().st_size if target.exists() else None) != before:
                versions[file.path] = file.sha256
                write_json_atomic(state_path, versions)
        received += fetched.received
        resumed += fetched.resumed
    _keep_only(staging, {plan.target(f) for f in plan.files})
    output = plan.output
    try:
        if output.exists():
            output.rmdir()  # an empty directory (plan_download checked), replaced by the download
        staging.rename(output)
    except OSError as e:
        raise ClientError(f"could not move the download from {staging} to {output}: {e}") from None
    logger.info("downloaded %d files (%d bytes, %d resumed) to %s", len(plan.files), received, resumed, output)
    return DownloadResult(
        output=output,
        files=len(plan.files),
        bytes=plan.total_bytes,
        received_bytes=received,
        resumed_bytes=resumed,
    )


def _read_versions(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _keep_only(directory: Path, keep: set[Path]) -> None:
    """Remove from ``directory`` every file not in ``keep`` (the download state, files of an
    earlier listing) and the directories left empty."""
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path not in keep:
            path.unlink()
