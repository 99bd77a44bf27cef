"""Webhook notifications: an HTTP POST of Slack-compatible JSON (``{"text": ...}``) per incident
event, from a thread of its own with a bounded queue, a timeout and retries with backoff, so a
slow or dead endpoint never blocks the reading loop. Standard library only (urllib)."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from .._errors import NummonError

__all__ = ["WebhookTarget", "slack_payload"]

log = logging.getLogger("nummon.watch")


def slack_payload(event: Any) -> dict[str, Any]:
    """Slack's incoming-webhook shape (Mattermost, Discord's /slack endpoint and Teams' connectors
    read it too): a bold title line, then the summary."""
    return {"text": f"*{event.title}*\n{event.summary()}", "nummon": event.to_dict()}


class WebhookTarget:
    """POSTs each event; `sent`, `failed` and `dropped` count what happened to them."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        queue_size: int = 100,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise NummonError(f"webhook URL must start with http:// or https://, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self.sent = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="nummon-webhook", daemon=True)
        self._thread.start()

    def notify(self, event: Any) -> None:
        """Queue one event; never waits (when the queue is full the oldest event is dropped and
        counted: the JSONL target, when given, still holds every event)."""
        body = json.dumps(slack_payload(event), allow_nan=False, default=str).encode("utf-8")
        while True:
            try:
                self._queue.put_nowait(body)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                body = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._post(body)

    def _post(self, body: bytes) -> None:
        delay = self.backoff_s
        tries = 0
        for attempt in range(self.retries + 1):
            if attempt:
                if self._stop.wait(delay):  # closing: no more waiting for a dead endpoint
                    break
                delay *= 2
            tries += 1
            req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                self.sent += 1
                return
            except urllib.error.HTTPError as e:
                if 400 <= e.code < 500 and e.code != 429:  # the endpoint refuses this message: no retry
                    break
            except (urllib.error.URLError, OSError):
                pass
        self.failed += 1
        log.warning("nummon watch: webhook %s: could not deliver a notification (%d tries)", self.url, tries)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, waiting at most `timeout_s` (then retries stop)."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
