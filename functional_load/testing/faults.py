"""A faulting HTTP proxy on the loopback, between an S3 client and its server, for tests.

:class:`FaultProxy` listens on 127.0.0.1 and forwards each request to the server, one request per
connection (it answers ``Connection: close``), so a client's signed requests pass unchanged (the
signature covers the ``Host`` the client sent, which the proxy keeps). Faults queued with
:meth:`FaultProxy.inject` replace the next matching requests' answers:

* ``"slowdown"``: ``503 SlowDown`` (S3's throttling answer), the request never reaches the server;
* ``"error"``: ``500 InternalError``;
* ``"reset"``: the server's answer, cut after ``after`` body bytes by a TCP reset;
* ``"truncate"``: the same cut by an orderly close (fewer bytes than ``Content-Length`` says);
* ``"short"``: a consistent but short answer: ``Content-Length`` lowered to ``after``, the body cut
  there (a client that trusts the length sees success with too few bytes).

``delay_seconds`` delays every request (a round trip on a slower network). Requests are logged
(:attr:`FaultProxy.log`: method, path, Range, If-Match) and counted with the faults (:attr:`FaultProxy.seen`,
:attr:`FaultProxy.injected`).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

FaultKind = Literal["slowdown", "error", "reset", "truncate", "short"]
_CANNED = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass
class Fault:
    kind: FaultKind
    method: str = "GET"
    ranged: bool = True  # only requests with a Range header (reads of bytes, not HEAD or LIST)
    after: int = 0  # body bytes passed on before a reset, truncate or short answer


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """An HTTP head (through the blank line) and whatever followed it in the same reads."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}


def _with_header(head: bytes, name: str, value: str) -> bytes:
    """``head`` with header ``name`` set to ``value`` (replacing any)."""
    lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    kept = [line for line in lines[1:] if line.partition(":")[0].strip().lower() != name.lower()]
    return "\r\n".join([lines[0], *kept, f"{name}: {value}", "", ""]).encode("latin-1")


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream`` (``host:port``), injecting queued faults."""

    def __init__(self, upstream: str, delay_seconds: float = 0.0) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.delay_seconds = delay_seconds
        self.seen: Counter[str] = Counter()  # requests by method
        self.log: list[tuple[str, str, str | None, str | None]] = []  # (method, path, Range, If-Match) of each request
        self.injected: Counter[str] = Counter()  # faults by kind
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fault-proxy")
        self._thread.start()

    def inject(self, kind: FaultKind, times: int = 1, method: str = "GET", ranged: bool = True, after: int = 0) -> None:
        """Fail the next ``times`` requests that match (``method``; a Range header when ``ranged``)."""
        with self._lock:
            self._faults += [Fault(kind, method, ranged, after) for _ in range(times)]

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True, name="fault-proxy-conn").start()

    def _take(self, method: str, path: str, headers: dict[str, str]) -> Fault | None:
        with self._lock:
            self.seen[method] += 1
            self.log.append((method, path, headers.get("range"), headers.get("if-match")))
            for i, fault in enumerate(self._faults):
                if fault.method == method and (not fault.ranged or "range" in headers):
                    self.injected[fault.kind] += 1
                    return self._faults.pop(i)
        return None

    def _handle(self, client: socket.socket) -> None:
        with client:
            head, rest = _read_head(client)
            if not head:
                return
            headers = _headers(head)
            body = rest
            while len(body) < int(headers.get("content-length", "0")):
                chunk = client.recv(65536)
                if not chunk:
                    return
                body += chunk
            if self.delay_seconds:
                time.sleep(self.delay_seconds)
            method, path = head.decode("latin-1").split(" ", 2)[:2]
            fault = self._take(method, path, headers)
            if fault is not None and fault.kind in _CANNED:
                status, reason, code, message = _CANNED[fault.kind]
                xml = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'.encode()
                client.sendall(
                    f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(xml)}\r\n"
                    f"Connection: close\r\n\r\n".encode() + xml
                )
                return
            with socket.create_connection(self.upstream) as server:
                server.sendall(_with_header(head, "Connection", "close") + body)
                self._relay(server, client, fault)

    def _relay(self, server: socket.socket, client: socket.socket, fault: Fault | None) -> None:
        """The server's answer to the client, cut as ``fault`` says."""
        head, rest = _read_head(server)
        if not head:
            return
        head = _with_header(head, "Connection", "close")
        if fault is not None and fault.kind == "short":
            head = _with_header(head, "Content-Length", str(fault.after))
        client.sendall(head)
        budget = fault.after if fault is not None else None
        data = rest
        while True:
            if budget is not None and len(data) >= budget:
                client.sendall(data[:budget])
                break
            if data:
                client.sendall(data)
                budget = budget - len(data) if budget is not None else None
            data = server.recv(65536)
            if not data:
                return
        if fault is not None and fault.kind == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
