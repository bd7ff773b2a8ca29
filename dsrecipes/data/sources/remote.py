"""Data in object stores: which URLs name data files, and listing, identity and (ranged) reads of them.

Two schemes, a positive list (`SCHEMES`):
  s3://bucket/prefix/*.jsonl   any S3-API store through fsspec's s3fs; the endpoint, region and credentials come from
                               the standard AWS settings only (`AWS_ENDPOINT_URL`, `AWS_PROFILE`, `AWS_ACCESS_KEY_ID`,
                               ~/.aws/credentials, ...), never from a recipe: a URL carrying `user:secret@` is refused.
  hf://datasets/org/name[@rev]/path   a Hugging Face Hub dataset, resolved through huggingface_hub's own cache
                               (`snapshot_download` of the files the pattern names; with HF_HUB_OFFLINE=1 the local
                               cache only) into local snapshot paths, which every other module reads as local files.
                               The Hub API cannot glob offline (`HfFileSystem` needs the network), the cache can.

An S3 object's identity is its ETag (and VersionId when the bucket keeps versions): `identity()` hashes those with the
URL and size, so a content key never reads the content. A reader's ranged reads (`RangeReader`; remote_ahead.RangePool for the
threads of remote_ahead.py, which groups a reader's adjacent blocks into one GET) are each one GET of exactly the
bytes asked for, with `If-Match` on the ETag the index recorded (and the VersionId): an object replaced during a run
is refused (`ObjectChanged`), never read mixed.

Liveness (issue 43): a ranged read is one GET through botocore's public client (never s3fs internals), which does not
retry; `RangeReader` retries with backoff and prints one line per failed attempt (object, bytes, endpoint, attempt
k/n), and a read that has not succeeded within `data.read_deadline_s` (all attempts and waits) is one DataError naming
the object and the endpoint. Each attempt's connect and read timeouts are an eighth of the deadline (at most
botocore's 10 s / 60 s), and no attempt starts that could end past the deadline, so a stalled store and a cut link
fail alike and in bounded time. Sequential reads (indexing, preparation) go through s3fs with the same timeouts,
botocore retrying an attempt twice and s3fs twice more. `check_versions` refuses an s3fs/botocore too old for this
before any rank starts.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.remote_hub import hf_expand

SCHEMES = ("s3", "hf")
READ_ATTEMPTS = 8  # a ranged read's attempts (RangeReader; botocore does not retry them): then the fault is reported
BACKOFF_S = 0.2  # first wait; doubles per attempt, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0
DEFAULT_READ_DEADLINE_S = 120.0  # data.read_deadline_s: one read, all its attempts and waits included
_deadline = [DEFAULT_READ_DEADLINE_S]
OPEN_BLOCK = 8 << 20  # sequential reads (indexing, map preparation): one GET per 8 MiB
PREFETCH_THREADS = 16  # ranged GETs in flight per reader process (remote_ahead.ReadAhead's threads)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,62}$")
_GLOB = re.compile(r"[*?\[]")


class ObjectChanged(DataError):
    """An object's ETag/version differs from the one recorded when the run indexed it."""

    def __init__(self, url: str):
        super().__init__(f"{url}: the object changed in the store since the launching process indexed it "
                         "(ETag/version differs); a run reads one version of its data: start the run again")


def is_url(path: Any) -> bool:
    """A path that names an object in a store (`s3://`, `hf://`), not a local file."""
    return isinstance(path, str) and "://" in path and path.split("://", 1)[0] in SCHEMES


def looks_like_url(path: Any) -> bool:
    """Any `scheme://` path (for the message that lists the schemes we read)."""
    return isinstance(path, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", path) is not None


def check_url(url: str) -> Optional[str]:
    """Why `url` cannot name data (None: it can): an unknown scheme, credentials in it, a malformed bucket."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        return f"{url!r}: scheme {scheme}:// is not read; data URLs are s3://bucket/key or hf://datasets/org/name/path"
    netloc = rest.split("/", 1)[0]
    if "@" in netloc or ":" in netloc:
        return (f"{scheme}://...: a data URL must not carry credentials or a port; credentials come from the "
                "environment or the standard credential files, the endpoint from AWS_ENDPOINT_URL / the profile")
    if scheme == "s3" and (not _BUCKET.match(netloc) or "/" not in rest):
        return f"{url!r}: expected s3://bucket/key (a bucket name of 3-63 lowercase letters, digits, '.', '-')"
    if scheme == "hf" and not re.match(r"^datasets/[^/]+/[^/@]+(@[^/]+)?/.+", rest):
        return f"{url!r}: expected hf://datasets/org/name[@revision]/path"
    return None


# ---------------------------------------------------------------------------------------------------------------
# File systems and errors


def configure(read_deadline_s: float) -> None:
    """data.read_deadline_s for this process (and the DataLoader workers it forks)."""
    if read_deadline_s != _deadline[0]:
        _deadline[0] = float(read_deadline_s)
        _S3.clear()
        _CLIENT.clear()


def attempt_timeouts() -> Tuple[float, float]:
    """(connect, read) timeouts of one attempt: an eighth of the deadline each, at most botocore's 10 s / 60 s, so
    a stalled store (GETs that never answer) and a cut link both end an attempt well inside the deadline."""
    share = max(1.0, _deadline[0] / 8)
    return min(10.0, share), min(60.0, share)


def _settings() -> tuple:
    return (os.getpid(), _deadline[0], *(os.environ.get(k) for k in (
        "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SHARED_CREDENTIALS_FILE")))


def s3() -> Any:
    """The S3 file system of this process and these standard settings (a forked reader gets its own; a changed
    endpoint, profile or key a new one). The endpoint and credentials are botocore's own resolution. Sequential reads
    (indexing, preparation) go through it: botocore retries an attempt twice, s3fs twice more."""
    import s3fs

    settings = _settings()
    if settings not in _S3:
        _S3.clear()
        connect, read = attempt_timeouts()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={
            "connect_timeout": connect, "read_timeout": read, "retries": {"max_attempts": 3, "mode": "standard"},
            "max_pool_connections": 2 * PREFETCH_THREADS})  # botocore's 10 would queue the read-ahead's GETs
        fs.retries = 2  # s3fs's own retry count (a public attribute; 5 by default)
        _S3[settings] = fs
    return _S3[settings]


def client() -> Any:
    """A plain (synchronous, thread-safe) botocore S3 client for ranged GETs, with the same standard settings as
    `s3()`; botocore does not retry (RangeReader does, within the deadline, saying so). Built once even when the
    read-ahead's threads all ask at once (each building one cost a reader ~1 s before its first batch)."""
    with _CLIENT_LOCK:
        return _CLIENT.get(_settings()) or _new_client(_settings())


def _new_client(settings: tuple) -> Any:
    import botocore.config  # lazy: only s3:// data needs botocore (a second of imports)
    import botocore.session  # lazy: as above

    _CLIENT.clear()
    connect, read = attempt_timeouts()
    config = botocore.config.Config(connect_timeout=connect, read_timeout=read, max_pool_connections=2 *
                                    PREFETCH_THREADS, retries={"total_max_attempts": 1, "mode": "standard"})
    _CLIENT[settings] = botocore.session.get_session().create_client("s3", config=config)
    return _CLIENT[settings]


def endpoint() -> str:
    """The store's endpoint as botocore resolved it (no credentials in it)."""
    try:
        url = client().meta.endpoint_url
    except Exception:  # noqa: BLE001 - a message must not fail on the way
        url = os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"
    return re.sub(r"//[^/@]*@", "//", str(url))


_S3: Dict[tuple, Any] = {}
_CLIENT: Dict[tuple, Any] = {}
_CLIENT_LOCK = threading.Lock()


@contextmanager
def store_errors(url: str) -> Iterator[None]:
    """Errors of the store as one DataError naming `url` and what to do (no traceback, no credentials)."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:  # botocore, aiohttp and fsspec errors share no base class worth naming
        raise DataError(f"{url}: {explain(exc)}") from None


def explain(exc: BaseException) -> str:
    name, text = type(exc).__name__, " ".join(str(exc).split())
    if name == "NoCredentialsError":
        return ("no credentials for the store: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                "(standard AWS settings; a recipe never holds credentials)")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError") or "connect" in text.lower():
        endpoint = re.sub(r"//[^/@]*@", "//", os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint"))
        return f"the store cannot be reached ({endpoint}): {re.sub(r'//[^/@]*@', '//', text)}"  # no user:secret@
    if isinstance(exc, PermissionError):
        return f"access denied by the store ({text}); check the credentials' permissions"
    if isinstance(exc, FileNotFoundError):
        return f"not found in the store ({text})"
    return f"{name}: {text}"


# ---------------------------------------------------------------------------------------------------------------
# Listing, identity, opening


MIN_VERSIONS = {"s3fs": "2024.6", "botocore": "1.31"}  # botocore 1.31: AWS_ENDPOINT_URL


def check_versions() -> None:
    """s3:// data needs s3fs and botocore new enough (a resolver that picked s3fs 0.4.2 made every read fail): one
    message naming what is installed, before any rank starts."""
    found, old = {}, []
    for name, least in MIN_VERSIONS.items():
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
        if found[name] == "not installed" or [int(x) for x in re.findall(r"\d+", found[name])[:3]] < [
                int(x) for x in least.split(".")]:
            old.append(f"{name}>={least}")
    if old:
        have = ", ".join(f"{k} {v}" for k, v in found.items())
        raise DataError(f"s3:// data needs {', '.join(old)}; installed: {have}. Install them next to dsrecipes: "
                        f"pip install {' '.join(repr(x) for x in old)}")


def expand(pattern: str) -> List[str]:
    """The files a URL names (a glob: sorted; none: []), as URLs (s3) or local snapshot paths (hf)."""
    problem = check_url(pattern)
    if problem:
        raise DataError(problem)
    if pattern.startswith("hf://"):
        return hf_expand(pattern)
    check_versions()
    fs = s3()
    with store_errors(pattern):
        if _GLOB.search(pattern):
            found = [f"s3://{p}" for p, info in fs.glob(pattern, detail=True).items() if info.get("type") == "file"]
            if not found:
                fs.info(f"s3://{pattern[5:].split('/', 1)[0]}")  # an unknown bucket says so
            return sorted(found)
        try:
            info = fs.info(pattern)
        except FileNotFoundError:
            fs.info(f"s3://{pattern[5:].split('/', 1)[0]}")
            return []
        return [pattern] if info.get("type") == "file" else []


def stat(url: str) -> Dict[str, Any]:
    """The object's metadata (size, ETag, VersionId, LastModified), fresh from the store."""
    fs = s3()
    with store_errors(url):
        fs.invalidate_cache(url)
        return fs.info(url)


def identity(url: str, info: Optional[Dict[str, Any]] = None) -> str:
    """The object's content key from its metadata (URL, size, ETag, VersionId): no byte of content is read."""
    info = stat(url) if info is None else info
    material = f"{url}|{info.get('size')}|{info.get('ETag')}|{info.get('VersionId')}"
    return "s3-" + hashlib.blake2b(material.encode(), digest_size=16).hexdigest()


def pin(url: str, digest: str) -> str:
    """The ETag (and VersionId) that ranged reads must match, checked against the content key `digest` the index
    was built under (one HEAD, on the launching side): `ETag` + US + `VersionId`."""
    info = stat(url)
    if identity(url, info) != digest:
        raise ObjectChanged(url)
    return f"{info.get('ETag') or ''}\x1f{info.get('VersionId') or ''}"


def size_mtime(path: str) -> Tuple[int, int]:
    """(size, modification time in ns) of a local file or an object."""
    if not is_url(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    info = stat(path)
    modified = info.get("LastModified")
    return int(info["size"]), int(modified.timestamp() * 1e9) if modified is not None else 0


def open_bytes(path: str, block_size: int = OPEN_BLOCK) -> IO[bytes]:
    """A binary reader of a local file or an object (sequential, `block_size` per GET)."""
    if not is_url(path):
        return open(path, "rb")
    with store_errors(path):  # one GET per buffer refill; BufferedReader gives the readline(limit) files.py uses
        return io.BufferedReader(s3().open(path, "rb", cache_type="none"), buffer_size=block_size)


def open_maybe_gzip(path: str) -> IO[bytes]:
    """`open_bytes`, decompressing `.gz`."""
    if not path.endswith(".gz"):
        return open_bytes(path)
    if not is_url(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    gz = gzip.GzipFile(fileobj=open_bytes(path), mode="rb")
    gz.myfileobj = gz.fileobj  # type: ignore[attr-defined]  # closed with the GzipFile
    return gz  # type: ignore[return-value]


class RangeReader:
    """Ranged reads of one object pinned to the version the index recorded; bounded retries with backoff. With
    `etag` (`pin`): each read is one GET with `If-Match` (and the VersionId), no HEAD at all; without: the object is
    opened (one HEAD) and its identity compared first."""

    def __init__(self, url: str, digest: str, etag: str = ""):
        self.url, self.digest, self.etag = url, digest, etag
        self.fh: Any = None
        self.retries = 0  # faults survived (tests and benchmarks read it)

    def _get(self, start: int, stop: int) -> bytes:
        """One ranged GET with If-Match (and the VersionId), through botocore's public client."""
        bucket, _, key = self.url[len("s3://"):].partition("/")
        etag, _, version_id = self.etag.partition("\x1f")
        extra = {"VersionId": version_id} if version_id else {}
        try:
            body = client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", IfMatch=etag,
                                       **extra)["Body"]
            try:
                return body.read()
            finally:
                body.close()
        except Exception as exc:
            code = str(((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code", ""))
            if code in ("412", "PreconditionFailed"):
                raise ObjectChanged(self.url) from None
            raise

    def _open(self) -> Any:
        with store_errors(self.url):
            fh = s3().open(self.url, "rb", cache_type="none")
        if identity(self.url, fh.details) != self.digest:
            fh.close()
            raise ObjectChanged(self.url)
        return fh

    def read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object, within data.read_deadline_s whatever the store does (a stalled
        server, a cut link, throttling): each failed attempt prints one line; the last is one DataError."""
        began = time.monotonic()
        _, read_timeout = attempt_timeouts()
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                data = self._get(start, stop) if self.etag else self._read_open(start, stop)
                if len(data) == stop - start:
                    return data
                raise ConnectionError(f"short read: {len(data)} of {stop - start} bytes")
            except DataError:
                raise
            except Exception as exc:
                if type(exc).__name__ == "FileExpired":
                    raise ObjectChanged(self.url) from None
                self.close()
                self.retries += 1
                wait = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1))
                spent = time.monotonic() - began
                if attempt == READ_ATTEMPTS or spent + wait + 2 * read_timeout > _deadline[0]:
                    raise DataError(f"{self.url}: bytes {start}-{stop} unreadable after {attempt} attempts in "
                                    f"{spent:.0f} s from {endpoint()} (data.read_deadline_s={_deadline[0]:g}): "
                                    f"{explain(exc)}") from None
                print(f"dsrecipes: {self.url} (bytes {start}-{stop}, {endpoint()}): attempt {attempt}/"
                      f"{READ_ATTEMPTS} failed ({explain(exc)}); retrying in {wait:.1f} s", file=sys.stderr,
                      flush=True)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _read_open(self, start: int, stop: int) -> bytes:  # (no ETag recorded: opened, its identity compared)
        if self.fh is None:
            self.fh = self._open()
        self.fh.seek(start)
        return self.fh.read(stop - start)

    def close(self) -> None:
        if self.fh is not None:
            try:
                self.fh.close()
            except Exception:
                pass
            self.fh = None
