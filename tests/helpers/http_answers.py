"""A real HTTP server on 127.0.0.1 whose answers a test writes: `answer(request)` returns
(status, headers, body), the body bytes or an iterable of byte chunks written one by one (a
trickle, or a body larger than the test wants to hold). Every request is recorded (method, path,
query, headers) before it is answered. Stopped by `close()`, which also ends a body still being
written. `mlflow_run(...)` answers the few MLflow REST calls `nummon replay mlflow:` makes."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Body = bytes | Iterable[bytes]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class AnswerServer:
    def __init__(self, answer: Callable[[Request], tuple[int, dict[str, str], Body]]) -> None:
        self.requests: list[Request] = []
        self.stopped = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                parts = urllib.parse.urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                req = Request(
                    self.command,
                    parts.path,
                    dict(urllib.parse.parse_qsl(parts.query)),
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(n) if n else b"",
                )
                owner.requests.append(req)
                status, headers, body = answer(req)
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    if isinstance(body, bytes):
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                    self.send_header("Connection", "close")  # the body ends when the connection does
                    self.end_headers()
                    for chunk in body:
                        if owner.stopped.is_set():
                            break
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError:  # the client went away mid-answer
                    pass
                self.close_connection = True

            do_GET = do_POST = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.block_on_close = False
        self.port = self.server.server_address[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


def as_json(obj: Any) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(obj).encode()


def mlflow_run(rows: dict[str, list[tuple[int, Any]]], status: str = "FINISHED") -> Callable[[Request], Any]:
    """Answers for one finished run whose metrics are `rows` (key -> [(step, value)]), each
    history in one page. A value that is a str is written into the JSON as it stands (e.g. a
    400-digit integer)."""

    def value(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    def answer(req: Request) -> tuple[int, dict[str, str], bytes]:
        if req.path.endswith("/runs/get"):
            latest = [
                f'{{"key": {json.dumps(k)}, "value": {value(r[-1][1])}, "step": {r[-1][0]}, "timestamp": 1}}'
                for k, r in rows.items()
            ]
            text = f'{{"run": {{"info": {{"status": "{status}"}}, "data": {{"metrics": [{", ".join(latest)}]}}}}}}'
            return 200, {"Content-Type": "application/json"}, text.encode()
        if req.path.endswith("/metrics/get-history"):
            key = req.query.get("metric_key", "")
            items = [
                f'{{"key": {json.dumps(key)}, "value": {value(v)}, "step": {s}, "timestamp": 1}}'
                for s, v in rows.get(key, [])
            ]
            return 200, {"Content-Type": "application/json"}, f'{{"metrics": [{", ".join(items)}]}}'.encode()
        return 404, {}, b'{"error_code": "ENDPOINT_NOT_FOUND"}'

    return answer
