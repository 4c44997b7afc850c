"""Remote dataset URIs: the refused ones, and real fetches from local HTTPS, S3 (moto) and fake hub servers."""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from shared.data import remote as dataset_source
from shared.data.remote import DatasetSourceError, RemoteDataset, fetch_dataset, parse_dataset_uri
from shared.settings import Settings
from tests.services import LoopbackS3

LOOPBACK = "127.0.0.0/8,::1/128"


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Every remote-dataset field given, so no TUNEQ_* variable of the environment leaks in."""
    fields: dict[str, Any] = {
        "home": tmp_path / "home",
        "allowed_https_hosts": "",
        "allowed_private_networks": "",
        "ca_bundle": "",
        "s3_endpoint_url": "",
        "hf_endpoint": "https://huggingface.co",
        "max_dataset_bytes": 10 * 1024**2,
    }
    fields.update(overrides)
    return Settings(**fields)


# --- parsing ---------------------------------------------------------------------------------------

TABLE_HOSTS = ",".join(
    [
        "data.example.com",
        "*.example.org",
        "localhost",
        "127.0.0.1",
        "10.1.2.3",
        "169.254.169.254",
        "[fd00:ec2::254]",
        "[::ffff:a9fe:a9fe]",
        "[64:ff9b::a9fe:a9fe]",
        "[::ffff:10.0.0.1]",
        "100.100.100.200",
    ]
)

REFUSED = [
    ("simplecache::s3://bucket/train.jsonl", "chains protocols with '::'"),
    ("zip://train.jsonl::https://data.example.com/a.zip", "chains protocols with '::'"),
    ("s3://bucket/a::b.jsonl", "chains protocols with '::'"),
    (
        "https://fd00::1/train.jsonl",
        "IPv6 address fd00::1 without brackets: write it as 'https://[fd00::1]/train.jsonl'",
    ),
    ("https://u:secret@fe80::1/x.jsonl", "write it as 'https://***@[fe80::1]/x.jsonl'"),
    ("simplecache::https://u:secret@data.example.com/x.jsonl", "chains protocols with '::'"),
    ("ftp://u:secret@data.example.com/train.jsonl", "'ftp:' are not supported"),
    ("file://u:secret@evil.example.com/etc/passwd", "names a host ('evil.example.com')"),
    ("http://u:secret@data.example.com/train.jsonl?sig=secret", "plain http://"),
    ("memory://bucket/train.jsonl", "'memory:' are not supported"),
    ("data:text/plain;base64,eyJ0ZXh0IjogImEifQ==", "'data:' are not supported"),
    ("reference://train.jsonl", "'reference:' are not supported"),
    ("ftp://data.example.com/train.jsonl", "'ftp:' are not supported"),
    ("gs://bucket/train.jsonl", "'gs:' are not supported"),
    ("GCS://bucket/train.jsonl", "'gcs:' are not supported"),
    ("http://data.example.com/train.jsonl", "plain http://"),
    ("file://evil.example.com/etc/passwd", "names a host ('evil.example.com')"),
    ("file://localhost/srv/train.jsonl", "names a host ('localhost')"),
    ("https://169.254.169.254/latest/meta-data/iam", "169.254.169.254, a link-local or cloud metadata address"),
    ("https://[fd00:ec2::254]/latest/meta-data", "fd00:ec2::254, a link-local or cloud metadata address"),
    ("https://[::ffff:a9fe:a9fe]/latest/meta-data", "a link-local or cloud metadata address"),
    ("https://[64:ff9b::a9fe:a9fe]/latest/meta-data", "a link-local or cloud metadata address"),
    ("https://100.100.100.200/latest/meta-data", "a link-local or cloud metadata address"),
    ("https://127.0.0.1/train.jsonl", "127.0.0.1, a loopback address"),
    ("https://localhost/train.jsonl", "a loopback address"),
    ("https://10.1.2.3/train.jsonl", "10.1.2.3, a private address"),
    ("https://[::ffff:10.0.0.1]/train.jsonl", "a private address"),
    ("https://evil.example.net/train.jsonl", "https host 'evil.example.net' is not allowed"),
    ("https://example.org/train.jsonl", "https host 'example.org' is not allowed"),
    ("https://data.example.com.evil.net/train.jsonl", "is not allowed"),
    ("https://data.example.com:8443/train.jsonl", "port 8443 of https host 'data.example.com' is not allowed"),
    ("https://user:secret@data.example.com/train.jsonl", "carries credentials"),
    ("https://token@data.example.com/train.jsonl", "carries credentials"),
    ("s3://key:secret@bucket/train.jsonl", "carries credentials"),
    ("https://data.example.com/a/../train.jsonl", "'..' path segment"),
    ("https://data.example.com/a/%2e%2e/train.jsonl", "'..' path segment"),
    ("https://data.example.com/a/%2E./train.jsonl", "'..' path segment"),
    ("https://data.example.com/a/%252e%252e/train.jsonl", "'..' path segment"),
    ("https://data.example.com/a/..%2ftrain.jsonl", "'..' path segment"),
    ("https://data.example.com/a/..%5ctrain.jsonl", "'..' path segment"),
    ("https://data.example.com/a\\..\\train.jsonl", "backslash"),
    ("https://data.example.com/a%00.jsonl", "encodes control characters"),
    ("https://data.example.com/a\n.jsonl", "control characters"),
    ("https://data.example.com/train.jsonl#part", "fragment"),
    ("https://data.example.com/", "names no file"),
    ("https://data.example.com.:443/train.jsonl", "invalid host name"),
    ("s3://bucket/../other/train.jsonl", "'..' path segment"),
    ("s3://bucket/a/%2E%2E/train.jsonl", "'..' path segment"),
    ("s3://bucket", "names a bucket or folder"),
    ("s3://bucket/folder/", "names a bucket or folder"),
    ("s3://Bad_Bucket/train.jsonl", "is not an S3 bucket name"),
    ("s3://bucket:9000/train.jsonl", "TUNEQ_S3_ENDPOINT_URL"),
    ("s3://bucket/train.jsonl?versionId=1", "'?' or '#' part"),
    ("hf://gpt2/config.json", "does not name a dataset repo"),
    ("hf://spaces/org/name/app.py", "does not name a dataset repo"),
    ("hf://datasets/org/name", "is not of the form"),
    ("hf://datasets/org/name@main", "is not of the form"),
    ("hf://datasets/org/name/../../models/org/x/f.jsonl", "'..' path segment"),
    ("hf://datasets/org/name@../train.jsonl", "is not a branch, tag or commit"),
    ("hf://datasets/org/name@/train.jsonl", "is not a branch, tag or commit"),
    ("hf://datasets/org/na--me/train.jsonl", "is not a valid hub repo id"),
    ("hf://datasets/org/name/data/", "names a folder"),
]


@pytest.mark.parametrize(("uri", "fragment"), REFUSED, ids=[u for u, _ in REFUSED])
def test_refused_uris_name_the_problem(tmp_path: Path, uri: str, fragment: str) -> None:
    settings = make_settings(tmp_path, allowed_https_hosts=TABLE_HOSTS)
    with pytest.raises(DatasetSourceError) as excinfo:
        parse_dataset_uri(uri, settings)
    message = str(excinfo.value)
    assert fragment in message
    assert "secret" not in message


def test_a_dataset_cannot_be_read_from_the_artifact_store(tmp_path: Path) -> None:
    """Every job's checkpoints are there, readable with the workers' credentials."""
    settings = make_settings(tmp_path, artifacts_uri="s3://tuneq/runs")
    for uri in ("s3://tuneq/runs/0b7e.../model/model.safetensors", "S3://tuneq/runs/x/train.log"):
        with pytest.raises(DatasetSourceError, match="inside tuneq's artifact store"):
            parse_dataset_uri(uri, settings)
    # Beside it is fine: the same bucket, another prefix (or a prefix that only starts alike).
    for uri in ("s3://tuneq/datasets/train.jsonl", "s3://tuneq/runs-old/train.jsonl"):
        assert parse_dataset_uri(uri, settings) is not None


def test_https_needs_the_operator_to_enable_it(tmp_path: Path) -> None:
    with pytest.raises(DatasetSourceError, match="TUNEQ_ALLOWED_HTTPS_HOSTS"):
        parse_dataset_uri("https://data.example.com/train.jsonl", make_settings(tmp_path))


def test_allowed_private_network_lets_a_private_host_through_but_never_metadata(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, allowed_https_hosts="10.1.2.3,169.254.169.254", allowed_private_networks="10.0.0.0/8,0.0.0.0/0"
    )
    remote = parse_dataset_uri("https://10.1.2.3/data/train.jsonl?sig=abc", settings)
    assert remote == RemoteDataset(
        scheme="https",
        uri="https://10.1.2.3/data/train.jsonl?sig=abc",
        location="10.1.2.3",
        path="/data/train.jsonl?sig=abc",
    )
    assert remote.filename == "train.jsonl"
    with pytest.raises(DatasetSourceError, match="never allowed"):
        parse_dataset_uri("https://169.254.169.254/latest/meta-data", settings)


def test_misconfigured_settings_are_the_operators_error(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, allowed_https_hosts="10.1.2.3", allowed_private_networks="not-a-cidr")
    with pytest.raises(RuntimeError, match="TUNEQ_ALLOWED_PRIVATE_NETWORKS"):
        parse_dataset_uri("https://10.1.2.3/train.jsonl", settings)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "s3://my-bucket/data/train.jsonl",
            RemoteDataset("s3", "s3://my-bucket/data/train.jsonl", "my-bucket", "data/train.jsonl"),
        ),
        ("S3://my-bucket/a b.csv", RemoteDataset("s3", "s3://my-bucket/a b.csv", "my-bucket", "a b.csv")),
        (
            "hf://datasets/org/name/data/train.jsonl",
            RemoteDataset("hf", "hf://datasets/org/name/data/train.jsonl", "org/name", "data/train.jsonl"),
        ),
        (
            "hf://datasets/org/name@v1.0/train.parquet",
            RemoteDataset("hf", "hf://datasets/org/name@v1.0/train.parquet", "org/name", "train.parquet", "v1.0"),
        ),
        (
            "hf://datasets/org/name@refs%2Fpr%2F3/train.json",
            RemoteDataset(
                "hf", "hf://datasets/org/name@refs%2Fpr%2F3/train.json", "org/name", "train.json", "refs/pr/3"
            ),
        ),
        (
            "https://93.184.215.14:8443/d/train%20set.jsonl",
            RemoteDataset(
                "https", "https://93.184.215.14:8443/d/train%20set.jsonl", "93.184.215.14:8443", "/d/train%20set.jsonl"
            ),
        ),
    ],
)
def test_accepted_uris(tmp_path: Path, uri: str, expected: RemoteDataset) -> None:
    settings = make_settings(tmp_path, allowed_https_hosts="93.184.215.14:8443")
    assert parse_dataset_uri(uri, settings) == expected


@pytest.mark.parametrize(
    "uri", ["/srv/data/train.jsonl", "file:///srv/data/train.jsonl", "~/train.jsonl", "train.jsonl"]
)
def test_local_references_are_left_to_the_caller(tmp_path: Path, uri: str) -> None:
    assert parse_dataset_uri(uri, make_settings(tmp_path)) is None


def test_file_names_keep_their_extension_and_lose_unsafe_characters() -> None:
    assert RemoteDataset("https", "u", "h", "/d/train%20set.v2.jsonl?x=1").filename == "train_set.v2.jsonl"
    assert RemoteDataset("s3", "u", "b", "a/.hidden.csv").filename == "hidden.csv"
    assert RemoteDataset("hf", "u", "o/n", "x/" + "a" * 300 + ".parquet").filename.endswith(".parquet")
    assert len(RemoteDataset("hf", "u", "o/n", "a" * 300 + ".parquet").filename) <= 128


# --- https ------------------------------------------------------------------------------------------


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    length: bool = True


@dataclass
class HttpsServer:
    port: int
    ca_file: Path
    routes: dict[str, Route]
    requests: list[tuple[str, str]]

    def url(self, path: str, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}{path}"

    def seen(self, method: str, path: str) -> int:
        return self.requests.count((method, path))


class _Handler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, with_body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        route = self.server.routes.get(self.path, Route(status=404, body=b"no such file"))
        self.send_response(route.status)
        for name, value in route.headers.items():
            self.send_header(name, value)
        if route.length:
            self.send_header("Content-Length", str(len(route.body)))
        self.end_headers()
        if with_body:
            self.wfile.write(route.body)

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsServer]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ca_file = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.requests = []  # type: ignore[attr-defined]
    httpd.routes = {}  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield HttpsServer(httpd.server_address[1], ca_file, httpd.routes, httpd.requests)  # type: ignore[attr-defined]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def https(https_server: HttpsServer) -> HttpsServer:
    https_server.routes.clear()
    https_server.requests.clear()
    return https_server


def https_settings(tmp_path: Path, server: HttpsServer, **overrides: Any) -> Settings:
    fields = {
        "allowed_https_hosts": f"localhost:{server.port},169.254.169.254",
        "allowed_private_networks": LOOPBACK,
        "ca_bundle": str(server.ca_file),
    }
    fields.update(overrides)
    return make_settings(tmp_path, **fields)


def fetch(uri: str, settings: Settings, cache_dir: Path, **kwargs: Any) -> Path:
    remote = parse_dataset_uri(uri, settings)
    assert remote is not None
    return fetch_dataset(remote, settings=settings, cache_dir=cache_dir, **kwargs)


def test_https_fetch_is_content_addressed_and_cached_by_etag(tmp_path: Path, https: HttpsServer) -> None:
    body = b"".join(b'{"text": "line %d"}\n' % i for i in range(200_000))  # about 4 MiB
    validators = {"ETag": '"v1"', "Last-Modified": "Wed, 01 Jan 2025 00:00:00 GMT"}
    https.routes["/d/train.jsonl"] = Route(body=body, headers=validators)
    settings = https_settings(tmp_path, https)
    cache = tmp_path / "cache"
    progress: list[tuple[int, int | None]] = []

    path = fetch(https.url("/d/train.jsonl"), settings, cache, on_progress=lambda d, t: progress.append((d, t)))

    digest = hashlib.sha256(body).hexdigest()
    assert path == cache / digest / "train.jsonl"
    assert path.read_bytes() == body
    assert https.seen("GET", "/d/train.jsonl") == 1
    assert progress[-1] == (len(body), len(body))
    done = [d for d, _ in progress]
    assert len(done) >= 2 and all(t == len(body) for _, t in progress)
    assert all(b - a >= dataset_source.PROGRESS_EVERY_BYTES for a, b in zip([0, *done[:-2]], done[:-1], strict=True))
    assert not [p for p in cache.iterdir() if p.name.startswith(".partial-")]

    again = fetch(https.url("/d/train.jsonl"), settings, cache)
    assert again == path
    assert https.seen("GET", "/d/train.jsonl") == 1  # only a HEAD the second time
    assert https.seen("HEAD", "/d/train.jsonl") == 2

    changed = b'{"text": "new"}\n'
    https.routes["/d/train.jsonl"] = Route(body=changed, headers={"ETag": '"v2"'})
    newer = fetch(https.url("/d/train.jsonl"), settings, cache)
    assert newer == cache / hashlib.sha256(changed).hexdigest() / "train.jsonl"
    assert newer.read_bytes() == changed
    assert https.seen("GET", "/d/train.jsonl") == 2


def test_https_without_validators_downloads_again_into_the_same_file(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/plain.csv"] = Route(body=b"text\nhello\n")
    settings = https_settings(tmp_path, https)
    first = fetch(https.url("/plain.csv"), settings, tmp_path / "cache")
    second = fetch(https.url("/plain.csv"), settings, tmp_path / "cache")
    assert first == second and first.suffix == ".csv"
    assert https.seen("GET", "/plain.csv") == 2


def test_https_follows_a_redirect_to_an_allowed_host(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/moved.jsonl"] = Route(status=302, headers={"Location": https.url("/d/train.jsonl")})
    https.routes["/d/train.jsonl"] = Route(body=b'{"text": "a"}\n', headers={"ETag": '"x"'})
    path = fetch(https.url("/moved.jsonl"), https_settings(tmp_path, https), tmp_path / "cache")
    assert path.read_bytes() == b'{"text": "a"}\n'
    assert path.name == "moved.jsonl"


@pytest.mark.parametrize(
    ("location", "fragment"),
    [
        ("http://169.254.169.254/latest/meta-data/", "redirected to a http:// URL"),
        ("https://169.254.169.254/latest/meta-data/", "a link-local or cloud metadata address"),
        ("https://127.0.0.1:{port}/secret.jsonl", "refused host: https host '127.0.0.1' is not allowed"),
        ("https://localhost:1/secret.jsonl", "port 1 of https host 'localhost' is not allowed"),
        ("https://user:pw@localhost:{port}/secret.jsonl", "with credentials"),
    ],
)
def test_https_redirect_to_a_refused_address_is_not_followed(
    tmp_path: Path, https: HttpsServer, location: str, fragment: str
) -> None:
    https.routes["/go.jsonl"] = Route(status=302, headers={"Location": location.format(port=https.port)})
    https.routes["/secret.jsonl"] = Route(body=b"secret")
    with pytest.raises(DatasetSourceError) as excinfo:
        fetch(https.url("/go.jsonl"), https_settings(tmp_path, https), tmp_path / "cache")
    assert fragment in str(excinfo.value)
    assert https.seen("GET", "/secret.jsonl") == https.seen("HEAD", "/secret.jsonl") == 0


def test_https_loopback_is_refused_unless_allowed(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/d/train.jsonl"] = Route(body=b"x")
    strict = https_settings(tmp_path, https, allowed_private_networks="")
    with pytest.raises(DatasetSourceError, match="a loopback address"):
        parse_dataset_uri(https.url("/d/train.jsonl"), strict)
    assert https.requests == []


def test_https_connection_check_holds_even_if_the_submit_check_passed(tmp_path: Path, https: HttpsServer) -> None:
    # A name that resolved to a public address at submit and to loopback now (DNS rebinding) is
    # caught by the resolver the connection itself uses: nothing reaches the server.
    https.routes["/d/train.jsonl"] = Route(body=b"x")
    remote = parse_dataset_uri(https.url("/d/train.jsonl"), https_settings(tmp_path, https))
    assert remote is not None
    strict = https_settings(tmp_path, https, allowed_private_networks="")
    cache = dataset_source._Cache(tmp_path / "cache", limit=strict.max_dataset_bytes, on_progress=None)
    with pytest.raises(DatasetSourceError, match="a loopback address"):
        dataset_source._fetch_https(remote, strict, cache)
    assert https.requests == []


def test_https_missing_and_forbidden_files(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/forbidden.jsonl"] = Route(status=403, body=b"no")
    settings = https_settings(tmp_path, https)
    with pytest.raises(DatasetSourceError, match=r"was not found \(HTTP 404\)"):
        fetch(https.url("/missing.jsonl"), settings, tmp_path / "cache")
    with pytest.raises(DatasetSourceError, match=r"denied \(HTTP 403\)"):
        fetch(https.url("/forbidden.jsonl"), settings, tmp_path / "cache")


def test_https_too_large_is_refused_before_and_while_downloading(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/big.jsonl"] = Route(body=b"x" * 5000)
    https.routes["/stream.jsonl"] = Route(body=b"y" * 5000, length=False)
    settings = https_settings(tmp_path, https, max_dataset_bytes=1000)
    with pytest.raises(DatasetSourceError, match="is 5000 bytes, over the limit of 1000 bytes"):
        fetch(https.url("/big.jsonl"), settings, tmp_path / "cache")
    assert https.seen("GET", "/big.jsonl") == 0
    with pytest.raises(DatasetSourceError, match="is more than 1000 bytes"):
        fetch(https.url("/stream.jsonl"), settings, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".partial-")] == []


# --- s3 ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = LoopbackS3().start()
    yield server.endpoint
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    if "datasets" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket="datasets")
    return client


def test_s3_fetch_and_cache_hit(tmp_path: Path, s3: Any, s3_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    body = b'{"text": "from s3"}\n' * 1000
    s3.put_object(Bucket="datasets", Key="sft/train.jsonl", Body=body)
    settings = make_settings(tmp_path, s3_endpoint_url=s3_endpoint)
    progress: list[tuple[int, int | None]] = []
    path = fetch(
        "s3://datasets/sft/train.jsonl", settings, tmp_path / "cache", on_progress=lambda d, t: progress.append((d, t))
    )
    assert path == tmp_path / "cache" / hashlib.sha256(body).hexdigest() / "train.jsonl"
    assert path.read_bytes() == body
    assert progress == [(len(body), len(body))]

    with caplog.at_level(logging.INFO, logger="shared.data.remote"):
        assert fetch("s3://datasets/sft/train.jsonl", settings, tmp_path / "cache") == path
    assert "is cached" in caplog.text

    s3.put_object(Bucket="datasets", Key="sft/train.jsonl", Body=b'{"text": "v2"}\n')
    assert fetch("s3://datasets/sft/train.jsonl", settings, tmp_path / "cache").read_bytes() == b'{"text": "v2"}\n'


def test_s3_missing_key_bucket_and_folder(tmp_path: Path, s3: Any, s3_endpoint: str) -> None:
    s3.put_object(Bucket="datasets", Key="folder/a.jsonl", Body=b"{}\n")
    settings = make_settings(tmp_path, s3_endpoint_url=s3_endpoint)
    with pytest.raises(DatasetSourceError, match="was not found: check the bucket and key"):
        fetch("s3://datasets/nope.jsonl", settings, tmp_path / "cache")
    with pytest.raises(DatasetSourceError, match="was not found"):
        fetch("s3://no-such-bucket/a.jsonl", settings, tmp_path / "cache")
    with pytest.raises(DatasetSourceError, match="is a folder"):
        fetch("s3://datasets/folder", settings, tmp_path / "cache")


def test_s3_too_large(tmp_path: Path, s3: Any, s3_endpoint: str) -> None:
    s3.put_object(Bucket="datasets", Key="big.jsonl", Body=b"z" * 4096)
    settings = make_settings(tmp_path, s3_endpoint_url=s3_endpoint, max_dataset_bytes=100)
    with pytest.raises(DatasetSourceError, match="TUNEQ_MAX_DATASET_BYTES"):
        fetch("s3://datasets/big.jsonl", settings, tmp_path / "cache")


# --- hf ---------------------------------------------------------------------------------------------

MAIN = "a" * 40
V1 = "b" * 40


class _HubHandler(BaseHTTPRequestHandler):
    """The two requests a file download makes: HEAD (metadata) and GET on /datasets/<repo>/resolve/<rev>/<path>."""

    server: Any
    repos: dict[str, dict[str, str]] = {"org/name": {"main": MAIN, "v1": V1, MAIN: MAIN, V1: V1}}
    files: dict[str, dict[str, bytes]] = {
        MAIN: {"data/train.jsonl": b'{"text": "main"}\n'},
        V1: {"data/train.jsonl": b'{"text": "v1"}\n'},
    }

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _error(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _answer(self, with_body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        parts = self.path.split("/", 6)  # "", "datasets", org, name, "resolve", rev, path
        if len(parts) < 7 or parts[1] != "datasets" or parts[4] != "resolve":
            return self._error("RepoNotFound")
        revisions = self.repos.get(f"{parts[2]}/{parts[3]}")
        if revisions is None:
            return self._error("RepoNotFound")
        commit = revisions.get(unquote(parts[5]))
        if commit is None:
            return self._error("RevisionNotFound")
        body = self.files[commit].get(unquote(parts[6]))
        if body is None:
            return self._error("EntryNotFound")
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)


@pytest.fixture(scope="module")
def hub_server() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
    httpd.daemon_threads = True
    httpd.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.requests  # type: ignore[attr-defined]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def hub(
    hub_server: tuple[str, list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, list[tuple[str, str]]]:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    hub_server[1].clear()
    return hub_server


def test_hf_fetch_at_a_revision_and_cache_hit(tmp_path: Path, hub: tuple[str, list[tuple[str, str]]]) -> None:
    endpoint, requests = hub
    settings = make_settings(tmp_path, hf_endpoint=endpoint)
    cache = tmp_path / "cache"

    main = fetch("hf://datasets/org/name/data/train.jsonl", settings, cache)
    assert main.read_bytes() == b'{"text": "main"}\n' and main.name == "train.jsonl"
    assert requests == [
        ("HEAD", "/datasets/org/name/resolve/main/data/train.jsonl"),
        ("GET", f"/datasets/org/name/resolve/{MAIN}/data/train.jsonl"),  # pinned to the commit the HEAD named
    ]

    assert fetch("hf://datasets/org/name/data/train.jsonl", settings, cache) == main
    assert [m for m, _ in requests] == ["HEAD", "GET", "HEAD"]

    v1 = fetch("hf://datasets/org/name@v1/data/train.jsonl", settings, cache)
    assert v1.read_bytes() == b'{"text": "v1"}\n'
    assert v1.parent.name == hashlib.sha256(b'{"text": "v1"}\n').hexdigest()


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("hf://datasets/org/missing/train.jsonl", "dataset repo 'org/missing' was not found"),
        ("hf://datasets/org/name@v9/data/train.jsonl", "revision 'v9' of dataset repo 'org/name' was not found"),
        ("hf://datasets/org/name/nope.jsonl", "file 'nope.jsonl' was not found in dataset repo 'org/name'"),
    ],
)
def test_hf_missing_repo_revision_and_file(
    tmp_path: Path, hub: tuple[str, list[tuple[str, str]]], uri: str, fragment: str
) -> None:
    settings = make_settings(tmp_path, hf_endpoint=hub[0])
    with pytest.raises(DatasetSourceError) as excinfo:
        fetch(uri, settings, tmp_path / "cache")
    assert fragment in str(excinfo.value)


def test_dataset_file_is_the_path_itself_for_local_values(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    data = tmp_path / "my data.jsonl"
    data.write_text('{"text": "a"}\n')
    assert dataset_source.dataset_file(str(data), settings=settings) == data
    assert dataset_source.dataset_file("file://" + str(data).replace(" ", "%20"), settings=settings) == data
    assert not (settings.cache_dir / "downloads").exists()  # nothing copied


def test_dataset_file_downloads_remote_values_into_the_cache(tmp_path: Path, https: HttpsServer) -> None:
    https.routes["/d.jsonl"] = Route(body=b'{"text": "a"}\n')
    settings = https_settings(tmp_path, https)
    path = dataset_source.dataset_file(f"https://localhost:{https.port}/d.jsonl", settings=settings)
    assert path.is_relative_to(settings.cache_dir / "downloads")
    assert path.read_bytes() == b'{"text": "a"}\n'
