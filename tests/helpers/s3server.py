"""A real S3-API server for the tests (moto's standalone server on 127.0.0.1, a free port) and a faulty HTTP proxy.

`S3Server` starts `python -m moto.server`, waits until it answers, and stops it; `S3Server(node)` runs it inside a
tests/helpers/netns.py namespace of its own instead, on that host's address (the multi-node test's store). `env()` is what a client needs: the
endpoint (`AWS_ENDPOINT_URL`, the standard setting dsrecipes reads) and fake credentials, with the user's own AWS
files and the instance-metadata lookup switched off so nothing outside this machine is asked.

`FaultProxy` stands between a client and the server: each request is forwarded over a real socket; the first
`slowdowns` ranged GETs are answered 503 SlowDown (S3's throttling answer), the next `drops` ranged GETs send their
headers and half the body and then the connection is closed (a connection dropped in the middle of a range).
`stall()` makes it accept every request and answer none until `unstall()` (a store that stops answering).
`requests` and `body_bytes` count what clients asked for and received.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

SECRET = "dsrecipes-test-secret-Zq8Xv"  # must never appear in a run directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """On 127.0.0.1 here, or with `node` (a tests/helpers/netns.py Node) inside that node's network namespace on
    its address: only the namespaces on the same bridge reach it then (`endpoint` is that address)."""

    def __init__(self, node: Any = None, port: int = 9000) -> None:
        self.node = node
        self.host = "127.0.0.1" if node is None else node.addr
        self.port = free_port() if node is None else port  # a namespace of its own has every port free
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _answers(self) -> bool:
        if self.node is not None:
            return self.node.listening(self.port)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def start(self) -> "S3Server":
        argv = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
        self.proc = subprocess.Popen(argv if self.node is None else self.node.argv(argv),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._answers():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError("moto server exited at start")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto server did not start within 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def env(self, endpoint: Optional[str] = None) -> Dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": "dsrecipes-test-key",
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_CONFIG_FILE": os.devnull}


class FaultProxy:
    def __init__(self, upstream_port: int, slowdowns: int = 0, drops: int = 0):
        self.upstream_port = upstream_port
        self.slowdowns, self.drops = slowdowns, drops
        self.requests = 0
        self.body_bytes = 0
        self.lock = threading.Lock()
        self.answering = threading.Event()
        self.answering.set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self) -> None:
                proxy.forward(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FaultProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def stall(self) -> None:
        self.answering.clear()

    def unstall(self) -> None:
        self.answering.set()

    def _fault(self, handler: BaseHTTPRequestHandler) -> str:
        with self.lock:
            self.requests += 1
            if handler.command != "GET" or "Range" not in handler.headers:
                return ""
            if self.slowdowns > 0:
                self.slowdowns -= 1
                return "slowdown"
            if self.drops > 0:
                self.drops -= 1
                return "drop"
        return ""

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        if not self.answering.is_set():  # stalled: the request was accepted and is never answered
            self.answering.wait()
            handler.close_connection = True
            return
        fault = self._fault(handler)
        if fault == "slowdown":
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            handler.send_response(503)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        length = int(handler.headers.get("Content-Length") or 0)
        data = handler.rfile.read(length) if length else None
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
        conn.request(handler.command, handler.path, body=data, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        handler.send_response(resp.status)
        sent = set()
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "server", "date"):
                handler.send_header(k, v)
                sent.add(k.lower())
        if "content-length" not in sent:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command == "HEAD":
            return
        if fault == "drop":
            handler.wfile.write(body[: len(body) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        handler.wfile.write(body)
        with self.lock:
            self.body_bytes += len(body)
