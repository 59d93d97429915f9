"""A real HTTP server on 127.0.0.1 serving a prepared data folder, with Range requests and injectable faults.

    with ShardServer(data_dir) as server:                  # a free port; server.url = "http://127.0.0.1:PORT"
        server.faults["train/train-00001.tar"] = Fault(reset_after=5000)
        ...                                                # server.requests: (path, first byte, status) per request

Faults, per file path relative to the folder, each for its first `times` requests:
    unavailable   answer 503 to the first K requests
    reset_after   send N bytes of the body (counted from the file's start), then reset the connection (RST)
    stall_after   send N bytes, then send nothing for stall_s seconds (the client's stall timeout fires)
With `auth=(user, password)` every request must carry that Basic authorization (else 401), so a test can prove the
credentials in a URL are sent (and, elsewhere, never printed).

FaultProxy puts the same faults in front of another HTTP server (the S3 server of s3_server.py): requests pass
through to it unchanged and its answers come back, with a fault's reset, 503 or stall applied to a GET of the named
path ("bucket/key"); a ranged GET counts the fault's byte from the file's start. Writes (PUT, POST, DELETE) pass
through too, each logged in `writes`; a fault's `unavailable` refuses the named key's first writes with 503, its
`denied` with 403 AccessDenied.
`latency_s` and `bytes_per_s` make every read look far away (bench/benchmarks/bench_remote.py); a FaultProxy in front
of a ShardServer does the same for plain HTTP.
"""

from __future__ import annotations

import base64
import http.client
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 16 * 1024


@dataclass
class Fault:
    unavailable: int = 0
    reset_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0
    times: int = 1  # requests that reset or stall (after them the file is served whole)
    denied: int = 0  # FaultProxy: answer 403 AccessDenied to the named key's first K writes (a refused credential)
    served: int = 0  # requests that reached the body (counted by the server)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # the tests read server.requests instead
        pass

    def do_GET(self) -> None:
        owner = self.server.owner
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        start = 0
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and ranged.endswith("-"):
            start = int(ranged[len("bytes="):-1])
        if owner.auth is not None:
            token = base64.b64encode(f"{owner.auth[0]}:{owner.auth[1]}".encode()).decode()
            if self.headers.get("Authorization") != f"Basic {token}":
                return self._status(rel, start, 401)
        file = (owner.root / rel).resolve()
        if owner.root not in file.parents or not file.is_file():
            return self._status(rel, start, 404)
        with owner.lock:
            fault = owner.faults.get(rel)
            if fault is not None and fault.unavailable > 0:
                fault.unavailable -= 1
                fault_now = None
                unavailable = True
            else:
                unavailable = False
                fault_now = fault if fault is not None and fault.served < fault.times else None
                if fault is not None:
                    fault.served += 1
        if unavailable:
            return self._status(rel, start, 503)
        data = file.read_bytes()
        if start >= len(data) and data:
            return self._status(rel, start, 416)
        owner.log(rel, start, 206 if start else 200)
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        try:
            _send_faulty(self, data[start:], start, fault_now)
        except OSError:  # the client went away (after a stall it timed out): nothing more to send
            self.close_connection = True

    def _status(self, rel: str, start: int, code: int) -> None:
        self.server.owner.log(rel, start, code)
        body = f"{code}\n".encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:  # the socket was reset on purpose
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stalled handler must not hold up stop()
    owner: "ShardServer"

    def handle_error(self, request, client_address) -> None:  # resets and stalls break sockets on purpose
        pass


class ShardServer:
    def __init__(self, root: Path, auth: tuple[str, str] | None = None):
        self.root = Path(root).resolve()
        self.auth = auth
        self.faults: dict[str, Fault] = {}
        self.requests: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        # serve_forever polls for shutdown every 0.5 s by default: 0.05 s makes stop() quick
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="shard-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def log(self, rel: str, start: int, status: int) -> None:
        with self.lock:
            self.requests.append((rel, start, status))

    def start(self) -> "ShardServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "ShardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _send_faulty(handler: BaseHTTPRequestHandler, body: bytes, first: int, fault: Fault | None,
                 bytes_per_s: float = 0.0) -> None:
    """Write `body` (bytes from file offset `first`) with `fault`'s reset or stall at its file offset, paced to
    `bytes_per_s` when given (a link's bandwidth, per connection)."""
    position = 0
    began = time.perf_counter()
    while position < len(body):
        if bytes_per_s:
            ahead = position / bytes_per_s - (time.perf_counter() - began)
            if ahead > 0:
                time.sleep(ahead)
        end = min(len(body), position + CHUNK)
        at = first + position
        for limit in (None if fault is None else fault.reset_after, None if fault is None else fault.stall_after):
            if limit is not None and at < limit < first + end:
                end = limit - first
        if fault is not None and fault.reset_after is not None and at >= fault.reset_after:
            handler.wfile.flush()
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.connection.close()
            handler.close_connection = True
            return
        if fault is not None and fault.stall_after is not None and at >= fault.stall_after:
            handler.wfile.flush()
            time.sleep(fault.stall_s)
            fault = None
        handler.wfile.write(body[position:end])
        position = end
    handler.wfile.flush()


class _ProxyHandler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._forward("HEAD")

    def do_GET(self) -> None:
        self._forward("GET")

    def do_PUT(self) -> None:
        self._forward_write("PUT")

    def do_POST(self) -> None:
        self._forward_write("POST")

    def do_DELETE(self) -> None:
        self._forward_write("DELETE")

    def _forward_write(self, method: str) -> None:
        """A write passed through (an upload's PUT, a multipart POST, a DELETE), logged in owner.writes; a fault's
        `unavailable` answers 503 to the named key's first writes instead."""
        owner = self.server.owner
        key = unquote(urlsplit(self.path).path).lstrip("/")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with owner.lock:
            fault = owner.faults.get(key)
            refused = fault is not None and fault.unavailable > 0
            denied = not refused and fault is not None and fault.denied > 0
            if refused:
                fault.unavailable -= 1
            if denied:
                fault.denied -= 1
            owner.writes.append((method, key, 503 if refused else 403 if denied else None))
        if refused:
            return self._answer(503, [("Content-Type", "application/xml")],
                                b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>")
        if denied:
            return self._answer(403, [("Content-Type", "application/xml")],
                                b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
        headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
        upstream = http.client.HTTPConnection(*owner.upstream, timeout=30)
        try:
            upstream.request(method, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        with owner.lock:
            owner.writes[-1] = (method, key, answer.status)
        self._answer(answer.status, answer.getheaders(), data)

    def _answer(self, status: int, headers, body: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in ("connection", "transfer-encoding", "server", "date", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self, method: str) -> None:
        owner = self.server.owner
        key = unquote(urlsplit(self.path).path).lstrip("/")
        first, last = 0, None
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes="):
            low, _, high = ranged[len("bytes="):].partition("-")
            first, last = int(low), int(high) if high else None
        fault_now = None
        with owner.lock:
            fault = owner.faults.get(key) if method == "GET" else None
            if fault is not None and fault.unavailable > 0:
                fault.unavailable -= 1
                owner.requests.append((key, first, 503))
                unavailable = True
            else:
                unavailable = False
                # A reset or stall fires on a request whose range holds its byte (S3 reads a file in several ranges)
                at = fault.reset_after if fault is not None and fault.reset_after is not None else (
                    fault.stall_after if fault is not None else None)
                if at is not None and first <= at and (last is None or at <= last) and fault.served < fault.times:
                    fault_now = fault
                    fault.served += 1
        if unavailable:
            body = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if owner.latency_s:
            time.sleep(owner.latency_s)
        upstream = http.client.HTTPConnection(*owner.upstream, timeout=30)
        try:
            upstream.request(method, self.path, headers=dict(self.headers.items()))
            answer = upstream.getresponse()
            body = answer.read()
        finally:
            upstream.close()
        if method == "GET":
            owner.log(key, first, answer.status)
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("connection", "transfer-encoding", "server", "date"):
                self.send_header(name, value)
        self.end_headers()
        if method == "HEAD":
            return
        try:
            _send_faulty(self, body, first, fault_now, owner.bytes_per_s)
        except OSError:
            self.close_connection = True

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass


class FaultProxy(ShardServer):
    """ShardServer's faults in front of `upstream` ("http://host:port"); `url` is the proxy's address."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.auth = None
        self.faults = {}
        self.requests = []
        self.writes: list[tuple[str, str, int | None]] = []  # (method, "bucket/key", status) per write
        self.latency_s = 0.0  # a wait before every read (GET, HEAD) is forwarded: a far server's round trip
        self.bytes_per_s = 0.0  # a read's body paced to this rate, per connection (0: as fast as loopback goes)
        self.lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _ProxyHandler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fault-proxy",
                                        daemon=True)
