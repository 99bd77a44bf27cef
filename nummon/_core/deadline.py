"""A deadline for one HTTP request in all (connecting, redirects, headers and body): when it
passes, every socket the request opened is shut down, which ends a read that is blocked or fed
one byte at a time. A per-read time-out cannot: each byte restarts it. `Deadline.opener()` is
urllib with that deadline on every connection and redirects left to the caller."""

from __future__ import annotations

import functools
import http.client
import socket
import threading
import time
import urllib.request
from typing import Any

from .redirects import NoRedirect

__all__ = ["Deadline"]


class Deadline:
    """One request's deadline: when it passes, every socket the request opened is shut down,
    which ends a read that is blocked or fed one byte at a time, in headers or body alike."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.expired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                _shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for s in self._socks:
                _shut(s)

    def cancel(self) -> None:
        self._timer.cancel()

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib with redirects left to the caller and every connection under this deadline."""
        return urllib.request.build_opener(NoRedirect(), _HTTPHandler(self), _HTTPSHandler(self))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _connection(cls: type, deadline: Deadline, *args: Any, **kwargs: Any) -> http.client.HTTPConnection:
    conn = cls(*args, **kwargs)
    create = conn._create_connection
    conn._create_connection = lambda *a, **k: deadline.watch(create(*a, **k))
    return conn


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_connection, http.client.HTTPConnection, self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        conn = functools.partial(_connection, http.client.HTTPSConnection, self.deadline)
        return self.do_open(conn, req, context=self._context)  # type: ignore[attr-defined]
