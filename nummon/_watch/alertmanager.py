"""`--notify alertmanager:URL[,URL...]`: incident events as Alertmanager alerts (its v2 API,
``POST /api/v2/alerts``), so Alertmanager does the grouping, silences, inhibition and routing.

One alert per open incident per run (``alertname="NummonIncident"``, labels run, severity,
state, kind, host). Like Prometheus, the target re-posts every active alert each `repeat_s`
seconds with ``endsAt`` a few repeats ahead, so Alertmanager keeps it firing while the watcher
lives, and posts it with ``endsAt`` = now when the incident resolves. An escalation changes the
labels (state, severity): the old alert is resolved and the new one fires. Several URLs are the
members of an HA cluster: every alert goes to each of them (they deduplicate among
themselves). Posting runs on a thread of its own with timeouts and retries; a failure is
counted (`failed`, per URL and batch), an outage logged once, and nothing blocks the watch
loop. ``user:password@`` in a URL is sent as HTTP basic auth and never printed."""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

from .._errors import NummonError
from .text import safe_url
from .webhook import check_url

__all__ = ["AlertmanagerTarget", "alert_labels", "ALERTNAME"]

log = logging.getLogger("nummon.watch")

ALERTNAME = "NummonIncident"
_STATES = {1: "open", 2: "critical", 3: "nonfinite"}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _basic_auth(url: str) -> tuple[str, str | None]:
    """(the URL without user:password, its HTTP basic Authorization header or None)."""
    p = urllib.parse.urlsplit(url)
    if p.username is None:
        return url, None
    netloc = (p.hostname or "") + (f":{p.port}" if p.port else "")
    token = base64.b64encode(f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}".encode()).decode()
    return urllib.parse.urlunsplit(p._replace(netloc=netloc)), f"Basic {token}"


def alert_labels(d: dict[str, Any], host: str) -> dict[str, str]:
    """The labels of an incident event (its `to_dict()`): the alert's identity in Alertmanager."""
    level = int(d.get("level") or 0)
    contributors = d.get("contributors") or []
    kind = str(contributors[0].get("kind")) if contributors and contributors[0].get("kind") else "unknown"
    return {
        "alertname": ALERTNAME,
        "run": str(d.get("run")),
        "severity": "critical" if level >= 2 else "warning",
        "state": _STATES.get(level, str(d.get("state", "open"))),
        "kind": kind,
        "host": host,
    }


class AlertmanagerTarget:
    """Posts incident events to one Alertmanager, or to each member of an HA cluster.
    `sent` counts batches delivered, `failed` batches a URL did not take after its retries,
    `dropped` batches pushed out of a full queue. `timeout_s` per request, `backoff_s` before
    the first retry (doubling), `repeat_s` between re-posts of the firing alerts (seconds)."""

    kind = "alertmanager"

    def __init__(self, urls: str | list[str], timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.5,
                 repeat_s: float = 60.0, host: str | None = None, queue_size: int = 100) -> None:
        urls = [u for u in (urls.split(",") if isinstance(urls, str) else urls) if u]
        if not urls:
            raise NummonError("alertmanager: no URL given")
        for u in urls:
            try:
                check_url(u)
            except NummonError as e:
                raise NummonError(f"alertmanager: {e}".replace("webhook URL", "URL")) from None
        self.urls = [u.rstrip("/") for u in urls]
        self._auth = {u: _basic_auth(u) for u in self.urls}  # user:password@ in a URL: HTTP basic auth
        self._down: set[str] = set()  # members whose last post failed: logged once per outage
        # printed forms carry scheme and host only; the key names this target in the state file's outbox
        self.shown = "alertmanager " + ", ".join(safe_url(u) for u in self.urls)
        self.key = "alertmanager:" + hashlib.blake2b(",".join(self.urls).encode(), digest_size=6).hexdigest()
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        if repeat_s <= 0:
            raise NummonError(f"alertmanager: repeat interval must be > 0 seconds, got {repeat_s}")
        self.repeat_s = repeat_s
        self.host = host or socket.gethostname()
        self._active: dict[str, dict[str, Any]] = {}  # run -> the alert now firing for it
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self.sent = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="nummon-alertmanager", daemon=True)
        self._thread.start()

    # --- events -> alerts ------------------------------------------------------------------
    def notify(self, event: Any) -> None:
        """Queue the alerts one incident event changes; never waits."""
        d = event.to_dict()
        run = str(d.get("run"))
        now = time.time()
        batch: list[dict[str, Any]] = []
        with self._lock:
            old = self._active.get(run)
            if int(d.get("level") or 0) == 0 or d.get("transition") == "resolved":
                if old is not None:
                    del self._active[run]
                    batch.append({**old, "endsAt": _iso(now)})
            else:
                labels = alert_labels(d, self.host)
                same = old is not None and old["labels"] == labels
                if old is not None and not same:  # escalated: a new identity; the old one ends
                    batch.append({**old, "endsAt": _iso(now)})
                alert = self._alert(labels, str(d.get("title") or event.title), str(d.get("summary") or ""),
                                    old["startsAt"] if same else _iso(now))
                self._active[run] = alert
                batch.append(self._firing(alert, now))
        if batch:
            self._put(batch)

    def run_started(self, run: Any, spec: Any) -> None:
        """Watcher hook: a run resumed from the state file with its incident open is firing
        again (same labels, so Alertmanager sees the alert it already holds, not a new one)."""
        event = run.engine.current_incident(run.last_step or 0)
        if event is None:
            return
        lines = [f"run `{run.id}`: Incident {event.number} (opened at step {event.opened_step}) is still "
                 f"**{event.state.value}** (re-posted after the watcher restarted)."]
        lines += [c.line() for c in event.contributors[:5]]
        d = {"run": run.id, "level": event.state.rank, "contributors": [c.to_dict() for c in event.contributors]}
        now = time.time()
        with self._lock:
            if run.id in self._active:
                return
            alert = self._alert(alert_labels(d, self.host), event.title, "\n".join(lines), _iso(now))
            self._active[run.id] = alert
            batch = [self._firing(alert, now)]
        self._put(batch)

    @staticmethod
    def _alert(labels: dict[str, str], summary: str, description: str, starts_at: str) -> dict[str, Any]:
        return {"labels": labels, "annotations": {"summary": summary, "description": description}, "startsAt": starts_at}

    def _firing(self, alert: dict[str, Any], now: float) -> dict[str, Any]:
        # endsAt ahead of the next re-posts: Alertmanager keeps it firing while they arrive
        return {**alert, "endsAt": _iso(now + 4 * self.repeat_s)}

    def active(self) -> dict[str, dict[str, Any]]:
        """The alert now firing per run (a copy)."""
        with self._lock:
            return {k: dict(v) for k, v in self._active.items()}

    def _put(self, batch: list[dict[str, Any]]) -> None:
        while True:
            try:
                self._queue.put_nowait(batch)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    # --- delivery ----------------------------------------------------------------------------
    def _loop(self) -> None:
        next_repeat = time.monotonic() + self.repeat_s
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                batch = self._queue.get(timeout=max(0.0, min(0.1, next_repeat - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= next_repeat and not self._stop.is_set():
                    now = time.time()
                    with self._lock:
                        batch = [self._firing(a, now) for a in self._active.values()]
                    next_repeat = time.monotonic() + self.repeat_s
                    if batch:
                        self._deliver(batch)
                continue
            self._deliver(batch)

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        body = json.dumps(batch, allow_nan=False, default=str).encode("utf-8")
        delivered = False
        for url in self.urls:
            delivered |= self._post(url, body)
        if delivered:
            self.sent += 1

    def _post(self, url: str, body: bytes) -> bool:
        delay, tries = self.backoff_s, 0
        for attempt in range(self.retries + 1):
            if attempt:
                if self._stop.wait(delay):  # closing: no more waiting for a dead endpoint
                    break
                delay *= 2
            tries += 1
            target, auth = self._auth[url]
            headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
            req = urllib.request.Request(target + "/api/v2/alerts", data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    resp.read()
                if url in self._down:
                    self._down.discard(url)
                    log.warning("nummon watch: alertmanager %s takes alerts again", safe_url(url))
                return True
            except urllib.error.HTTPError as e:
                if 400 <= e.code < 500 and e.code != 429:  # Alertmanager refuses these alerts: no retry
                    log.warning("nummon watch: alertmanager %s refused %d alert(s): HTTP %d", safe_url(url),
                                body.count(b'"labels"'), e.code)
                    break
            except (urllib.error.URLError, OSError):
                pass
        self.failed += 1
        if url not in self._down:  # every failure is counted; an outage is logged once, and its end
            self._down.add(url)
            log.warning("nummon watch: alertmanager %s: could not deliver %d alert(s) (%d tries); further failures "
                        "are counted, not logged, until it takes alerts again", safe_url(url), body.count(b'"labels"'), tries)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, waiting at most `timeout_s`. Firing alerts are not resolved (the
        incidents are still open): a watcher restarted with its state file re-posts them
        (`run_started`); without re-posts they end at their endsAt."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
