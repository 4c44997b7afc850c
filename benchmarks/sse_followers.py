"""Many SSE followers in one process: ``python -m benchmarks.sse_followers BASE_URL --job ID ...``.

``--per-job`` streams of ``GET /jobs/{id}/events/stream`` for each ``--job``, raw HTTP/1.1 over
asyncio streams, as ``benchmarks/load.py`` sends its requests: a follower costs the shared host
far less CPU than an ``httpx`` stream, so the figure is the server's more than the client's.
Once every stream has its response headers the process prints ``ready N`` (N streams) on a line
of its own; then each stream reads its chunked body, and for each ``metric`` event records its
arrival (this host's clock) minus the ``time`` stamp of the metric line it came from, until it
has seen ``--events`` of them; the streams close together at the end. Then it prints one JSON
object: every ``latencies`` in seconds, and the ``steps`` of the metrics they are of, in the
same order. A stream that ends, fails or times out first fails the run (exit status 1, what
went wrong on stderr).

Its own process, as the load generator's: the benchmark's process ingests the events, and
the two would otherwise share one interpreter lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

CONNECTING_AT_ONCE = 100  # streams opened together while connecting


class FollowerError(RuntimeError):
    pass


@dataclass
class SseMessage:
    """One Server-Sent Events message: its ``event`` name and its ``data`` lines joined."""

    event: str
    data: str


@dataclass
class ChunkedSseParser:
    """An HTTP/1.1 chunked body carrying Server-Sent Events, fed as bytes arrive, in any pieces.

    ``feed`` returns the messages completed by what it was given; comments (``: ping``) and
    fields other than ``event`` and ``data`` are skipped. ``ended``: the last chunk was read."""

    _raw: bytearray = field(default_factory=bytearray)  # chunk framing not yet decoded
    _text: str = ""  # decoded body not yet a whole message
    _chunk_left: int = 0  # bytes of the current chunk still to come (then its CRLF)
    ended: bool = False

    def feed(self, data: bytes) -> list[SseMessage]:
        self._raw += data
        body = bytearray()
        while not self.ended:
            if self._chunk_left:
                taken = self._raw[: self._chunk_left]
                body += taken
                del self._raw[: len(taken)]
                self._chunk_left -= len(taken)
                if self._chunk_left:
                    break
                continue
            line_end = self._raw.find(b"\r\n")
            if line_end < 0:
                break
            line = bytes(self._raw[:line_end])
            if not line:  # the CRLF after a chunk's data
                del self._raw[:2]
                continue
            size = int(line.split(b";", 1)[0], 16)
            del self._raw[: line_end + 2]
            if size == 0:
                self.ended = True
            self._chunk_left = size
        self._text += body.decode()
        return self._messages()

    def _messages(self) -> list[SseMessage]:
        # A CR at the end may be the first half of a CRLF: it waits for what follows it.
        held = "\r" if self._text.endswith("\r") else ""
        text = self._text.removesuffix(held).replace("\r\n", "\n").replace("\r", "\n")
        *whole, rest = text.split("\n\n")
        self._text = rest + held
        messages = []
        for block in whole:
            event, data = "message", []
            for line in block.split("\n"):
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "event":
                    event = value
                elif name == "data":
                    data.append(value)
            if data:
                messages.append(SseMessage(event, "\n".join(data)))
        return messages


def metric_latency(message: SseMessage, arrived: float) -> tuple[int, float] | None:
    """A metric event's step, and the seconds from its line's ``time`` stamp to ``arrived`` (a
    Unix time); None for an event that is not a metric."""
    if message.event != "metric":
        return None
    metric = json.loads(message.data)["data"]
    return int(metric["step"]), arrived - datetime.fromisoformat(metric["time"]).timestamp()


async def _open(
    host: str, port: int, path: str, headers: list[str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    extra = "".join(f"{h}\r\n" for h in headers)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n{extra}\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0]
    if b" 200 " not in status_line + b" ":
        raise FollowerError(f"{path} answered {status_line!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        raise FollowerError(f"{path} is not a chunked stream: {head!r}")
    return reader, writer


async def _follow(reader: asyncio.StreamReader, events: int, latencies: list[tuple[int, float]]) -> None:
    """Read one stream until it has brought ``events`` metric events. It stays open: the streams
    close together at the end, so no stream's close is timed as part of another's delivery."""
    parser = ChunkedSseParser()
    seen = 0
    while seen < events:
        data = await reader.read(65536)
        arrived = time.time()
        if not data:
            raise FollowerError(f"a stream ended after {seen} of {events} metric events")
        for message in parser.feed(data):
            measured = metric_latency(message, arrived)
            if measured is not None:
                latencies.append(measured)
                seen += 1
        if parser.ended and seen < events:
            raise FollowerError(f"a stream's body ended after {seen} of {events} metric events")


async def _run(
    base: str, jobs: list[str], per_job: int, events: int, headers: list[str], timeout: float
) -> list[tuple[int, float]]:
    url = urlsplit(base)
    if url.scheme != "http" or not url.hostname or not url.port:
        raise FollowerError("the base URL must be http://host:port")
    host, port = url.hostname, url.port
    gate = asyncio.Semaphore(CONNECTING_AT_ONCE)

    async def connect(job: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with gate:
            return await _open(host, port, f"/jobs/{job}/events/stream", headers)

    streams = await asyncio.wait_for(
        asyncio.gather(*(connect(job) for job in jobs for _ in range(per_job))), timeout=timeout
    )
    sys.stdout.write(f"ready {len(streams)}\n")
    sys.stdout.flush()
    latencies: list[tuple[int, float]] = []
    try:
        await asyncio.wait_for(asyncio.gather(*(_follow(reader, events, latencies) for reader, _ in streams)), timeout)
    finally:
        for _, writer in streams:
            writer.close()
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base_url", help="http://host:port")
    parser.add_argument("--job", action="append", required=True, help="a job id to follow (repeat)")
    parser.add_argument("--per-job", type=int, default=20, help="streams per job")
    parser.add_argument("--events", type=int, required=True, help="metric events each stream waits for")
    parser.add_argument("--header", action="append", default=[], help="'Name: value' sent with every request")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to connect, then to follow")
    args = parser.parse_args(argv)
    try:
        latencies = asyncio.run(_run(args.base_url, args.job, args.per_job, args.events, args.header, args.timeout))
    except (FollowerError, OSError, TimeoutError) as e:
        sys.stderr.write(f"sse_followers: {type(e).__name__}: {e}\n")
        return 1
    json.dump({"latencies": [s for _, s in latencies], "steps": [step for step, _ in latencies]}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
