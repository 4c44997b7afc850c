"""Remote datasets: which URIs a job may name, and fetching them into a content-addressed cache.

Three kinds of remote URI are accepted, everything else is refused with a message a user can act on:

- ``s3://bucket/key`` through s3fs, against ``TUNEQ_S3_ENDPOINT_URL`` (MinIO, another S3 store) or AWS;
  credentials come from the usual AWS variables and files.
- ``https://host/path`` through fsspec's HTTP filesystem, only from hosts in ``TUNEQ_ALLOWED_HTTPS_HOSTS``
  and only to public addresses (or networks in ``TUNEQ_ALLOWED_PRIVATE_NETWORKS``). The address check runs
  on the answers of the resolver the connection uses, and the host check on every redirect hop, so neither
  DNS rebinding nor a redirect reaches a refused address.
- ``hf://datasets/org/name[@revision]/path/in/repo`` (HfFileSystem's syntax), from ``TUNEQ_HF_ENDPOINT``.

Local paths and host-less ``file://`` URIs are not remote: :func:`parse_dataset_uri` returns None and the
caller applies its own local checks. Torch-free and cheap to import: s3fs, fsspec, aiohttp and
huggingface_hub load on first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import socket
import ssl
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn
from urllib.parse import quote, unquote, urlsplit

from shared.data.uploaded_files import UploadedFileGone, is_file_id, uploaded_file_path
from shared.settings import Settings

if TYPE_CHECKING:
    import aiohttp
    import yarl

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int | None], None]

# on_progress is called at most once per this many bytes (and once at the end).
PROGRESS_EVERY_BYTES = 1 << 20
_CHUNK_BYTES = 1 << 20
# As long as the job body's dataset field may be.
_MAX_URI_LENGTH = 4000
# The index maps (uri, identity) to a digest; old entries only cost a re-download, so it stays small.
_INDEX_MAX_ENTRIES = 1000
_INDEX_FILE = ".dataset-sources.json"
_INDEX_LOCK = ".dataset-sources.lock"
_HTTP_CONNECT_TIMEOUT_S = 30.0
_HTTP_READ_TIMEOUT_S = 120.0

_SUPPORTED = "use s3://bucket/key, https://host/path, hf://datasets/org/name/path/in/repo, or an absolute local path"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")
# AWS's rules (MinIO's are the same): 3-63 lowercase letters, digits, dots and hyphens.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_HUB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._\-]{0,94}[A-Za-z0-9])?")
_HUB_REVISION = re.compile(r"[A-Za-z0-9._\-/]{1,200}")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9\-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9\-]{0,61}[a-z0-9])?)*"
)

# Never reachable, whatever TUNEQ_ALLOWED_PRIVATE_NETWORKS says: cloud instance metadata and similar
# host-local services hand out credentials. 168.63.129.16 (Azure's wire server) is even a public address.
_METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "168.63.129.16", "fd00:ec2::254")
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class DatasetSourceError(ValueError):
    """A dataset URI that is refused, or a fetch that failed because of it. ``str()`` is safe to show users."""


@dataclass(frozen=True)
class RemoteDataset:
    """A checked remote dataset URI.

    ``location`` is the bucket (s3), ``host`` or ``host:port`` (https) or repo id ``org/name`` (hf);
    ``path`` the key (s3), the path and query (https) or the path in the repo (hf).
    """

    scheme: Literal["s3", "https", "hf"]
    uri: str
    location: str
    path: str
    # hf only; None means the default branch.
    revision: str | None = None

    @property
    def filename(self) -> str:
        """The object's own file name, made safe for the cache; its extension is kept."""
        path = self.path.split("?", 1)[0] if self.scheme == "https" else self.path
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return _safe_filename(unquote(name) if self.scheme == "https" else name)


# --- parsing ---------------------------------------------------------------------------------------


def parse_dataset_uri(uri: str, settings: Settings) -> RemoteDataset | None:
    """Check a dataset reference: a :class:`RemoteDataset`, None for a local path or ``file://`` URI.

    Raises :class:`DatasetSourceError` for a refused URI. String checks plus, for https, one DNS lookup.
    """
    match = _SCHEME.match(uri)
    if match is None:
        return None  # a path (absolute or not): the caller's local checks apply
    scheme = match.group(1).lower()
    if scheme == "https" and (bare := _bare_ipv6_host(uri)) is not None:
        bracketed = uri.replace(bare, f"[{bare}]", 1)
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' names the IPv6 address {bare} without brackets: "
            f"write it as '{shown_uri(bracketed)}'"
        )
    if "::" in _without_ipv6_literal(uri):
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' chains protocols with '::', which is refused: "
            f"give one plain URI ({_SUPPORTED})"
        )
    if scheme == "file":
        host = urlsplit(uri).netloc.rsplit("@", 1)[-1]
        if host:
            raise DatasetSourceError(
                f"dataset URI '{shown_uri(uri)}' names a host ('{host}'): file:// URIs are local, "
                "write file:///absolute/path (three slashes) or the path itself"
            )
        return None
    _check_characters(uri)
    normalized = scheme + uri[len(scheme) :]
    if scheme == "s3":
        remote = _parse_s3(normalized)
        store = settings.artifacts_uri.rstrip("/")
        if store.startswith("s3://") and (remote.uri == store or remote.uri.startswith(store + "/")):
            # Every job's checkpoints live there, read with the workers' credentials: a dataset
            # URI must not become a way into another owner's artifacts.
            raise DatasetSourceError(
                f"dataset URI '{shown_uri(uri)}' is inside tuneq's artifact store ({store}): datasets cannot "
                "be read from it; copy the file elsewhere, or download a job's files with GET /jobs/{id}/artifacts"
            )
        return remote
    if scheme == "https":
        return _parse_https(normalized, settings)
    if scheme == "hf":
        return _parse_hf(normalized)
    if scheme == "http":
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' uses plain http://, which is refused: use https://")
    raise DatasetSourceError(f"dataset URIs with '{scheme}:' are not supported: {_SUPPORTED}")


def shown_uri(uri: str) -> str:
    """The URI for messages and logs: no user:password, no query (pre-signed URLs carry signatures there)."""
    uri = re.sub(r"://[^/?#]*@", "://***@", uri)
    uri = re.sub(r"\?.*$", "?...", uri, flags=re.DOTALL)
    return uri if len(uri) <= 200 else uri[:200] + "..."


def _bare_ipv6_host(uri: str) -> str | None:
    """The host of ``scheme://fd00::1/...``, an IPv6 address written without the brackets a
    URI needs (RFC 3986), or None."""
    authority = uri.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1]
    if authority.startswith("["):
        return None
    try:
        return authority if ipaddress.ip_address(authority).version == 6 else None
    except ValueError:
        return None


def _without_ipv6_literal(uri: str) -> str:
    # "https://[::1]/x" is no chain: only "::" outside a bracketed host counts.
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.\-]*://)\[[0-9A-Fa-f:.]*\]", r"\1[]", uri)


def _check_characters(uri: str) -> None:
    if len(uri) > _MAX_URI_LENGTH:
        raise DatasetSourceError(f"dataset URI is longer than {_MAX_URI_LENGTH} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):
        raise DatasetSourceError(f"dataset URI {shown_uri(uri)!r} contains control characters: remove them")
    if "\\" in uri:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' contains a backslash: separate path segments with /")


def _check_segments(uri: str, path: str) -> None:
    """Refuse ``..`` segments, also percent-encoded (once or more) or behind encoded slashes."""
    decoded = path
    for _ in range(4):
        again = unquote(decoded)
        if again == decoded:
            break
        decoded = again
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' encodes control characters: remove them")
    if any(segment == ".." for segment in re.split(r"[/\\]", decoded)):
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' has a '..' path segment (perhaps percent-encoded), which is refused: "
            "give the object's direct path"
        )


def _refuse_userinfo(netloc: str) -> None:
    # The URI is not repeated: it would put the password into the job's error and the logs.
    if "@" in netloc:
        raise DatasetSourceError(
            "dataset URI carries credentials (user:password@host), which is refused: remove them; "
            "the workers' own credentials apply (AWS for s3://, HF_TOKEN for hf://, none for https://)"
        )


def _parse_s3(uri: str) -> RemoteDataset:
    parts = urlsplit(uri)
    if not uri.startswith("s3://"):
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' is not of the form s3://bucket/key")
    _refuse_userinfo(parts.netloc)
    bucket = parts.netloc
    if ":" in bucket:
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' names a port: s3:// URIs name a bucket; the operator sets the S3 "
            "endpoint (TUNEQ_S3_ENDPOINT_URL)"
        )
    if not _BUCKET.fullmatch(bucket):
        raise DatasetSourceError(
            f"'{bucket}' in '{shown_uri(uri)}' is not an S3 bucket name (3-63 lowercase letters, digits, '.' or '-')"
        )
    if parts.query or parts.fragment or "?" in uri or "#" in uri:
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' has a '?' or '#' part, which s3:// URIs cannot have: name the key alone"
        )
    key = parts.path[1:]
    if not key or key.endswith("/"):
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' names a bucket or folder: name one object, like s3://{bucket}/train.jsonl"
        )
    _check_segments(uri, key)
    return RemoteDataset(scheme="s3", uri=f"s3://{bucket}/{key}", location=bucket, path=key)


def _parse_https(uri: str, settings: Settings) -> RemoteDataset:
    parts = urlsplit(uri)
    if not uri.startswith("https://"):
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' is not of the form https://host/path")
    _refuse_userinfo(parts.netloc)
    if parts.fragment or "#" in uri:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' has a '#' fragment: remove it")
    try:
        port = parts.port or 443
    except ValueError:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' has an invalid port") from None
    host = _normalize_host(uri, parts.hostname or "")
    if not parts.path or parts.path.endswith("/"):
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' names no file: give the URL of the file itself")
    _check_segments(uri, parts.path)
    refusal = _host_refusal(host, port, settings)
    if refusal is not None:
        raise DatasetSourceError(refusal)
    networks = _allowed_private_networks(settings)
    for address in _resolve(host, port):
        problem = _address_refusal(host, address, networks)
        if problem is not None:
            raise DatasetSourceError(problem)
    shown_host = f"[{host}]" if ":" in host else host
    location = shown_host if port == 443 else f"{shown_host}:{port}"
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return RemoteDataset(scheme="https", uri=uri, location=location, path=path)


def _normalize_host(uri: str, host: str) -> str:
    if not host:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' names no host")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    try:
        ascii_host = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' has an invalid host name") from None
    if not _HOSTNAME.fullmatch(ascii_host):
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' has an invalid host name '{host}' (a trailing dot is not allowed either)"
        )
    return ascii_host


def _parse_hf(uri: str) -> RemoteDataset:
    example = "hf://datasets/org/name/path/in/repo.jsonl (or hf://datasets/org/name@revision/...)"
    if not uri.startswith("hf://"):
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' is not of the form {example}")
    rest = uri[len("hf://") :]
    if not rest.startswith("datasets/"):
        raise DatasetSourceError(
            f"dataset URI '{shown_uri(uri)}' does not name a dataset repo: only dataset repos are read, write {example}"
        )
    if "?" in rest or "#" in rest:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' has a '?' or '#' part, which hf:// URIs cannot have")
    m = re.fullmatch(r"datasets/(?P<org>[^/@]+)/(?P<name>[^/@]+)(?:@(?P<rev>[^/]*))?/(?P<path>.+)", rest)
    if m is None:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' is not of the form {example}")
    org, name, path = m.group("org"), m.group("name"), m.group("path")
    if not (_HUB_NAME.fullmatch(org) and _HUB_NAME.fullmatch(name)) or "--" in org + name or ".." in org + name:
        raise DatasetSourceError(f"'{org}/{name}' in '{shown_uri(uri)}' is not a valid hub repo id")
    revision: str | None = None
    if m.group("rev") is not None:
        # HfFileSystem's syntax: a revision with a slash (refs/pr/1) is percent-encoded (refs%2Fpr%2F1).
        revision = unquote(m.group("rev"))
        if (
            not _HUB_REVISION.fullmatch(revision)
            or revision.startswith(("/", "-"))
            or ".." in revision
            or "//" in revision
        ):
            raise DatasetSourceError(
                f"revision '{m.group('rev')}' in '{shown_uri(uri)}' is not a branch, tag or commit name "
                "(letters, digits, '.', '_', '-', and '/' written as %2F)"
            )
    if path.endswith("/") or "//" in path:
        raise DatasetSourceError(f"dataset URI '{shown_uri(uri)}' names a folder: name one file in the repo")
    _check_segments(uri, path)
    shown_revision = f"@{quote(revision, safe='')}" if revision is not None else ""
    return RemoteDataset(
        scheme="hf",
        uri=f"hf://datasets/{org}/{name}{shown_revision}/{path}",
        location=f"{org}/{name}",
        path=path,
        revision=revision,
    )


# --- https: hosts and addresses ----------------------------------------------------------------------


def _allowed_host_entries(settings: Settings) -> list[tuple[str, int]]:
    entries: list[tuple[str, int]] = []
    for raw in settings.allowed_https_hosts.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        host, port_text = entry, ""
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif entry.count(":") == 1:
            host, port_text = entry.split(":")
        try:
            port = int(port_text) if port_text else 443
            with contextlib.suppress(ValueError):
                host = str(ipaddress.ip_address(host))
        except ValueError:
            raise RuntimeError(
                f"TUNEQ_ALLOWED_HTTPS_HOSTS: '{raw.strip()}' is not host, host:port or *.domain"
            ) from None
        entries.append((host, port))
    return entries


def _host_refusal(host: str, port: int, settings: Settings) -> str | None:
    entries = _allowed_host_entries(settings)
    shown = host if port == 443 else f"{host}:{port}"
    if not entries:
        return (
            f"https:// datasets are not enabled on this server: ask the operator to allow '{shown}' in "
            "TUNEQ_ALLOWED_HTTPS_HOSTS, or use s3://, hf:// or a local path"
        )
    names = [(pattern, p) for pattern, p in entries if _host_matches(pattern, host)]
    if not names:
        return f"https host '{host}' is not allowed: ask the operator to add it to TUNEQ_ALLOWED_HTTPS_HOSTS"
    if not any(p == port for _, p in names):
        return (
            f"port {port} of https host '{host}' is not allowed: ask the operator to add '{host}:{port}' to "
            "TUNEQ_ALLOWED_HTTPS_HOSTS (an entry without a port allows 443 only)"
        )
    return None


def _host_matches(pattern: str, host: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def _allowed_private_networks(settings: Settings) -> list[IPNetwork]:
    networks: list[IPNetwork] = []
    for raw in settings.allowed_private_networks.split(","):
        if raw.strip():
            try:
                networks.append(ipaddress.ip_network(raw.strip(), strict=False))
            except ValueError:
                raise RuntimeError(
                    f"TUNEQ_ALLOWED_PRIVATE_NETWORKS: '{raw.strip()}' is not a network like 10.0.0.0/8"
                ) from None
    return networks


def _embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4), which is what gets reached."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def _address_refusal(host: str, address: IPAddress, networks: list[IPNetwork]) -> str | None:
    """None if ``host`` may be reached at ``address``, else the reason, fit for users."""
    target = _embedded_ipv4(address)
    if isinstance(target, ipaddress.IPv6Address) and target.scope_id:
        target = ipaddress.IPv6Address(str(target).split("%", 1)[0])
    if target in _METADATA_ADDRESSES or target.is_link_local:
        return (
            f"https host '{host}' resolves to {address}, a link-local or cloud metadata address, "
            "which is never allowed: use a public host"
        )
    if target.is_unspecified or target.is_multicast:
        return f"https host '{host}' resolves to {address}, which is never allowed: use a public host"
    if target.is_global or any(target in net for net in networks if net.version == target.version):
        return None
    kind = "loopback" if target.is_loopback else "private"
    return (
        f"https host '{host}' resolves to {address}, a {kind} address: datasets come from public addresses "
        "unless the operator adds its network to TUNEQ_ALLOWED_PRIVATE_NETWORKS"
    )


def _resolve(host: str, port: int) -> list[IPAddress]:
    with contextlib.suppress(ValueError):
        return [ipaddress.ip_address(host)]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        infos = []
    addresses = list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos))
    if not addresses:
        raise DatasetSourceError(f"https host '{host}' could not be resolved: check the URI")
    return addresses


class _ConnectionRefused(Exception):
    """Raised inside aiohttp when a hop or an address is refused; the guard keeps the user's message."""


class _HttpsGuard:
    """The checks every connection of one https fetch goes through, and the first refusal it met."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.networks = _allowed_private_networks(settings)
        self.refusal: str | None = None

    def refuse(self, message: str) -> NoReturn:
        if self.refusal is None:
            self.refusal = message
            logger.warning("refused an https dataset connection: %s", message)
        raise _ConnectionRefused(message)

    def check_url(self, url: yarl.URL) -> None:
        """Every hop, redirects included, before anything connects."""
        if url.scheme != "https":
            self.refuse(f"the dataset URL redirected to a {url.scheme}:// URL ({url.host}), which is refused")
        if url.user is not None or url.password is not None:
            self.refuse("the dataset URL redirected to a URL with credentials, which is refused")
        host = (url.raw_host or "").lower()
        port = url.port or 443
        refusal = _host_refusal(host, port, self.settings)
        if refusal is not None:
            self.refuse(f"the dataset URL redirected to a refused host: {refusal}")
        # aiohttp connects to an IP-literal host without asking the resolver, so check it here.
        with contextlib.suppress(ValueError):
            self.check_addresses(host, [ipaddress.ip_address(host)])

    def check_addresses(self, host: str, addresses: Iterable[IPAddress]) -> None:
        for address in addresses:
            problem = _address_refusal(host, address, self.networks)
            if problem is not None:
                self.refuse(problem)

    async def middleware(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        self.check_url(request.url)
        # aiohttp moves a URL's user:password into this header before the request reaches here, and
        # tuneq itself never sends credentials to https hosts.
        if "Authorization" in request.headers:
            self.refuse("the dataset URL redirected to a URL with credentials, which is refused")
        return await handler(request)


def _guarded_client_factory(guard: _HttpsGuard) -> Callable[..., Any]:
    """fsspec's ``get_client``: a session whose resolver refuses non-public answers, checked per hop."""

    async def get_client(**_: Any) -> aiohttp.ClientSession:
        import aiohttp
        from aiohttp.abc import AbstractResolver, ResolveResult

        class GuardedResolver(AbstractResolver):
            # The addresses checked are the very ones the connector then connects to, so a second,
            # different DNS answer (rebinding) cannot slip past the submit-time check.
            def __init__(self) -> None:
                self._inner = aiohttp.ThreadedResolver()

            async def resolve(
                self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
            ) -> list[ResolveResult]:
                results = await self._inner.resolve(host, port, family)
                guard.check_addresses(host, (ipaddress.ip_address(r["host"].split("%", 1)[0]) for r in results))
                return results

            async def close(self) -> None:
                await self._inner.close()

        context = ssl.create_default_context()
        if guard.settings.ca_bundle:
            context.load_verify_locations(cafile=guard.settings.ca_bundle)
        connector = aiohttp.TCPConnector(resolver=GuardedResolver(), ssl=context, limit=4)
        # trust_env=False: through a proxy the address checks would judge the proxy, not the host.
        return aiohttp.ClientSession(
            connector=connector,
            middlewares=(guard.middleware,),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=_HTTP_CONNECT_TIMEOUT_S, sock_read=_HTTP_READ_TIMEOUT_S
            ),
        )

    return get_client


# --- fetching ---------------------------------------------------------------------------------------


def local_path(value: str) -> Path:
    """A local reference (a path, ``~/...`` or a ``file://`` URI) as a path."""
    if value.lower().startswith("file://"):
        value = unquote(urlsplit(value).path)
    return Path(os.path.expanduser(value))


def dataset_file(value: str, *, settings: Settings, on_progress: ProgressCallback | None = None) -> Path:
    """The file on this host a dataset value stands for: the path itself, the cached download,
    or the copy of an uploaded file (``file-...``).

    One place for the API's plan and the worker, so both read the very same bytes. Raises
    :class:`DatasetSourceError` for a refused or failed remote, or a deleted file.
    """
    if is_file_id(value):
        try:
            return uploaded_file_path(value, settings=settings)
        except UploadedFileGone as e:
            raise DatasetSourceError(str(e)) from None
    remote = parse_dataset_uri(value, settings)
    if remote is None:
        return local_path(value)
    return fetch_dataset(remote, settings=settings, cache_dir=settings.cache_dir / "downloads", on_progress=on_progress)


def fetch_dataset(
    remote: RemoteDataset,
    *,
    settings: Settings,
    cache_dir: Path,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """Download ``remote`` into ``cache_dir/<sha256>/<file name>`` and return that path.

    A second fetch of an unchanged object downloads nothing where the store tells its version cheaply
    (S3 ETag, HTTP ETag/Last-Modified, the hub's commit and ETag). ``on_progress(done, total)`` is called
    at most every :data:`PROGRESS_EVERY_BYTES` and once at the end; ``total`` is None when unknown, and
    an exception it raises aborts the download. Raises :class:`DatasetSourceError` for what the user can
    fix (refused, missing, denied, too big); other errors (network, server) propagate.
    """
    # Checked again with this process's settings: the URI may have been stored under other ones.
    checked = parse_dataset_uri(remote.uri, settings)
    if checked is None or checked.scheme != remote.scheme:
        raise DatasetSourceError(f"'{shown_uri(remote.uri)}' is not a remote dataset URI")
    cache = _Cache(cache_dir, limit=settings.max_dataset_bytes, on_progress=on_progress)
    fetchers = {"s3": _fetch_s3, "https": _fetch_https, "hf": _fetch_hf}
    return fetchers[checked.scheme](checked, settings, cache)


def _too_big(uri: str, size: int, limit: int, *, at_least: bool = False) -> DatasetSourceError:
    amount = f"more than {_gib(limit)}" if at_least else _gib(size)
    return DatasetSourceError(
        f"dataset '{shown_uri(uri)}' is {amount}, over the limit of {_gib(limit)} (TUNEQ_MAX_DATASET_BYTES): "
        "use a smaller file, or ask the operator to raise the limit"
    )


def _gib(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.1f} GiB"
    return f"{n / 1024**2:.1f} MiB" if n >= 1024**2 else f"{n} bytes"


class _Progress:
    def __init__(self, callback: ProgressCallback | None, total: int | None) -> None:
        self.callback = callback
        self.total = total
        self.reported = -1

    def update(self, done: int, *, final: bool = False) -> None:
        if self.callback is None:
            return
        if (final and done != self.reported) or done - max(self.reported, 0) >= PROGRESS_EVERY_BYTES:
            self.reported = done
            self.callback(done, self.total)


class _Cache:
    """``<dir>/<sha256>/<name>`` files, written whole or not at all, and the (uri, identity) index."""

    def __init__(self, directory: Path, *, limit: int, on_progress: ProgressCallback | None) -> None:
        self.directory = directory
        self.limit = limit
        self.on_progress = on_progress
        directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _key(uri: str, identity: str) -> str:
        # Hashed: a pre-signed URL's signature has no business lying around in the cache directory.
        return hashlib.sha256(f"{uri}\n{identity}".encode()).hexdigest()

    def _read_index(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads((self.directory / _INDEX_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def lookup(self, uri: str, identity: str | None) -> Path | None:
        if identity is None:
            return None
        entry = self._read_index().get(self._key(uri, identity))
        if not isinstance(entry, dict):
            return None
        digest, name, size = entry.get("sha256"), entry.get("name"), entry.get("size")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)) or not isinstance(name, str):
            return None
        if name != _safe_filename(name):
            return None
        path = self.directory / digest / name
        try:
            if path.stat().st_size != size:
                return None
        except OSError:
            return None
        logger.info("dataset %s is cached (%s): %s", shown_uri(uri), identity, path)
        _Progress(self.on_progress, size).update(size, final=True)
        return path

    def remember(self, uri: str, identity: str | None, path: Path) -> None:
        if identity is None:
            return
        with self._index_lock():
            index = self._read_index()
            index.pop(self._key(uri, identity), None)
            index[self._key(uri, identity)] = {
                "sha256": path.parent.name,
                "name": path.name,
                "size": path.stat().st_size,
            }
            while len(index) > _INDEX_MAX_ENTRIES:
                index.pop(next(iter(index)))
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".index-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(index, f)
                os.replace(tmp, self.directory / _INDEX_FILE)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    @contextlib.contextmanager
    def _index_lock(self) -> Iterator[None]:
        # Workers on one host share the cache; the lock keeps their index updates from losing each other's.
        with open(self.directory / _INDEX_LOCK, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def check_size(self, uri: str, total: int | None) -> None:
        if total is not None and total > self.limit:
            raise _too_big(uri, total, self.limit)

    def store(self, uri: str, filename: str, chunks: Iterable[bytes], *, total: int | None) -> Path:
        """Write ``chunks`` to a temporary file while hashing, then rename it into place."""
        self.check_size(uri, total)
        progress = _Progress(self.on_progress, total)
        digest = hashlib.sha256()
        done = 0
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    done += len(chunk)
                    if done > self.limit:
                        raise _too_big(uri, done, self.limit, at_least=True)
                    digest.update(chunk)
                    f.write(chunk)
                    progress.update(done)
                f.flush()
                os.fsync(f.fileno())
            if total is not None and done != total:
                raise OSError(
                    f"dataset {shown_uri(uri)}: got {done} bytes, expected {total}; the download was cut short"
                )
            target = self.directory / digest.hexdigest() / filename
            target.parent.mkdir(exist_ok=True)
            if target.is_file() and target.stat().st_size == done:
                os.unlink(tmp)  # the same content is already there
            else:
                os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        progress.update(done, final=True)
        logger.info("fetched dataset %s: %d bytes, sha256 %s", shown_uri(uri), done, digest.hexdigest())
        return target


def _read_chunks(read: Callable[[int], bytes]) -> Iterator[bytes]:
    while chunk := read(_CHUNK_BYTES):
        yield chunk


def _safe_filename(name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._\-]", "_", name).lstrip(".")
    if not name:
        return "dataset"
    if len(name) > 128:
        stem, dot, ext = name.rpartition(".")
        name = stem[: 127 - len(ext)] + dot + ext if dot and len(ext) <= 16 else name[:128]
    return name


# --- s3 ---------------------------------------------------------------------------------------------


def _fetch_s3(remote: RemoteDataset, settings: Settings, cache: _Cache) -> Path:
    from shared.artifacts.store import s3_filesystem

    fs = s3_filesystem(settings)
    key = f"{remote.location}/{remote.path}"
    try:
        info = fs.info(key)
        if info.get("type") != "file":
            raise DatasetSourceError(f"'{shown_uri(remote.uri)}' is a folder: name one object in it")
        identity = f"etag={info.get('ETag')};size={info.get('size')}" if info.get("ETag") else None
        total = info.get("size")
        cached = cache.lookup(remote.uri, identity)
        if cached is not None:
            return cached
        cache.check_size(remote.uri, total)
        # s3fs pins the ETag of info() on its ranged reads, so a concurrent overwrite fails instead of mixing.
        with fs.open(key, "rb", block_size=8 * _CHUNK_BYTES, cache_type="readahead") as f:
            path = cache.store(remote.uri, remote.filename, _read_chunks(f.read), total=total)
    except FileNotFoundError:
        raise DatasetSourceError(f"dataset '{shown_uri(remote.uri)}' was not found: check the bucket and key") from None
    except PermissionError:
        raise DatasetSourceError(
            f"access to dataset '{shown_uri(remote.uri)}' was denied: "
            "grant the workers' S3 credentials read access to it"
        ) from None
    cache.remember(remote.uri, identity, path)
    return path


# --- https ------------------------------------------------------------------------------------------


def _fetch_https(remote: RemoteDataset, settings: Settings, cache: _Cache) -> Path:
    from fsspec.asyn import sync
    from fsspec.implementations.http import HTTPFileSystem

    if settings.ca_bundle and not Path(settings.ca_bundle).is_file():
        # Checked here: inside fsspec a missing file would pass for a missing dataset.
        raise RuntimeError(f"TUNEQ_CA_BUNDLE: '{settings.ca_bundle}' is not a file")
    guard = _HttpsGuard(settings)
    fs = HTTPFileSystem(get_client=_guarded_client_factory(guard), skip_instance_cache=True)
    try:
        try:
            info = fs.info(remote.uri)
        except Exception as e:
            _raise_https_error(remote, guard, e)
        validators = [f"{k}={info[k]}" for k in ("ETag", "Last-Modified") if info.get(k)]
        identity = ";".join([*validators, f"size={info.get('size')}"]) if validators else None
        total = info.get("size")
        cached = cache.lookup(remote.uri, identity)
        if cached is not None:
            return cached
        cache.check_size(remote.uri, total)
        try:
            with fs.open(remote.uri, "rb", block_size=0, size=total) as f:
                path = cache.store(remote.uri, remote.filename, _read_chunks(f.read), total=total)
        except DatasetSourceError:
            raise
        except Exception as e:
            _raise_https_error(remote, guard, e)
    finally:
        if fs._session is not None:
            with contextlib.suppress(Exception):
                sync(fs.loop, fs._session.close, timeout=5)
    cache.remember(remote.uri, identity, path)
    return path


def _raise_https_error(remote: RemoteDataset, guard: _HttpsGuard, error: Exception) -> NoReturn:
    """A user's message for what they can fix; the original error (unwrapped from fsspec) otherwise."""
    import aiohttp

    if guard.refusal is not None:
        raise DatasetSourceError(guard.refusal) from None
    status: int | None = None
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, aiohttp.ClientResponseError):
            status = cause.status
            break
        cause = cause.__cause__
    if status in (404, 410) or (status is None and isinstance(error, FileNotFoundError) and error.__cause__ is None):
        raise DatasetSourceError(
            f"dataset '{shown_uri(remote.uri)}' was not found (HTTP {status or 404}): check the URL"
        ) from None
    if status in (401, 403):
        raise DatasetSourceError(
            f"access to dataset '{shown_uri(remote.uri)}' was denied (HTTP {status}): tuneq sends no credentials; "
            "use a public or pre-signed URL"
        ) from None
    if status is not None and 400 <= status < 500:
        raise DatasetSourceError(
            f"dataset '{shown_uri(remote.uri)}' could not be fetched: the server answered HTTP {status}"
        ) from None
    # fsspec reports any failure of its size probe as FileNotFoundError; the cause says what happened.
    if isinstance(error, FileNotFoundError) and isinstance(error.__cause__, Exception):
        raise error.__cause__
    raise error


# --- hf ---------------------------------------------------------------------------------------------


def _fetch_hf(remote: RemoteDataset, settings: Settings, cache: _Cache) -> Path:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    endpoint = settings.hf_endpoint.rstrip("/")
    revision = remote.revision or "main"

    def url(at: str) -> str:
        return hf_hub_url(remote.location, remote.path, repo_type="dataset", revision=at, endpoint=endpoint)

    try:
        meta = get_hf_file_metadata(url(revision), endpoint=endpoint)
        identity = f"commit={meta.commit_hash};etag={meta.etag}" if meta.commit_hash or meta.etag else None
        cached = cache.lookup(remote.uri, identity)
        if cached is not None:
            return cached
        cache.check_size(remote.uri, meta.size)
        # Downloading at the commit the metadata named keeps a branch moving meanwhile from mixing versions.
        with get_session().stream(
            "GET",
            url(meta.commit_hash or revision),
            headers=build_hf_headers(),
            timeout=_HTTP_READ_TIMEOUT_S,
            follow_redirects=True,
        ) as response:
            if response.is_error:
                response.read()
                hf_raise_for_status(response)
            path = cache.store(
                remote.uri, remote.filename, response.iter_bytes(chunk_size=_CHUNK_BYTES), total=meta.size
            )
    except GatedRepoError:
        raise DatasetSourceError(
            f"dataset repo '{remote.location}' is gated: accept its terms on the hub with the account whose "
            "HF_TOKEN the workers use"
        ) from None
    except RepositoryNotFoundError:
        raise DatasetSourceError(
            f"dataset repo '{remote.location}' was not found on {endpoint} (or is private): check the name, "
            "or give the workers an HF_TOKEN that can read it"
        ) from None
    except RevisionNotFoundError:
        raise DatasetSourceError(
            f"revision '{revision}' of dataset repo '{remote.location}' was not found: check the branch, tag or commit"
        ) from None
    except EntryNotFoundError:
        raise DatasetSourceError(
            f"file '{remote.path}' was not found in dataset repo '{remote.location}' at '{revision}': check the path"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise DatasetSourceError(
                f"access to dataset '{shown_uri(remote.uri)}' was denied (HTTP {status}): give the workers an HF_TOKEN "
                "that can read it"
            ) from None
        if status == 404:
            raise DatasetSourceError(
                f"dataset '{shown_uri(remote.uri)}' was not found: check the repo, revision and path"
            ) from None
        raise
    cache.remember(remote.uri, identity, path)
    return path
