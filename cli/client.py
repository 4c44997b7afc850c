"""The ``tuneq`` command-line client: ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``, ``pause``,
``resume``, ``download``.

A thin layer over the HTTP API (README, "The HTTP API"). ``TUNEQ_URL`` (default
``http://127.0.0.1:8000``) names the server and ``TUNEQ_API_KEY``, when set, is sent as
``Authorization: Bearer <key>``. These are client settings, read here, not the server's
``Settings``.

The first half is a library (``TuneqClient``, the job-event stream, the follow state, checkpoint
selection and download) that logs and raises, never prints; the second half is the typer
commands, registered on the ``tuneq`` app by ``register(app)``.

Exit codes (README, "Command line client"): 0 success (``--follow``: the job succeeded),
1 the job failed or a download was not possible, 2 bad usage, 3 the job was cancelled,
4 the API refused the request, 5 the server could not be reached, 130 interrupted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlparse

import httpx
import typer
from httpx_sse import ServerSentEvent, connect_sse

from shared.artifacts.store import hash_into, sha256_of
from shared.jobs.run_layout import CheckpointManifest, write_json_atomic
from shared.jobs.status import TERMINAL_STATUSES

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed; a download could not be made
EXIT_USAGE = 2  # click's own code for bad options
EXIT_CANCELLED = 3
EXIT_API_ERROR = 4  # the server answered 4xx/5xx
EXIT_UNREACHABLE = 5  # no answer: connection refused, timeout, stream lost for good
EXIT_INTERRUPTED = 130

REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# The SSE stream sends a ": ping" every 15 s; a minute of silence means the connection is gone.
STREAM_READ_TIMEOUT = 60.0
RECONNECT_FOR_SECONDS = 120.0  # how long a dropped event stream is retried before giving up
RETRYABLE_STATUS = frozenset({502, 503, 504})
# How long a job whose stream ended is read again while the API still answers its older read.
ENDED_JOB_READ_SECONDS = 10.0


# ---- settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSettings:
    url: str = DEFAULT_URL
    api_key: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClientSettings:
        env = os.environ if environ is None else environ
        url = (env.get("TUNEQ_URL") or DEFAULT_URL).strip().rstrip("/")
        key = (env.get("TUNEQ_API_KEY") or "").strip() or None
        return cls(url=url, api_key=key)


# ---- errors -----------------------------------------------------------------------------


class ClientError(Exception):
    """Something the user must be told, with the exit code the command ends with."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ApiError(ClientError):
    exit_code = EXIT_API_ERROR

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code

    @classmethod
    def from_response(cls, response: httpx.Response, *, api_key_set: bool) -> ApiError:
        return cls(response.status_code, describe_error(response, api_key_set=api_key_set))


class ServerUnreachable(ClientError):
    exit_code = EXIT_UNREACHABLE


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        return body["detail"]
    return body


def _detail_text(detail: Any) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        return "; ".join(_problem_line(p) for p in detail)
    return json.dumps(detail)


def _problem_line(problem: Any) -> str:
    if isinstance(problem, dict):
        loc = ".".join(str(part) for part in problem.get("loc") or [])
        msg = str(problem.get("msg", problem))
        return f"{loc}: {msg}" if loc else msg
    return str(problem)


def describe_error(response: httpx.Response, *, api_key_set: bool) -> str:
    """One message (several lines for 422) saying what the server refused and what to do."""
    code = response.status_code
    detail = _detail(response)
    text = _detail_text(detail)
    if code == 401:
        if api_key_set:
            return f"the server refused the API key in TUNEQ_API_KEY (401 unauthorized): {text}"
        return f"the server wants an API key (401 unauthorized): set TUNEQ_API_KEY: {text}"
    if code == 403:
        return f"forbidden (403): this API key may not do that: {text}"
    if code == 404:
        return f"not found (404): {text}"
    if code == 409:
        return f"conflict (409): {text}"
    if code == 422:
        problems = detail if isinstance(detail, list) else [detail]
        lines = [_problem_line(p) for p in problems]
        return "the server refused the job (422):\n" + "\n".join(f"  {line}" for line in lines)
    if code == 429:
        retry = response.headers.get("retry-after")
        later = f"; retry after {retry} s" if retry else "; retry later"
        return f"too many requests (429): {text}{later}"
    return f"the server answered {code} {response.reason_phrase}: {text}"


# ---- job events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobEvent:
    """One job event as the stream carries it (the API's ``EventPublic``)."""

    id: int
    type: str
    data: dict[str, Any]
    created_at: str | None = None

    @classmethod
    def from_message(cls, message: ServerSentEvent) -> JobEvent:
        body = json.loads(message.data)
        event_id = body.get("id", message.id)
        return cls(
            id=int(event_id),
            type=str(body.get("type") or message.event),
            data=dict(body.get("data") or {}),
            created_at=body.get("created_at"),
        )

    @property
    def terminal_status(self) -> str | None:
        status = self.data.get("status") if self.type == "status" else None
        return status if status in TERMINAL_STATUSES else None


# ---- the HTTP client -----------------------------------------------------------------------


class TuneqClient:
    """The tuneq API over httpx, with timeouts; raises ``ClientError`` subclasses."""

    def __init__(
        self,
        settings: ClientSettings | None = None,
        *,
        timeout: httpx.Timeout = REQUEST_TIMEOUT,
        stream_read_timeout: float = STREAM_READ_TIMEOUT,
        reconnect_for: float = RECONNECT_FOR_SECONDS,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings or ClientSettings.from_env()
        headers = {"User-Agent": "tuneq-cli"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        self.timeout = timeout
        self.stream_read_timeout = stream_read_timeout
        self.reconnect_for = reconnect_for
        self._http = httpx.Client(base_url=self.settings.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TuneqClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _unreachable(self, error: httpx.TransportError) -> ServerUnreachable:
        url = self.settings.url
        if isinstance(error, httpx.ConnectError):
            return ServerUnreachable(f"cannot connect to {url} ({error}): is `tuneq serve` running at {url}?")
        if isinstance(error, httpx.TimeoutException):
            return ServerUnreachable(f"the server at {url} did not answer in time ({type(error).__name__})")
        return ServerUnreachable(f"lost the connection to {url}: {error or type(error).__name__}")

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_error:
            raise ApiError.from_response(response, api_key_set=self.settings.api_key is not None)
        return response

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        return self._check(response)

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        body = self.request(method, path, **kwargs).json()
        if not isinstance(body, dict):
            raise ClientError(f"unexpected answer from {method} {path}: {body!r}")
        return body

    # -- the endpoints --

    def submit(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json("POST", "/jobs", json=body, headers=headers)

    def list_jobs(self, *, status: str | None = None, skip: int = 0, limit: int = 50) -> dict[str, Any]:
        params: dict[str, Any] = {"skip": skip, "limit": limit}
        if status is not None:
            params["status"] = status
        return self._json("GET", "/jobs", params=params)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}")

    def get_ended_job(self, job_id: str, *, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
        """The job once its event stream showed it ended. An API process answers ``GET
        /jobs/{id}`` from its read of the job up to ``TUNEQ_JOB_CACHE_SECONDS`` (1 s) old, so
        right after the end it may still say ``cancelling`` or ``running``: asked again until
        it shows the end too, for up to ``ENDED_JOB_READ_SECONDS``."""
        deadline = time.monotonic() + ENDED_JOB_READ_SECONDS
        job = self.get_job(job_id)
        while job["status"] not in TERMINAL_STATUSES and time.monotonic() < deadline:
            sleep(0.25)
            job = self.get_job(job_id)
        return job

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/cancel")

    def pause(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/pause")

    def resume(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/resume")

    def metrics(self, job_id: str, *, points: int | None = None) -> list[dict[str, Any]]:
        """The job's per-step metrics in step order, fetched a page at a time; with ``points``,
        at most that many rows spread evenly over the run (for a chart of a long run)."""
        rows: list[dict[str, Any]] = []
        params: dict[str, Any] = {"after": 0}
        if points is not None:
            params.update(points=points, limit=points)  # one page: stretches span the whole run
        while True:
            page = self._json("GET", f"/jobs/{job_id}/metrics", params=params)
            rows += page["data"]
            if not page["has_more"]:
                return rows
            params["after"] = page["next_after"]

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._json("GET", f"/jobs/{job_id}/checkpoints")["data"])

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        """Every published file of the job: path, kind, step, size, sha256."""
        return list(self._json("GET", f"/jobs/{job_id}/artifacts")["data"])

    def fetch_artifact(
        self,
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
        try:
            with self._http.stream("GET", url, headers=headers, follow_redirects=True) as response:
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
                    response.read()
                    self._check(response)
                    raise ClientError(f"GET {url} answered {response.status_code} {response.reason_phrase}")
                with target.open(mode) as out:
                    for chunk in response.iter_bytes():  # as they arrive: a drop loses nothing received
                        out.write(chunk)
                        digest.update(chunk)
                        received += len(chunk)
                        advance(len(chunk))
        except httpx.TooManyRedirects:
            raise ClientError(f"GET {url} redirected too many times") from None
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
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

    def logs(self, job_id: str, *, tail: int = 200) -> list[str]:
        return [str(line) for line in self._json("GET", f"/jobs/{job_id}/logs", params={"tail": tail})["lines"]]

    def follow_logs(self, job_id: str, *, tail: int = 200) -> Iterator[str]:
        """The last ``tail`` lines, then new ones until the job ends (the server ends the body)."""
        # Training can be quiet for long stretches and this stream has no pings: no read timeout.
        timeout = httpx.Timeout(self.timeout.connect, read=None)
        try:
            with self._http.stream(
                "GET", f"/jobs/{job_id}/logs", params={"tail": tail, "follow": "true"}, timeout=timeout
            ) as response:
                if response.is_error:
                    response.read()
                    self._check(response)
                yield from response.iter_lines()
        except httpx.TransportError as e:
            raise self._unreachable(e) from None

    def stream_events(
        self, job_id: str, *, after: int = 0, sleep: Callable[[float], None] = time.sleep
    ) -> Iterator[JobEvent]:
        """Job events after cursor ``after`` until the terminal status, reconnecting with
        ``Last-Event-ID`` when the connection drops (for up to ``reconnect_for`` seconds
        without an event). Ends early only when the server ends the stream with nothing new
        and the job has ended (its terminal status was before the cursor)."""
        cursor = after
        connected_once = False
        failing_since: float | None = None
        delay = 0.25
        while True:
            headers = {"Last-Event-ID": str(cursor)} if cursor else {}
            timeout = httpx.Timeout(self.timeout.connect, read=self.stream_read_timeout)
            received = 0
            problem: str
            try:
                with connect_sse(
                    self._http, "GET", f"/jobs/{job_id}/events/stream", headers=headers, timeout=timeout
                ) as source:
                    response = source.response
                    if response.is_error:
                        response.read()
                        if not (connected_once and response.status_code in RETRYABLE_STATUS):
                            self._check(response)
                        problem = f"the server answered {response.status_code}"
                    else:
                        connected_once = True
                        # A message is dispatched only at its blank line: one cut off by a dropped
                        # connection is never seen, so the reconnect from the last id gets it whole.
                        for message in source.iter_sse():
                            if not message.data:
                                continue  # the pings after the first id: no data, nothing to do
                            event = JobEvent.from_message(message)
                            cursor = max(cursor, event.id)
                            received += 1
                            failing_since, delay = None, 0.25
                            yield event
                            if event.terminal_status is not None:
                                return
                        if received == 0 and self.get_job(job_id)["status"] in TERMINAL_STATUSES:
                            return
                        problem = "the server ended the stream before the job ended"
            except httpx.TransportError as e:
                if not connected_once:
                    raise self._unreachable(e) from None
                problem = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            failing_since = failing_since if failing_since is not None else now
            if now - failing_since > self.reconnect_for:
                raise ServerUnreachable(
                    f"lost the event stream of job {job_id} at {self.settings.url} ({problem}) and could "
                    f"not get it back for {self.reconnect_for:.0f} s"
                )
            logger.warning("event stream of job %s dropped (%s); reconnecting after event %d", job_id, problem, cursor)
            sleep(delay)
            delay = min(delay * 2, 5.0)


# ---- following a job -------------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def format_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate / 1000:.1f}k" if rate >= 10_000 else f"{rate:.0f}"


# A DPO job's measures, as `show` prints them: (the key in the job's latest_metrics and in its
# metric events, TRL's name). GET /jobs/{id}/metrics answers them under TRL's names.
PREFERENCE_MEASURES = (
    ("rewards_chosen", "rewards/chosen"),
    ("rewards_rejected", "rewards/rejected"),
    ("rewards_margins", "rewards/margins"),
    ("rewards_accuracies", "rewards/accuracies"),
    ("eval_rewards_accuracies", "eval_rewards/accuracies"),
)
PHASE_NAMES = {"reference_logps": "reference log-probabilities"}


def format_measure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def phase_text(phase: dict[str, Any]) -> str:
    """A phase report (work before the first step) as a line: its progress, or that it was
    found computed."""
    name = PHASE_NAMES.get(str(phase.get("name")), str(phase.get("name")))
    total = phase.get("total")
    if phase.get("cached"):
        return f"{name}: found cached ({total} pairs)"
    return f"{name}: {phase.get('done')}/{total} pairs"


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass
class FollowState:
    """What a follow shows, updated from the job and its events. ``apply`` returns the line
    a plain (non-TTY) follow prints for an event, or None."""

    job_id: str
    status: str = "queued"
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    # A DPO job's: the share of pairs whose chosen answer has the higher reward, and the mean margin.
    reward_accuracy: float | None = None
    reward_margin: float | None = None
    error: dict[str, Any] | None = None
    _origin: tuple[int, datetime] | None = field(default=None, repr=False)

    @classmethod
    def from_job(cls, job: dict[str, Any]) -> FollowState:
        state = cls(job_id=str(job["id"]))
        state.update_from_job(job)
        return state

    def update_from_job(self, job: dict[str, Any]) -> None:
        self.status = str(job.get("status") or self.status)
        self.step = int(job.get("step") or 0)
        self.total_steps = job.get("total_steps") or self.total_steps
        self.eta_seconds = job.get("eta_seconds")
        self.error = job.get("error")
        latest = job.get("latest_metrics") or {}
        self.loss = latest.get("loss", self.loss)
        self.tokens_per_second = latest.get("tokens_per_second", self.tokens_per_second)
        self.reward_accuracy = latest.get("rewards_accuracies", self.reward_accuracy)
        self.reward_margin = latest.get("rewards_margins", self.reward_margin)

    @property
    def progress_text(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        text = (
            f"step {self.step}/{total} loss {format_loss(self.loss)} "
            f"{format_rate(self.tokens_per_second)} tok/s eta {format_duration(self.eta_seconds)}"
        )
        if self.reward_accuracy is None and self.reward_margin is None:
            return text
        return (
            f"{text} rewards/accuracies {format_measure(self.reward_accuracy)} "
            f"rewards/margins {format_measure(self.reward_margin)}"
        )

    def apply(self, event: JobEvent) -> str | None:
        data = event.data
        if event.type == "status":
            self.status = str(data.get("status", self.status))
            if data.get("error"):
                self.error = data["error"]
            if self.status == "running" and data.get("attempt"):
                return f"running (attempt {data['attempt']})"
            if self.status == "paused":
                if data.get("step") is not None:
                    self.step = int(data["step"])
                return f"paused at step {self.step} (`tuneq resume {self.job_id}` continues it)"
            return None if self.status in TERMINAL_STATUSES else self.status
        if event.type == "plan":
            if data.get("total_steps") is not None:
                self.total_steps = int(data["total_steps"])
            extras = [f"kernels: {', '.join(data['kernels'])}"] if data.get("kernels") else []
            extras += ["compiled"] if data.get("compiled") else []
            text = f"plan: {self.total_steps} steps on {data.get('world_size', '?')} rank(s)"
            return "; ".join([text, *extras])
        if event.type == "metric":
            self._metric(data)
            return self.progress_text
        if event.type == "checkpoint":
            return f"checkpoint {data.get('kind')} at step {data.get('step')}: {data.get('uri')}"
        if event.type == "resumed":
            self._origin = None
            self.step = int(data.get("from_step") or 0)
            return f"resumed from step {data.get('from_step')} (attempt {data.get('attempt')})"
        if event.type == "warning":
            return f"warning: {data.get('message')}"
        if event.type == "phase":
            return phase_text(data)
        if event.type == "download":
            done, total = data.get("bytes_done") or 0, data.get("bytes_total")
            of = f"/{total / 1e6:.1f}" if total else ""
            state = "done" if data.get("finished") else "downloading"
            return f"{state} {data.get('field', 'dataset')}: {done / 1e6:.1f}{of} MB"
        return None  # log lines: `tuneq logs` shows them

    def _metric(self, data: dict[str, Any]) -> None:
        step = int(data.get("step") or self.step)
        self.step = step
        if data.get("loss") is not None:
            self.loss = float(data["loss"])
        if data.get("tokens_per_second") is not None:
            self.tokens_per_second = float(data["tokens_per_second"])
        if data.get("rewards_accuracies") is not None:
            self.reward_accuracy = float(data["rewards_accuracies"])
        if data.get("rewards_margins") is not None:
            self.reward_margin = float(data["rewards_margins"])
        when = _parse_time(data.get("time"))
        if when is None:
            return
        if self._origin is None or step <= self._origin[0]:
            self._origin = (step, when)
            return
        origin_step, origin_time = self._origin
        if self.total_steps is not None:
            per_step = (when - origin_time).total_seconds() / (step - origin_step)
            self.eta_seconds = max(0.0, per_step * (self.total_steps - step))

    def outcome_line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        where = f"at step {self.step}/{total}"
        if self.status == "succeeded":
            return f"job {self.job_id} succeeded {where} (loss {format_loss(self.loss)})"
        if self.status == "failed":
            err = self.error or {}
            return f"job {self.job_id} failed {where}: {err.get('code', 'unknown')}: {err.get('message', '')}"
        return f"job {self.job_id} {self.status} {where}"


def exit_code_for(status: str) -> int:
    return {"succeeded": EXIT_OK, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}.get(status, EXIT_FAILED)


# ---- downloading checkpoints ----------------------------------------------------------------

KIND_PREFERENCE = ("model", "adapter", "deepspeed")


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


# Files of a checkpoint as the server lists them (GET /jobs/{id}/artifacts): each checkpoint
# directory holds its manifest at its top level, so the manifest's directory is the checkpoint's.
MANIFEST_NAME = CheckpointManifest.FILENAME
# In a staging directory: the version (SHA-256) each partial file is a copy of, so that its
# resume asks the server to continue only that version (If-Range) and gets the whole file otherwise.
DOWNLOAD_STATE_NAME = ".tuneq-download.json"


class ChecksumMismatch(ClientError):
    """A downloaded file is not the file the server lists (its size or SHA-256 differs)."""


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
    """A checkpoint to download: its files, where they go, and where they are collected."""

    job_id: str
    checkpoint: dict[str, Any]
    files: list[RemoteFile]
    output: Path
    staging: Path

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def target(self, file: RemoteFile) -> Path:
        return self.staging.joinpath(*file.name.split("/"))

    def kept_bytes(self) -> int:
        """What an earlier download left in the staging directory (checked as it is used)."""
        return sum(partial_bytes(self.target(f), f.size) for f in self.files)


@dataclass(frozen=True)
class DownloadResult:
    output: Path
    files: int
    bytes: int  # the size of the checkpoint's files
    received_bytes: int  # what the server sent this time
    resumed_bytes: int  # what was kept from an earlier download


def plan_download(client: TuneqClient, job_id: str, checkpoint: dict[str, Any], output: Path) -> DownloadPlan:
    """What downloading ``checkpoint`` into ``output`` takes; raises ClientError when
    ``output`` exists and is not an empty directory, or the server lists no files for it."""
    output = Path(os.path.abspath(output))
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ClientError(f"{output} already exists and is not an empty directory: choose another destination")
    files = checkpoint_files(client.artifacts(job_id), checkpoint)
    return DownloadPlan(job_id=job_id, checkpoint=checkpoint, files=files, output=output, staging=staging_dir(output))


def download_checkpoint(
    client: TuneqClient,
    plan: DownloadPlan,
    *,
    progress: Callable[[int], None] | None = None,
    on_file: Callable[[RemoteFile], None] | None = None,
) -> DownloadResult:
    """Fetch the plan's files into its staging directory (resuming what is there), check each
    against its SHA-256, and rename the directory to the plan's output once all are there.
    ``progress`` gets each change in the bytes collected (see ``TuneqClient.fetch_artifact``);
    ``on_file`` is called with each file as its turn comes."""
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
            fetched = client.fetch_artifact(
                plan.job_id, file, target, partial_of=versions.get(file.path), progress=progress
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


# ---- the commands ----------------------------------------------------------------------------


def _console(*, stderr: bool = False) -> Any:
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        # Piped: no colours, and wide enough that tables never wrap an id.
        console = Console(stderr=stderr, highlight=False, width=max(console.width, 200), no_color=True)
    return console


def _stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def _fail(error: ClientError) -> typer.Exit:
    typer.echo(f"tuneq: {error.message}", err=True)
    return typer.Exit(error.exit_code)


def _client() -> TuneqClient:
    logging.basicConfig(level=logging.WARNING, format="tuneq: %(message)s")
    return TuneqClient()


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def _load_json_option(value: str, *, option: str, file_by_default: bool) -> dict[str, Any]:
    """``@path`` or a path (when ``file_by_default``) is read as a JSON file; else inline JSON."""
    text = value
    stripped = value.strip()
    is_file = stripped.startswith("@") or (file_by_default and not stripped.startswith("{"))
    if is_file:
        path = Path(stripped.removeprefix("@")).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise typer.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=option) from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON: {e}", param_hint=option) from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=option)
    return parsed


def _absolute_if_local(value: str) -> str:
    """A relative path that exists here becomes absolute (the API wants absolute paths)."""
    if urlparse(value).scheme or Path(value).is_absolute():
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def _short_time(value: Any) -> str:
    when = _parse_time(value)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if when else "-"


STATUS_STYLE = {
    "queued": "cyan",
    "running": "blue",
    "cancelling": "yellow",
    "pausing": "magenta",
    "paused": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
}


def follow_job(client: TuneqClient, job: dict[str, Any], *, live: bool, console: Any = None) -> dict[str, Any]:
    """Show a job's progress until it ends and return it as it ended. ``live``: a rich
    progress bar; otherwise one plain line per event of note."""
    job_id = str(job["id"])
    state = FollowState.from_job(job)
    if state.status in TERMINAL_STATUSES:
        return job
    console = console or _console()
    if live:
        _follow_live(client, job_id, state, console)
    else:
        for event in client.stream_events(job_id):
            line = state.apply(event)
            if line is not None:
                console.print(line, markup=False)
    final = client.get_ended_job(job_id)
    state.update_from_job(final)
    return final


def _follow_live(client: TuneqClient, job_id: str, state: FollowState, console: Any) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} tok/s"),
        TextColumn("eta {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        loss, rate, eta = _fields(state)
        task = progress.add_task(
            state.status, total=state.total_steps, completed=state.step, loss=loss, rate=rate, eta=eta
        )
        for event in client.stream_events(job_id):
            line = state.apply(event)
            if line is not None and event.type not in ("metric", "status"):
                progress.console.print(line, markup=False, highlight=False)
            loss, rate, eta = _fields(state)
            progress.update(
                task,
                description=state.status,
                total=state.total_steps,
                completed=state.step,
                loss=loss,
                rate=rate,
                eta=eta,
            )


def _fields(state: FollowState) -> tuple[str, str, str]:
    return format_loss(state.loss), format_rate(state.tokens_per_second), format_duration(state.eta_seconds)


def _finish_follow(job: dict[str, Any], *, as_json: bool) -> None:
    state = FollowState.from_job(job)
    if as_json:
        _print_json(job)
    else:
        typer.echo(state.outcome_line(), err=state.status != "succeeded")
    raise typer.Exit(exit_code_for(state.status))


def _interrupted(job_id: str) -> typer.Exit:
    typer.echo(f"\ntuneq: stopped following; job {job_id} goes on (`tuneq cancel {job_id}` stops it)", err=True)
    return typer.Exit(EXIT_INTERRUPTED)


JsonOption = Annotated[bool, typer.Option("--json", help="Print the API's JSON (one object) for scripts.")]
FollowOption = Annotated[
    bool, typer.Option("--follow", "-f", help="Show progress until the job ends; exit 0 / 1 / 3 by outcome.")
]


def submit(
    model: Annotated[
        str,
        typer.Option(
            help="A hub id (org/name), a local model directory, or one of your jobs' outputs to continue from: "
            "job:<id> (its exported model) or job:<id>@step-<n> (its checkpoint)."
        ),
    ],
    dataset: Annotated[str, typer.Option(help="A dataset path or URI (file://, s3://, https://, hf://).")],
    deepspeed: Annotated[
        str | None,
        typer.Option(
            "--deepspeed",
            help="The DeepSpeed config: a JSON file (or @file, or inline JSON). Left out, tuneq chooses one "
            "for the model's size and the workers' hardware (shown in `tuneq show`).",
        ),
    ] = None,
    num_gpus: Annotated[int, typer.Option(min=1, help="Ranks to launch on each node: GPUs, or CPU processes.")] = 1,
    num_nodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Hosts to run on at once, one worker each: the world size is nodes x GPUs per node (--num-gpus).",
        ),
    ] = 1,
    name: Annotated[str | None, typer.Option(help="A label for the job.")] = None,
    training: Annotated[
        str | None, typer.Option(help="Training options as JSON or @file, e.g. '{\"max_steps\": 100}'.")
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Makes a retried submit safe: the same key answers the same job.")
    ] = None,
    follow: FollowOption = False,
    as_json: JsonOption = False,
) -> None:
    """Submit a fine-tuning job (POST /jobs)."""
    body: dict[str, Any] = {
        "model": _absolute_if_local(model),
        "dataset": _absolute_if_local(dataset),
        "num_gpus": num_gpus,
    }
    if deepspeed is not None:
        body["deepspeed_config"] = _load_json_option(deepspeed, option="--deepspeed", file_by_default=True)
    if num_nodes != 1:
        # Only when asked for: a one-node submit's body stays what a server without
        # multi-node jobs accepts (it refuses fields it does not know).
        body["num_nodes"] = num_nodes
    if name is not None:
        body["name"] = name
    if training is not None:
        body["training"] = _load_json_option(training, option="--training", file_by_default=False)
    with _client() as client:
        try:
            job = client.submit(body, idempotency_key=idempotency_key)
        except ClientError as e:
            raise _fail(e) from None
        if not follow:
            if as_json:
                _print_json(job)
            else:
                typer.echo(f"submitted job {job['id']} ({job['status']})")
            return
        if not as_json:
            typer.echo(f"submitted job {job['id']} ({job['status']}); following it (Ctrl-C stops following)")
        _follow_and_exit(client, job, as_json=as_json)


def _follow_and_exit(client: TuneqClient, job: dict[str, Any], *, as_json: bool) -> None:
    try:
        if as_json:
            for _event in client.stream_events(str(job["id"])):
                pass
            final = client.get_ended_job(str(job["id"]))
        else:
            final = follow_job(client, job, live=_stdout_is_tty())
    except KeyboardInterrupt:
        raise _interrupted(str(job["id"])) from None
    except ClientError as e:
        raise _fail(e) from None
    _finish_follow(final, as_json=as_json)


def jobs(
    status: Annotated[
        str | None,
        typer.Option(
            help="Only jobs in this status: queued, running, cancelling, pausing, paused, succeeded, failed, cancelled."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many, newest first.")] = 50,
    skip: Annotated[int, typer.Option(min=0, help="Skip this many of the newest.")] = 0,
    as_json: JsonOption = False,
) -> None:
    """List jobs, newest first (GET /jobs)."""
    if status is not None and status not in STATUS_STYLE:
        raise typer.BadParameter(f"unknown status {status!r}: one of {', '.join(STATUS_STYLE)}", param_hint="--status")
    with _client() as client:
        try:
            page = client.list_jobs(status=status, skip=skip, limit=limit)
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(page)
        return
    console = _console()
    console.print(jobs_table(page["data"]))
    shown, count = len(page["data"]), int(page["count"])
    if shown < count:
        console.print(f"{shown} of {count} jobs (--skip/--limit for more)", markup=False)


def jobs_table(rows: list[dict[str, Any]]) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("ID", "NAME", "STATUS", "GPUS", "STEP", "LOSS", "CREATED (UTC)", "MODEL"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS", "CREATED (UTC)"))
    for job in rows:
        total = job.get("total_steps")
        latest = job.get("latest_metrics") or {}
        status = str(job["status"])
        table.add_row(
            str(job["id"]),
            # The user's own text as text: a name or path with [brackets] is not rich markup.
            Text(job.get("name") or "-"),
            f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]",
            gpus_text(job),
            f"{job.get('step', 0)}/{total if total is not None else '?'}",
            format_loss(latest.get("loss")),
            _short_time(job.get("created_at")),
            Text(Path(str(job.get("model", ""))).name or str(job.get("model"))),
        )
    return table


def gpus_text(job: dict[str, Any]) -> str:
    """A job's ranks: ``num_gpus``, or ``nodes x GPUs per node`` for a multi-node job."""
    nodes = int(job.get("num_nodes") or 1)
    return f"{nodes}x{job.get('num_gpus')}" if nodes > 1 else str(job.get("num_gpus"))


def node_line(node: dict[str, Any]) -> str:
    """One node of a multi-node job: its worker and address, its global ranks, its state, and
    why it ended the gang, if it did."""
    first, last = node["ranks"]
    line = f"worker {node['worker_id']} at {node['address']}, ranks {first}-{last}, {node['state']}"
    return f"{line}: {node['error_message']}" if node.get("error_message") else line


def describe_job(job: dict[str, Any], checkpoints: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """``show``'s rows: (label, value)."""
    total = job.get("total_steps")
    latest = job.get("latest_metrics") or {}
    training = job.get("training") or {}
    epoch = job.get("epoch")
    epoch_text = f", epoch {epoch:.2f}" if isinstance(epoch, int | float) else ""
    rows = [
        ("id", str(job["id"])),
        ("name", job.get("name") or "-"),
        ("status", str(job["status"])),
        ("model", str(job.get("model"))),
        ("dataset", str(job.get("dataset"))),
        ("num_gpus", str(job.get("num_gpus"))),
        ("num_nodes", str(job.get("num_nodes") or 1)),  # a server without multi-node jobs sends none
        ("training", json.dumps(training, sort_keys=True) if training else "{}"),
        ("created", _short_time(job.get("created_at"))),
        ("started", _short_time(job.get("started_at"))),
        ("finished", _short_time(job.get("finished_at"))),
        ("progress", f"step {job.get('step', 0)}/{total if total is not None else '?'}{epoch_text}"),
        # Work before the first step (a DPO job's reference log-probabilities); an older server sends none.
        *([("phase", phase_text(job["phase"]))] if job.get("phase") else []),
        ("tokens seen", str(job.get("tokens_seen", 0))),
        ("loss", format_loss(latest.get("loss"))),
        # A DPO job's measures, those its last step reported.
        *((label, format_measure(latest[key])) for key, label in PREFERENCE_MEASURES if latest.get(key) is not None),
        ("tokens/s", format_rate(latest.get("tokens_per_second"))),
        ("eta", format_duration(job.get("eta_seconds")) if job.get("eta_seconds") is not None else "-"),
        ("attempts", attempts_text(job)),
    ]
    # The nodes of the current attempt (none for a one-node job).
    rows += [(f"node {n['node_rank']}", node_line(n)) for n in job.get("nodes") or []]
    error = job.get("error")
    if error:
        rows.append(("error", f"{error.get('code')}: {error.get('message')}"))
    for c in checkpoints or []:
        rows.append(("checkpoint", f"{c['kind']} step {c['step']} ({int(c['bytes']) / 1e6:.1f} MB) {c['uri']}"))
    return rows


def attempts_text(job: dict[str, Any]) -> str:
    """Attempts, the paused and handed-back ones among them (they are not restarts), and the
    restarts allowed."""
    pauses = int(job.get("pauses") or 0)  # an older server sends neither count
    handbacks = int(job.get("handbacks") or 0)
    paused = f", {pauses} paused" if pauses else ""
    handed = f", {handbacks} handed back by a stopping worker" if handbacks else ""
    return f"{job.get('attempts', 0)}{paused}{handed} (max restarts {job.get('max_restarts')})"


def show(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job's id.")],
    follow: FollowOption = False,
    as_json: JsonOption = False,
) -> None:
    """Show one job: status, progress, nodes, error, checkpoints (GET /jobs/{id})."""
    with _client() as client:
        try:
            job = client.get_job(job_id)
            checkpoints = None if as_json else client.checkpoints(job_id)
        except ClientError as e:
            raise _fail(e) from None
        if as_json and not follow:
            _print_json(job)
            return
        if not as_json:
            from rich.table import Table
            from rich.text import Text

            table = Table.grid(padding=(0, 2))
            table.add_column(style="bold", no_wrap=True)
            table.add_column()
            for label, value in describe_job(job, checkpoints):
                # Values as text, not rich markup: an error such as "[rank3]: ..." is shown whole.
                table.add_row(label, Text(value))
            _console().print(table)
        if follow:
            _follow_and_exit(client, job, as_json=as_json)


def logs(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job's id.")],
    tail: Annotated[int, typer.Option(min=1, help="The last N lines.")] = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Print new lines until the job ends.")] = False,
) -> None:
    """Print the lines the job's ranks wrote (GET /jobs/{id}/logs)."""
    with _client() as client:
        try:
            if follow:
                for line in client.follow_logs(job_id, tail=tail):
                    typer.echo(line)
            else:
                for line in client.logs(job_id, tail=tail):
                    typer.echo(line)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ClientError as e:
            raise _fail(e) from None


def _change_job(job_id: str, as_json: bool, ask: Callable[[TuneqClient, str], dict[str, Any]]) -> None:
    """One request that changes a job (cancel, pause, resume); prints the job's new status."""
    with _client() as client:
        try:
            job = ask(client, job_id)
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(job)
    else:
        typer.echo(f"job {job['id']}: {job['status']}")


JobIdArgument = Annotated[str, typer.Argument(metavar="ID", help="The job's id.")]


def cancel(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Cancel a job: a queued or paused one at once, a running one through `cancelling` (POST /jobs/{id}/cancel)."""
    _change_job(job_id, as_json, TuneqClient.cancel)


def pause(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Pause a job: a running one through `pausing` (its ranks save a checkpoint at their next step and
    exit, freeing the worker), a queued one at once (POST /jobs/{id}/pause)."""
    _change_job(job_id, as_json, TuneqClient.pause)


def resume(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Resume a paused job: queued again, it continues from its pause checkpoint (POST /jobs/{id}/resume)."""
    _change_job(job_id, as_json, TuneqClient.resume)


def download(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job's id.")],
    dest: Annotated[
        Path | None,
        typer.Argument(
            metavar="DEST",
            help="The directory to create (as --output); default ./tuneq-<id>-<kind>-<step>.",
            show_default=False,
        ),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option("--step", "--checkpoint", min=0, help="The step of the checkpoint; default the newest."),
    ] = None,
    model: Annotated[bool, typer.Option("--model", help="The exported model: the same as --kind model.")] = False,
    kind: Annotated[str | None, typer.Option(help="model, adapter or deepspeed; default model, else adapter.")] = None,
    output: Annotated[
        Path | None, typer.Option(help="The directory to create; default ./tuneq-<id>-<kind>-<step>.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Download a checkpoint of a job over HTTP, checking every file's SHA-256; run again to resume one cut short."""
    if kind is not None and kind not in KIND_PREFERENCE:
        raise typer.BadParameter(f"unknown kind {kind!r}: one of {', '.join(KIND_PREFERENCE)}", param_hint="--kind")
    if model:
        if kind not in (None, "model"):
            raise typer.BadParameter(f"--model is --kind model, not --kind {kind}", param_hint="--model")
        kind = "model"
    if dest is not None and output is not None:
        raise typer.BadParameter("both name the directory to create: give one of them", param_hint="DEST, --output")
    with _client() as client:
        try:
            chosen = pick_checkpoint(client.checkpoints(job_id), step=step, kind=kind)
            target = dest or output or Path(f"tuneq-{job_id[:8]}-{chosen['kind']}-{chosen['step']}")
            plan = plan_download(client, job_id, chosen, target)
            result = download_with_progress(client, plan)
        except KeyboardInterrupt:
            typer.echo("\ntuneq: download stopped; the same command resumes it", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(
            {
                **chosen,
                "output": str(result.output),
                "files": result.files,
                "bytes": result.bytes,
                "resumed_bytes": result.resumed_bytes,
            }
        )
        return
    resumed = f", {_size(result.resumed_bytes)} of it resumed" if result.resumed_bytes else ""
    typer.echo(
        f"downloaded the {chosen['kind']} checkpoint at step {chosen['step']} to {target} "
        f"({result.files} files, {_size(result.bytes)}{resumed})"
    )


def download_with_progress(client: TuneqClient, plan: DownloadPlan, *, console: Any = None) -> DownloadResult:
    """``download_checkpoint`` with a progress bar over its bytes on a terminal's stderr."""
    console = console or _console(stderr=True)
    if not console.is_terminal:
        return download_checkpoint(client, plan)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("download", total=plan.total_bytes, completed=plan.kept_bytes())
        return download_checkpoint(
            client,
            plan,
            progress=lambda n: progress.advance(task, n),
            on_file=lambda f: progress.update(task, description=f.name),
        )


def _size(n: int) -> str:
    from rich.filesize import decimal

    return decimal(n)


def register(app: typer.Typer) -> None:
    """Add the client commands to the ``tuneq`` app."""
    for command in (submit, jobs, show, logs, cancel, pause, resume, download):
        app.command()(command)
