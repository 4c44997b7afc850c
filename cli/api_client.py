"""The tuneq HTTP API from Python: the client's settings, its errors, the job-event stream, and
``TuneqClient``, which logs and raises, never prints.

``TUNEQ_URL`` (default ``http://127.0.0.1:8000``; ``host:port`` alone means ``http://``) names
the server and ``TUNEQ_API_KEY``, when set, is sent as ``Authorization: Bearer <key>``. These
are client settings, read here, not the server's ``Settings``.

Exit codes (docs/dashboard-and-cli.md), which each error carries: 0 success (``--follow``:
the job succeeded), 1 the job failed or a download was not possible, 2 bad usage, 3 the job was
cancelled, 4 the API refused the request, 5 the server could not be reached, 130 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from httpx_sse import ServerSentEvent, connect_sse

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
# What a submit asks; its refusal is "the server refused the job", any other request's says what failed.
SUBMIT = "submit the job"


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
    def from_response(cls, response: httpx.Response, *, api_key_set: bool, action: str | None = None) -> ApiError:
        return cls(response.status_code, describe_error(response, api_key_set=api_key_set, action=action))


class ServerUnreachable(ClientError):
    exit_code = EXIT_UNREACHABLE


class NotTuneqApi(ClientError):
    """Something answers at TUNEQ_URL, but not tuneq's API (a wrong path, another service)."""

    exit_code = EXIT_API_ERROR


class UnknownJob(ClientError):
    """No job of the caller's has an id that starts so."""

    exit_code = EXIT_API_ERROR


class AmbiguousJobId(ClientError):
    """A short id that starts the ids of several jobs."""

    exit_code = EXIT_USAGE


# ---- settings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSettings:
    url: str = DEFAULT_URL
    api_key: str | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClientSettings:
        """Raises ClientError for a TUNEQ_URL that is not an http(s) URL."""
        env = os.environ if environ is None else environ
        url = server_url(env.get("TUNEQ_URL") or DEFAULT_URL)
        key = (env.get("TUNEQ_API_KEY") or "").strip() or None
        return cls(url=url, api_key=key)


def server_url(value: str) -> str:
    """TUNEQ_URL as the client uses it: ``host:port`` (no scheme) is ``http://host:port``, and
    no trailing slash. Raises ClientError for another scheme or no host."""
    url = value.strip()
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ClientError(
            f"TUNEQ_URL={value.strip()!r} is not the URL of a tuneq server: give http://HOST:PORT or "
            f"https://HOST (default {DEFAULT_URL})"
        )
    return url


# ---- what the server said -----------------------------------------------------------------


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


# The API's advice names its routes; a user of the command is told the command instead.
_ROUTE_ADVICE = re.compile(r"(?:POST )?/jobs/(?P<id>[0-9a-fA-F-]{36})/(?P<command>cancel|pause|resume)\b")


def as_command_advice(text: str) -> str:
    """The server's message with each job action route it advises (``POST /jobs/{id}/pause``)
    as the ``tuneq`` command that does it (``tuneq pause {id}``)."""
    return _ROUTE_ADVICE.sub(lambda m: f"`tuneq {m['command']} {m['id']}`", text)


def describe_error(response: httpx.Response, *, api_key_set: bool, action: str | None = None) -> str:
    """One message (several lines for 422) saying what the server refused and what to do.
    ``action`` says what was asked ("read job X"; ``SUBMIT`` for a submit)."""
    code = response.status_code
    detail = _detail(response)
    text = as_command_advice(_detail_text(detail))
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
        lines = [as_command_advice(_problem_line(p)) for p in problems]
        if action == SUBMIT:
            refused = "the server refused the job"
        else:
            refused = f"could not {action}" if action else "the server refused the request"
        return f"{refused} (422):\n" + "\n".join(f"  {line}" for line in lines)
    if code == 429:
        retry = response.headers.get("retry-after")
        later = f"; retry after {retry} s" if retry else "; retry later"
        return f"too many requests (429): {text}{later}"
    return f"the server answered {code} {response.reason_phrase}: {text}"


def _is_route_miss(response: httpx.Response) -> bool:
    """A 404 of a path the server has no route for (Starlette's own ``{"detail": "Not Found"}``,
    or a page that is not JSON), not tuneq's answer for a missing job (``job ... not found``)."""
    if response.status_code != 404:
        return False
    try:
        body = response.json()
    except ValueError:
        return True
    return not isinstance(body, dict) or body.get("detail") == "Not Found"


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


# ---- job ids -------------------------------------------------------------------------------

_HEX_PREFIX = re.compile(r"[0-9a-f]{1,32}")


def full_job_id(text: str) -> str | None:
    """``text`` as a whole job id (with or without its dashes, any case), or None."""
    try:
        return str(uuid.UUID(text.strip()))
    except ValueError:
        return None


def id_prefix(text: str) -> str | None:
    """The hex digits a short id holds (``26a8e187``, ``26A8E187-1b2c``), or None when it is
    not the start of an id."""
    digits = text.strip().replace("-", "").lower()
    return digits if _HEX_PREFIX.fullmatch(digits) else None


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

    def _not_tuneq(self, response: httpx.Response, why: str) -> NotTuneqApi:
        url = self.settings.url
        path = urlsplit(url).path
        root = url[: -len(path)] if path else url
        fix = f"drop '{path}': tuneq's routes are at the server's root ({root})" if path else "check the host and port"
        return NotTuneqApi(
            f"TUNEQ_URL={url} does not point at a tuneq API: {response.request.method} "
            f"{response.request.url.path} {why}; {fix}"
        )

    def _check(self, response: httpx.Response, action: str | None = None) -> httpx.Response:
        if _is_route_miss(response):
            raise self._not_tuneq(response, "is not a route there (404)")
        if response.is_error:
            raise ApiError.from_response(response, api_key_set=self.settings.api_key is not None, action=action)
        return response

    def request(self, method: str, path: str, *, action: str | None = None, **kwargs: Any) -> httpx.Response:
        """``action`` says what is asked, for the error's message ("read job X")."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        return self._check(response, action)

    @contextmanager
    def stream(self, method: str, path: str, *, action: str | None = None, **kwargs: Any) -> Iterator[httpx.Response]:
        """A response whose body is read as it arrives; an error answer raises as ``request``
        does, and a connection lost while the body is read raises ServerUnreachable."""
        try:
            with self._http.stream(method, path, **kwargs) as response:
                if response.is_error:
                    response.read()
                    self._check(response, action)
                yield response
        except httpx.TransportError as e:
            raise self._unreachable(e) from None

    def _json(self, method: str, path: str, *, action: str, **kwargs: Any) -> dict[str, Any]:
        response = self.request(method, path, action=action, **kwargs)
        try:
            body = response.json()
        except ValueError:
            kind = response.headers.get("content-type") or "no content type"
            raise self._not_tuneq(response, f"answered {response.status_code} with {kind}, not JSON") from None
        if not isinstance(body, dict):
            raise ClientError(f"unexpected answer from {method} {path}: {body!r}")
        return body

    # -- the endpoints --

    def submit(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json("POST", "/jobs", json=body, headers=headers, action=SUBMIT)

    def list_jobs(self, *, status: str | None = None, skip: int = 0, limit: int = 50) -> dict[str, Any]:
        params: dict[str, Any] = {"skip": skip, "limit": limit}
        if status is not None:
            params["status"] = status
        return self._json("GET", "/jobs", params=params, action="list the jobs")

    def resolve_job_id(self, given: str) -> str:
        """The whole id of the caller's job that ``given`` names: a whole id, or a short one (its
        first characters, as the dashboard and ``tuneq jobs`` show it) that starts one job's id
        only. Raises UnknownJob or AmbiguousJobId."""
        whole = full_job_id(given)
        if whole is not None:
            return whole
        prefix = id_prefix(given)
        if prefix is None:
            raise UnknownJob(
                f"{given!r} is not a job id: give the id, or its first characters as `tuneq jobs` shows them"
            )
        page = self._json("GET", "/jobs/lookup", params={"id_prefix": prefix}, action=f"look up job {given}")
        matches, count = page["data"], int(page["count"])
        if count == 0:
            raise UnknownJob(f"no job of yours has an id that starts with {given} (`tuneq jobs` lists them)")
        if count > 1:
            shown = ", ".join(f"{m['id']} ({m.get('name') or m['status']})" for m in matches)
            more = f" and {count - len(matches)} more" if count > len(matches) else ""
            raise AmbiguousJobId(f"{given} starts the ids of {count} jobs: {shown}{more}; give more of the id")
        return str(matches[0]["id"])

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}", action=f"read job {job_id}")

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
        return self._json("POST", f"/jobs/{job_id}/cancel", action=f"cancel job {job_id}")

    def pause(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/pause", action=f"pause job {job_id}")

    def resume(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/resume", action=f"resume job {job_id}")

    def metrics(self, job_id: str, *, points: int | None = None) -> list[dict[str, Any]]:
        """The job's per-step metrics in step order, fetched a page at a time; with ``points``,
        at most that many rows spread evenly over the run (for a chart of a long run)."""
        rows: list[dict[str, Any]] = []
        params: dict[str, Any] = {"after": 0}
        if points is not None:
            params.update(points=points, limit=points)  # one page: stretches span the whole run
        while True:
            page = self._json("GET", f"/jobs/{job_id}/metrics", params=params, action=f"read job {job_id}'s metrics")
            rows += page["data"]
            if not page["has_more"]:
                return rows
            params["after"] = page["next_after"]

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._json("GET", f"/jobs/{job_id}/checkpoints", action=f"list job {job_id}'s checkpoints")["data"])

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        """Every published file of the job: path, kind, step, size, sha256."""
        return list(self._json("GET", f"/jobs/{job_id}/artifacts", action=f"list job {job_id}'s files")["data"])

    def logs(self, job_id: str, *, tail: int = 200) -> list[str]:
        answer = self._json("GET", f"/jobs/{job_id}/logs", params={"tail": tail}, action=f"read job {job_id}'s log")
        return [str(line) for line in answer["lines"]]

    def follow_logs(self, job_id: str, *, tail: int = 200) -> Iterator[str]:
        """The last ``tail`` lines, then new ones until the job ends (the server ends the body)."""
        # Training can be quiet for long stretches and this stream has no pings: no read timeout.
        timeout = httpx.Timeout(self.timeout.connect, read=None)
        params = {"tail": tail, "follow": "true"}
        action = f"follow job {job_id}'s log"
        with self.stream("GET", f"/jobs/{job_id}/logs", params=params, timeout=timeout, action=action) as response:
            yield from response.iter_lines()

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
                            self._check(response, f"follow job {job_id}")
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
