"""Helpers for tests that use the real services on this machine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
import warnings
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

# The schemas this process made, by database URL: dropped when its tests end (drop_fresh_schemas).
_fresh_schemas: dict[str, list[str]] = {}


def fresh_postgres_schema(url: str, *, prefix: str = "t") -> str:
    """A URL whose connections use a new, empty schema, so tests never see each other's rows."""
    import sqlalchemy

    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    _fresh_schemas.setdefault(url, []).append(schema)
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options=-csearch_path%3D{schema}"


def drop_fresh_schemas() -> None:
    """Drop every schema fresh_postgres_schema made in this process, once nothing uses them: kept,
    each run left ~250 schemas (~5,000 tables) in the shared database, and its catalog grew with
    every run on the machine. A schema a process that outlived its test still holds is left, with
    a warning: waiting for it could hang the end of the run."""
    import sqlalchemy

    for url, schemas in _fresh_schemas.items():
        engine = sqlalchemy.create_engine(url)
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("SET lock_timeout = '2s'"))
                for schema in schemas:
                    try:
                        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                    except sqlalchemy.exc.OperationalError as e:
                        warnings.warn(f"schema {schema} left in {make_url(url).database}: {e}", stacklevel=1)
        except sqlalchemy.exc.OperationalError as e:  # the database is down: nothing to drop them in
            warnings.warn(f"{len(schemas)} schemas left in {make_url(url).database}: {e}", stacklevel=1)
        finally:
            engine.dispose()
    _fresh_schemas.clear()


class DatabaseLink:
    """A TCP relay on loopback between tuneq and a real database, which a test can cut: every
    open connection is reset and new ones are refused for a while, as during a database
    restart or a network blip (the database itself, shared by the other tests, stays up)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut_until = 0.0
        self._closed = False
        threading.Thread(target=self._accept, name="database-link", daemon=True).start()

    def url(self, database_url: str) -> str:
        """``database_url`` (to the target) through this link."""
        return make_url(database_url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def cut(self, seconds: float) -> None:
        """Reset every open connection now and refuse new ones for ``seconds``."""
        with self._lock:
            self._cut_until = time.monotonic() + seconds
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._open.clear()

    def upstream_ports(self) -> list[int]:
        """The local ports of the relay's open connections to the database (its ``client_port``)."""
        ports = []
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):  # one closing as we look
                    if sock.getpeername() == self.target:
                        ports.append(sock.getsockname()[1])
        return ports

    def close(self) -> None:
        self._closed = True
        self.cut(0)
        self._server.close()

    def _accept(self) -> None:

        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if time.monotonic() < self._cut_until:
                client.close()  # refused, as a database that is down refuses
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: Any, sink: Any) -> None:

        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._open.discard(source)
            self._open.discard(sink)


# Credentials moto's S3 server accepts; the AWS chain reads them from the environment.
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class LoopbackS3:
    """A real S3 API on loopback (moto's server mode). Its buckets live in this process, so
    ``stop()`` then ``start()`` is an outage of the endpoint that loses nothing, as a store
    restart or a cut link would be."""

    def __init__(self) -> None:
        self.port = 0
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LoopbackS3:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self) -> Any:
        import boto3

        keys = {k.lower(): v for k, v in S3_CREDENTIALS.items() if "KEY" in k}
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", **keys)
