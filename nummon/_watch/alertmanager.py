"""`--notify alertmanager:URL[,URL...]`: incident events as Alertmanager alerts (its v2 API,
``POST /api/v2/alerts``), so Alertmanager does the grouping, silences, inhibition and routing.

One alert per open incident per run (``alertname="NummonIncident"``, labels run, severity,
state, kind, host). Like Prometheus, the target re-posts every active alert each `repeat_s`
seconds with ``endsAt`` a few repeats ahead, so Alertmanager keeps it firing while the watcher
lives, and posts it with ``endsAt`` = now when the incident resolves. An escalation changes the
labels (state, severity): the old alert is resolved and the new one fires. A run whose files
are deleted while watched has its alert ended once (``endsAt`` = now), never re-posted.

Several URLs are the members of an HA cluster: every alert goes to each of them (they
deduplicate among themselves), each from a queue and thread of its own, so a hung member never
delays a live one. Posting has timeouts and retries; a failure is counted (`failed`, per URL
and batch), an outage logged once; a member too slow for the events has its oldest batches
dropped, each counted (`dropped`) and said in the log once per burst with the count. A redirect
is never followed (a POST is not re-sent elsewhere, credentials never leave for another
address): it is a failure, counted and logged. Nothing blocks the watch loop.
``user:password@`` in a URL is sent as HTTP basic auth and never printed. Descriptions use
Slack's mrkdwn (``*bold*``)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import queue
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

from .._core.errors import NummonError
from .._core.redirects import NoRedirect as _NoRedirect
from .._core.text import plural, printable, safe_url
from .._logs import fs
from .notices import Notice
from .output import CLOSE_TIMEOUT_S, HTTP_TIMEOUT_S, WAIT_STEP_S, Target
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
    token = base64.b64encode(
        f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}".encode()
    ).decode()
    return urllib.parse.urlunsplit(p._replace(netloc=netloc)), f"Basic {token}"


_OPENER = urllib.request.build_opener(_NoRedirect())
_BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)


def slack_bold(md: str) -> str:
    """Markdown `**bold**` as Slack mrkdwn `*bold*` (Slack shows the double asterisks)."""
    return _BOLD.sub(r"*\1*", md)


def _utf8(text: str) -> str:
    """A label value that is valid UTF-8: bytes of a non-UTF-8 file name as `\\xNN`."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def alert_labels(d: dict[str, Any], host: str) -> dict[str, str]:
    """The labels of an incident event (its `to_dict()`): the alert's identity in Alertmanager."""
    level = int(d.get("level") or 0)
    contributors = d.get("contributors") or []
    kind = str(contributors[0].get("kind")) if contributors and contributors[0].get("kind") else "unknown"
    return {
        "alertname": ALERTNAME,
        "run": _utf8(str(d.get("run"))),
        "severity": "critical" if level >= 2 else "warning",
        "state": _STATES.get(level, str(d.get("state", "open"))),
        "kind": kind,
        "host": host,
    }


class _Member:
    """One Alertmanager URL with its own bounded queue and thread: a hung member never delays
    another. The oldest batch is dropped when the queue is full (the member is slower than the
    events): each drop counted, the first of a burst logged, and the burst's count logged when
    the member catches up."""

    def __init__(self, owner: AlertmanagerTarget, url: str, queue_size: int, index: int) -> None:
        self.owner, self.url = owner, url
        self.post_url, self.auth = _basic_auth(url)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.down = False  # the last post failed: an outage is logged once, and its end
        self.burst = 0  # batches dropped since the queue last ran dry
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"nummon-alertmanager-{index}", daemon=True)
        self.thread.start()

    def put(self, batch: list[dict[str, Any]]) -> None:
        while True:
            try:
                self.queue.put_nowait(batch)
                return
            except queue.Full:
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    continue
                self.owner._count("dropped")
                with self._lock:
                    self.burst += 1
                    first = self.burst == 1
                if first:
                    log.warning(
                        "nummon watch: alertmanager %s is behind (%d batches queued): dropping the oldest; each "
                        "drop is counted in nummon_notifications_failed_total, the number logged when it catches up",
                        safe_url(self.url),
                        self.queue.maxsize,
                    )

    def burst_over(self) -> None:
        with self._lock:
            n, self.burst = self.burst, 0
        if n:
            log.warning(
                "nummon watch: alertmanager %s: %s dropped while it was behind (the alerts firing now are "
                "re-posted every %gs)",
                safe_url(self.url),
                plural(n, "alert batch", "alert batches"),
                self.owner.repeat_s,
            )

    def _loop(self) -> None:
        stop = self.owner._stop
        while not (stop.is_set() and self.queue.empty()):
            try:
                batch = self.queue.get(timeout=0.1)
            except queue.Empty:
                self.burst_over()
                continue
            body = json.dumps(batch, allow_nan=False, default=str).encode("utf-8")
            self.owner._count("sent" if self.post(body) else "failed")
            if self.queue.empty():
                self.burst_over()

    def post(self, body: bytes) -> bool:
        """One batch to this member, with retries; True when it took it."""
        delay, tries, why = self.owner.backoff_s, 0, ""
        for attempt in range(self.owner.retries + 1):
            if attempt:
                if self.owner._stop.wait(delay):  # closing: no more waiting for a dead endpoint
                    break
                delay *= 2
            tries += 1
            headers = {"Content-Type": "application/json", **({"Authorization": self.auth} if self.auth else {})}
            req = urllib.request.Request(self.post_url + "/api/v2/alerts", data=body, method="POST", headers=headers)
            try:
                with _OPENER.open(req, timeout=self.owner.timeout_s) as resp:
                    resp.read()
                if self.down:
                    self.down = False
                    log.warning("nummon watch: alertmanager %s takes alerts again", safe_url(self.url))
                return True
            except urllib.error.HTTPError as e:
                if 300 <= e.code < 400:  # never followed: the POST and its credentials stay here
                    where = e.headers.get("Location") or "?"
                    log.warning(
                        "nummon watch: alertmanager %s answered HTTP %d (a redirect to %s), not followed: %d "
                        "alert(s) not delivered; fix the URL",
                        safe_url(self.url),
                        e.code,
                        safe_url(where) if "://" in where else "another path",
                        body.count(b'"labels"'),
                    )
                    return False
                if 400 <= e.code < 500 and e.code != 429:  # Alertmanager refuses these alerts: no retry
                    log.warning(
                        "nummon watch: alertmanager %s refused %d alert(s): HTTP %d",
                        safe_url(self.url),
                        body.count(b'"labels"'),
                        e.code,
                    )
                    return False
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                why = type(getattr(e, "reason", e)).__name__
        if not self.down:  # every failure is counted; an outage is logged once, and its end
            self.down = True
            log.warning(
                "nummon watch: alertmanager %s: could not deliver %d alert(s) (%s; %s); further failures "
                "are counted, not logged, until it takes alerts again",
                safe_url(self.url),
                body.count(b'"labels"'),
                why or "stopped",
                plural(tries, "try"),
            )
        return False


class AlertmanagerTarget(Target):
    """Posts incident events to one Alertmanager, or to each member of an HA cluster.
    `sent` counts batches a member took, `failed` batches a member did not take after its
    retries (or answered with a redirect), `dropped` batches pushed out of a member's full
    queue. `timeout_s` per request, `backoff_s` before the first retry (doubling), `repeat_s`
    between re-posts of the firing alerts (seconds)."""

    kind = "alertmanager"

    def __init__(
        self,
        urls: str | list[str],
        timeout_s: float = HTTP_TIMEOUT_S,
        retries: int = 2,
        backoff_s: float = 0.5,
        repeat_s: float = 60.0,
        host: str | None = None,
        queue_size: int = 100,
    ) -> None:
        urls = [u for u in (urls.split(",") if isinstance(urls, str) else urls) if u]
        if not urls:
            raise NummonError("alertmanager: no URL given")
        for u in urls:
            try:
                check_url(u)
            except NummonError as e:
                raise NummonError(f"alertmanager: {e}".replace("webhook URL", "URL")) from None
        self.urls = [u.rstrip("/") for u in urls]
        # printed forms carry scheme and host only; the key names this target in the state file's outbox
        self.shown = "alertmanager " + ", ".join(safe_url(u) for u in self.urls)
        self.key = "alertmanager:" + hashlib.blake2b(",".join(self.urls).encode(), digest_size=6).hexdigest()
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        if not repeat_s > 0:
            raise NummonError(f"alertmanager: repeat interval must be > 0 seconds, got {repeat_s}")
        self.repeat_s = repeat_s
        self.host = host or socket.gethostname()
        self._active: dict[str, dict[str, Any]] = {}  # run -> the alert now firing for it
        self._files: dict[str, list[str]] = {}  # run -> its files (a run whose files are all gone has ended)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sent = self.failed = self.dropped = 0
        self._members = [_Member(self, u, queue_size, i) for i, u in enumerate(self.urls)]
        self._thread = threading.Thread(target=self._tick, name="nummon-alertmanager", daemon=True)
        self._thread.start()

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    # --- events -> alerts ------------------------------------------------------------------
    def failures(self) -> int:
        """Batches not delivered: failed after the retries, or pushed out of a full queue."""
        with self._lock:
            return self.failed + self.dropped

    def on_incident(self, notice: Notice) -> None:
        """Queue the alerts one incident event changes; never waits."""
        d = notice.to_dict()  # the alert is JSON data: its labels and annotations come from the event's
        run = _utf8(str(d.get("run")))
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
                alert = self._alert(
                    labels,
                    str(d.get("title") or notice.title),
                    slack_bold(str(d.get("summary") or "")),
                    old["startsAt"] if old is not None and same else _iso(now),
                )
                self._active[run] = alert
                batch.append(self._firing(alert, now))
        if batch:
            self._put(batch)

    def run_started(self, run: Any, spec: Any) -> None:
        """Watcher hook: a run resumed from the state file with its incident open is firing
        again (same labels, so Alertmanager sees the alert it already holds, not a new one)."""
        with self._lock:
            self._files[printable(run.id)] = list(getattr(spec, "files", None) or [])
        event = run.engine.current_incident(run.last_step or 0)
        if event is None:
            return
        lines = [
            f"run `{printable(run.id)}`: Incident {event.number} (opened at step {event.opened_step}) is still "
            f"*{event.state.value}* (re-posted after the watcher restarted)."
        ]
        lines += [slack_bold(c.line()) for c in event.contributors[:5]]
        d = {
            "run": printable(run.id),
            "level": event.state.rank,
            "contributors": [c.to_dict() for c in event.contributors],
        }
        now = time.time()
        with self._lock:
            if printable(run.id) in self._active:
                return
            alert = self._alert(alert_labels(d, self.host), event.title, "\n".join(lines), _iso(now))
            self._active[printable(run.id)] = alert
            batch = [self._firing(alert, now)]
        self._put(batch)

    def run_retired(self, run_id: str) -> None:
        """Watcher hook: a run no longer followed. An idle run's open incident keeps firing; a
        run whose files are gone has its alert ended now."""
        self._end_deleted([printable(run_id)])  # keyed as the events name runs

    def _end_deleted(self, runs: list[str]) -> None:
        """End, once, the alerts of those `runs` whose files are all gone."""
        with self._lock:
            files = {r: self._files.get(r) for r in runs if r in self._active}
        gone = [r for r, fl in files.items() if fl and all(fs.stat(f) is None for f in fl)]
        if not gone:
            return
        now = time.time()
        with self._lock:
            batch = [{**self._active.pop(r), "endsAt": _iso(now)} for r in gone if r in self._active]
            for r in gone:
                self._files.pop(r, None)
        if batch:
            self._put(batch)

    @staticmethod
    def _alert(labels: dict[str, str], summary: str, description: str, starts_at: str) -> dict[str, Any]:
        return {
            "labels": labels,
            "annotations": {"summary": summary, "description": description},
            "startsAt": starts_at,
        }

    def _firing(self, alert: dict[str, Any], now: float) -> dict[str, Any]:
        # endsAt ahead of the next re-posts: Alertmanager keeps it firing while they arrive
        return {**alert, "endsAt": _iso(now + 4 * self.repeat_s)}

    def active(self) -> dict[str, dict[str, Any]]:
        """The alert now firing per run (a copy)."""
        with self._lock:
            return {k: dict(v) for k, v in self._active.items()}

    def _put(self, batch: list[dict[str, Any]]) -> None:
        for m in self._members:
            m.put(batch)

    # --- re-posting ----------------------------------------------------------------------
    def _tick(self) -> None:
        """Every `repeat_s`: end the alerts of deleted runs, re-post the firing ones to each
        member that has nothing queued (a member that is behind gets the newest state when its
        queue runs dry, rather than a pile of re-posts)."""
        while not self._stop.wait(self.repeat_s):
            with self._lock:
                runs = list(self._active)
            try:
                self._end_deleted(runs)
            except Exception as e:  # a file system that fails must not stop the re-posts
                log.warning("nummon watch: alertmanager: could not check the runs' files (%s: %s)", type(e).__name__, e)
            now = time.time()
            with self._lock:
                batch = [self._firing(a, now) for a in self._active.values()]
            if batch:
                for m in self._members:
                    if m.queue.empty():
                        m.put(batch)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> list[str]:
        """Send what is queued, waiting at most `timeout_s`. Firing alerts are not resolved (the
        incidents are still open): a watcher restarted with its state file re-posts them
        (`run_started`); without re-posts they end at their endsAt."""
        deadline = time.monotonic() + timeout_s
        while any(not m.queue.empty() for m in self._members) and time.monotonic() < deadline:
            time.sleep(WAIT_STEP_S)
        self._stop.set()
        self._thread.join(0.5)
        for m in self._members:
            m.thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
            m.burst_over()
        return []  # batches are not events: what a member did not take is counted in `failed`
