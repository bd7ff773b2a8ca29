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
URL and size, so a content key never reads the content. A reader's ranged reads (`RangeReader`, `RangePool` for the
threads of remote_ahead.py, which groups a reader's adjacent blocks into one GET) are each one GET of exactly the
bytes asked for, with `If-Match` on the ETag the index recorded (and the VersionId): an object replaced during a run is
refused (`ObjectChanged`), never read mixed. Transient faults (throttling,
5xx, a connection dropped mid-body, timeouts) are retried by botocore/s3fs and then by `RangeReader` (bounded, with
backoff); a fault that outlasts them is one DataError naming the object.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.remote_hub import hf_expand

SCHEMES = ("s3", "hf")
READ_ATTEMPTS = 5  # RangeReader's own retries (each after s3fs's and botocore's): then the fault is reported
BACKOFF_S = 0.2  # first wait; doubles per attempt
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


def s3() -> Any:
    """The S3 file system of this process and these standard settings (a forked reader gets its own; a changed
    endpoint, profile or key a new one). The endpoint and credentials are botocore's own resolution."""
    import s3fs

    settings = (os.getpid(), *(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE",
                                                           "AWS_ACCESS_KEY_ID", "AWS_SHARED_CREDENTIALS_FILE")))
    if settings not in _S3:
        _S3.clear()
        _S3[settings] = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={
            "connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 5, "mode": "standard"},
            "max_pool_connections": 2 * PREFETCH_THREADS})  # botocore's 10 would queue the read-ahead's GETs
    return _S3[settings]


_S3: Dict[tuple, Any] = {}


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


def expand(pattern: str) -> List[str]:
    """The files a URL names (a glob: sorted; none: []), as URLs (s3) or local snapshot paths (hf)."""
    problem = check_url(pattern)
    if problem:
        raise DataError(problem)
    if pattern.startswith("hf://"):
        return hf_expand(pattern)
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
        """One ranged GET with If-Match through s3fs's own ranged fetch (its retries included)."""
        from s3fs.core import _fetch_range

        fs = s3()
        bucket, key, _ = fs.split_path(self.url)
        etag, _, version = self.etag.partition("\x1f")
        try:
            return _fetch_range(fs, bucket, key, version or None, start, stop, req_kw={"IfMatch": etag})
        except OSError as exc:
            if len(exc.args) > 1 and "pre-condition" in str(exc.args[1]).lower() or "412" in str(exc):
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
        for attempt in range(READ_ATTEMPTS):
            try:
                if self.etag:
                    data = self._get(start, stop)
                else:
                    if self.fh is None:
                        self.fh = self._open()
                    self.fh.seek(start)
                    data = self.fh.read(stop - start)
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
                if attempt + 1 == READ_ATTEMPTS:
                    raise DataError(f"{self.url}: bytes {start}-{stop} unreadable after {READ_ATTEMPTS} attempts: "
                                    f"{explain(exc)}") from None
                time.sleep(BACKOFF_S * 2 ** attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.fh is not None:
            try:
                self.fh.close()
            except Exception:
                pass
            self.fh = None


class RangePool:
    """Ranged reads from several threads (the read-ahead's, remote_ahead.py): one RangeReader per object and
    thread; `retries` counts the faults all of them survived."""

    def __init__(self, threads: int = PREFETCH_THREADS):
        self.threads = threads
        self._local = threading.local()
        self._all: List[RangeReader] = []
        self._lock = threading.Lock()

    def read(self, url: str, digest: str, etag: str, start: int, stop: int) -> bytes:
        readers = self._local.__dict__.setdefault("readers", {})
        if url not in readers:
            readers[url] = RangeReader(url, digest, etag)
            with self._lock:
                self._all.append(readers[url])
        return readers[url].read(start, stop)

    @property
    def retries(self) -> int:
        with self._lock:
            return sum(r.retries for r in self._all)

    def close(self) -> None:
        with self._lock:
            for reader in self._all:
                reader.close()
            self._all.clear()
        self._local = threading.local()
