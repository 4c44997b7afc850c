"""A closed-loop HTTP load generator, run in its own process: ``python -m benchmarks.load``.

N clients, one keep-alive connection each, send ``GET path`` one request after another and
time each one at the client (request written → response body read). The client is raw
HTTP/1.1 over asyncio streams, so on a small shared machine the load generator takes as little
of the servers' CPU as it can (with one ``httpx.AsyncClient`` per client, in the benchmark's own
process, the bare server measured 322 rps on the 2-core box; with this client, 835). Every
response must be a 200 with a
``Content-Length`` body (what uvicorn sends for a JSON response); anything else fails the run.

Connections are opened and warmed up (``--warmup`` requests each) before the clock starts,
then the clients start together. Prints one JSON object: ``rps`` over the timed burst and
every request's ``latencies`` in seconds.

Running it as a separate process keeps its event loop off the GIL of whatever else the
caller does (the benchmark's own process starts servers and reads their logs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from urllib.parse import urlsplit


class LoadError(RuntimeError):
    pass


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes]:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head[:-4].split(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise LoadError(f"not an HTTP/1.x response: {status_line!r}")
    length = None
    for line in header_lines:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length is None:
        raise LoadError(f"response without Content-Length: {head!r}")
    body = await reader.readexactly(length)
    return int(parts[1]), body


async def _load(
    host: str, port: int, path: str, *, clients: int, per_client: int, warmup: int, headers: list[str]
) -> tuple[float, list[float]]:
    extra = "".join(f"{h}\r\n" for h in headers)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: application/json\r\n{extra}\r\n".encode()
    connections = [await asyncio.open_connection(host, port) for _ in range(clients)]
    latencies: list[float] = []

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int, *, timed: bool) -> None:
        perf_counter = time.perf_counter
        for _ in range(count):
            started = perf_counter()
            status, body = await _request(reader, writer, request)
            if timed:
                latencies.append(perf_counter() - started)
            if status != 200:
                raise LoadError(f"answered {status}: {body[:200]!r}")

    try:
        # Warm-up on the same connections, then every client starts its timed requests together.
        await asyncio.gather(*(client(r, w, warmup, timed=False) for r, w in connections))
        started = time.perf_counter()
        await asyncio.gather(*(client(r, w, per_client, timed=True) for r, w in connections))
        elapsed = time.perf_counter() - started
    finally:
        for _, writer in connections:
            writer.close()
    return clients * per_client / elapsed, latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="http://host:port/path")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=40, help="timed requests per client")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests per client first")
    parser.add_argument("--header", action="append", default=[], help="'Name: value' sent with every request")
    args = parser.parse_args(argv)
    url = urlsplit(args.url)
    if url.scheme != "http" or not url.hostname or not url.port:
        parser.error("the URL must be http://host:port/path")
    path = url.path + (f"?{url.query}" if url.query else "")
    rps, latencies = asyncio.run(
        _load(
            url.hostname,
            url.port,
            path,
            clients=args.clients,
            per_client=args.requests,
            warmup=args.warmup,
            headers=args.header,
        )
    )
    json.dump({"rps": rps, "latencies": latencies}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
