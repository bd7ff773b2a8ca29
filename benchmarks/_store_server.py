"""The object store of bench_store.py (not a benchmark itself): moto's S3 server and the counting proxy, each in a
process of its own, the server answering a ranged GET the way S3 does.

Owner: benchmarks/. Two things the test helpers (tests/helpers/s3server.py) do that a comparison must not:

- moto 5 answers a ranged GET by reading the WHOLE object (under the object's lock) and then slicing it, so a range's
  cost grows with the object's size and ranges of one object are served one at a time: through the benchmark's
  proxy a 1 KiB range of a 33 MB JSONL object took 27 ms (median of 10) where a whole 2 MB MDS shard took 7 ms. S3's
  ranged GET costs what the range costs. `python _store_server.py moto HOST PORT` runs moto with its GET reading
  the asked range only (`bytes=a-b`, one range; any other request is moto's own code path, byte for byte).
- `FaultProxy` runs as threads of the process that starts it; the benchmark's readers ran in that process, so every
  byte a reader received had first been relayed by Python threads competing with the reader for its interpreter
  lock. `ProxyProcess` runs it in a process of its own (`python _store_server.py proxy UPSTREAM_PORT`) and asks it
  for its counters (`requests`, `body_bytes`) over a pipe.

Both systems of the comparison read through the same server and proxy.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def start_server():
    """tests.helpers.s3server.S3Server on 127.0.0.1, started through this module (ranged GETs read the range)."""
    from tests.helpers.s3server import S3Server

    server = S3Server()
    server.proc = subprocess.Popen([sys.executable, str(HERE / "_store_server.py"), "moto", server.host,
                                    str(server.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not server._answers():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("the moto server did not start within 60 s")
        time.sleep(0.2)
    return server


class _Slice:
    """What moto's range handling needs of an object's value: its full length and the asked slice."""

    def __init__(self, data: bytes, offset: int, size: int):
        self.data, self.offset, self.size = data, offset, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, cut: slice) -> bytes:
        return self.data[cut.start - self.offset:cut.stop - self.offset]


def patch_moto() -> None:
    from moto.s3 import models, responses

    asked = threading.local()
    key_response, value = responses.S3Response._key_response, models.FakeKey.value

    def _key_response(self, request, full_url):
        match = RANGE.fullmatch(request.headers.get("range") or "") if request.method == "GET" else None
        asked.span = (int(match[1]), int(match[2])) if match else None
        try:
            return key_response(self, request, full_url)
        finally:
            asked.span = None

    def ranged_value(self):
        span = getattr(asked, "span", None)
        if span is None or span[0] >= self.contentsize:
            return value.fget(self)
        with self.lock:
            self._value_buffer.seek(span[0])
            data = self._value_buffer.read(span[1] + 1 - span[0])
        return _Slice(data, span[0], self.contentsize)

    responses.S3Response._key_response = _key_response
    models.FakeKey.value = property(ranged_value, value.fset)


class ProxyProcess:
    """tests.helpers.s3server.FaultProxy in a process of its own; `requests` and `body_bytes` ask it."""

    def __init__(self, upstream_port: int):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_store_server.py"), "proxy", str(upstream_port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            raise RuntimeError(f"the counting proxy did not start ({self.endpoint!r})")

    def _counts(self) -> list:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return [int(x) for x in self.proc.stdout.readline().split()]

    @property
    def requests(self) -> int:
        return self._counts()[0]

    @property
    def body_bytes(self) -> int:
        return self._counts()[1]

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve_proxy(upstream_port: int) -> None:
    sys.path.insert(0, str(HERE.parent))
    from tests.helpers.s3server import FaultProxy

    proxy = FaultProxy(upstream_port).start()
    print(proxy.endpoint, flush=True)
    for _ in sys.stdin:  # one line asked, one answered; stdin closed: stop
        with proxy.lock:
            print(proxy.requests, proxy.body_bytes, flush=True)
    proxy.stop()


if __name__ == "__main__":
    if sys.argv[1] == "moto":
        patch_moto()
        from moto.server import main as moto_main

        moto_main(["-H", sys.argv[2], "-p", sys.argv[3]])
    else:
        serve_proxy(int(sys.argv[2]))
