"""A webhook endpoint on 127.0.0.1 recording every JSON body posted to it (the watcher's webhook
tests and Alertmanager's Slack receiver use the same one)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """Serves on a free port until `close()`; `bodies` holds each posted JSON body in order."""

    bodies: list[Any]
    event_ids: list[str | None]
    answered: list[str | None]

    def __init__(self, path: str = "/hook", delay_s: float = 0.0) -> None:
        bodies = self.bodies = []
        ids = self.event_ids = []  # each post's X-Nummon-Event-Id header, in order
        answered = self.answered = []  # the event ids of the posts whose answer went out whole

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                ids.append(self.headers.get("X-Nummon-Event-Id"))
                body = json.loads(self.rfile.read(n))
                bodies.append(body)
                time.sleep(delay_s)  # a slow endpoint: the sender waits this long for its answer
                try:
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"ok")
                    self.wfile.flush()
                except OSError:  # the sender is gone (killed mid-post): no answer reached it
                    return
                answered.append(body.get("event_id"))

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
