"""Webhook notifications: an HTTP POST of Slack-compatible JSON per incident event (Slack mrkdwn
in a section block, a plain-text fallback in ``text``, the event as data under ``nummon``, and
its ``event_id``), from a thread of its own with a bounded queue, timeouts and retries with
backoff, so a slow or dead endpoint never blocks the reading loop. Standard library only.

Delivery is at least once: an event is retried until the endpoint answers 2xx, and a retry (or a
restart from the state file) can deliver it twice; receivers drop duplicates by ``event_id``.
A 4xx answer (other than 429) or a redirect is final and reported: a POST is never re-sent to
another address. Only the scheme and host of the URL are ever printed."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
from collections import deque
from typing import Any, NamedTuple
from urllib.parse import SplitResult, unquote, urlsplit

from .._core.errors import NummonError
from .._core.text import mrkdwn, plural, safe_url
from .._core.text import plain_text as plain
from .notices import Notice
from .output import CLOSE_TIMEOUT_S, HTTP_TIMEOUT_S, WAIT_STEP_S, Outcome, OutcomeHandler, Target

__all__ = ["WebhookTarget", "WebhookStats", "slack_payload", "check_url", "Outcome"]

_TEXT_MAX = 2900  # Slack's section text holds 3000 characters


def check_url(url: str) -> None:
    """NummonError (naming only scheme and host) unless `url` is a usable http(s) URL."""
    shown = safe_url(url)
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise NummonError(f"webhook URL {shown}: contains spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise NummonError(f"webhook URL {shown}: malformed ({e})") from None
    if parts.scheme not in ("http", "https"):
        raise NummonError(f"webhook URL must start with http:// or https://, got {shown}")
    if not parts.hostname:
        raise NummonError(f"webhook URL {shown}: no host")


def slack_payload(notice: Notice, host: str | None = None) -> dict[str, Any]:
    """Slack's incoming-webhook shape (Mattermost, Discord's /slack endpoint and Teams' connectors
    read its ``text``): the title in bold with the run's name and the host, then the summary, and
    the event as data (the one place the notice becomes a dict: the HTTP body)."""
    host = host or socket.gethostname()
    name = notice.name or notice.run
    summary = notice.summary()
    prefix = f"run `{notice.run}`: "
    if summary.startswith(prefix):  # the run is named on the line above
        summary = summary[len(prefix) :]
    where = f"run `{mrkdwn(name)}` on {mrkdwn(host)}" + (f" (`{mrkdwn(notice.run)}`)" if name != notice.run else "")
    rich = f"*{mrkdwn(notice.title)}*\n{where}\n{mrkdwn(summary)}"
    if len(rich) > _TEXT_MAX:
        rich = rich[: _TEXT_MAX - 1] + "…"
    fallback = f"{plain(notice.title)}\n{plain(where)}\n{plain(summary)}"
    d = notice.to_dict()
    return {
        "text": fallback,
        "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": rich}}],
        "event_id": d.get("event_id"),
        "nummon": d,
    }


class WebhookStats(NamedTuple):
    """What became of the events one webhook target accepted, at one moment (counts)."""

    accepted: int
    sent: int
    failed: int
    dropped: int
    queued: int
    in_flight: int
    unsent: int  # stopped mid-retry by close(): kept pending for the next start


class _Refused(Exception):
    """A final answer: no retry."""


class WebhookTarget(Target):
    """POSTs each event; `sent`, `failed` and `dropped` count what happened to them. Outcomes go
    to `on_outcome` (from the webhook's thread) and are kept in `outcomes` otherwise."""

    kind = "webhook"
    asynchronous = True

    def __init__(
        self,
        url: str,
        timeout_s: float = HTTP_TIMEOUT_S,
        retries: int = 3,
        backoff_s: float = 0.5,
        queue_size: int = 100,
        answer_timeout_s: float = 30.0,
        on_outcome: OutcomeHandler | None = None,
    ) -> None:
        check_url(url)
        self.url = url
        self.shown = safe_url(url)  # the one form of the URL that is ever printed
        self.key = "webhook:" + __import__("hashlib").blake2b(url.encode(), digest_size=6).hexdigest()
        self.timeout_s = timeout_s  # to connect and to send the body
        self.answer_timeout_s = answer_timeout_s  # a slow receiver that got the body is waited for
        self.retries = retries
        self.backoff_s = backoff_s
        self.on_outcome = on_outcome
        self.outcomes: list[Outcome] = []
        self._queue_size = max(1, queue_size)
        # One condition guards the queue, the event in flight and the counters, which the watch
        # loop, this target's thread and the metrics scrape thread all read: every change of
        # them is made under it, so `stats()` is always a consistent picture.
        self._cond = threading.Condition()
        self._items: deque[tuple] = deque()
        self._in_flight: str | None = None
        self._unsent: list[str] = []  # stopped mid-retry: pending for the next start
        self._sent = self._failed = self._dropped = self._accepted = 0
        self._stop = threading.Event()
        self._host = socket.gethostname()
        self._thread = threading.Thread(target=self._run, name="nummon-webhook", daemon=True)
        self._thread.start()

    # counters, each read under the lock (a scrape thread reads them while the others write)
    @property
    def sent(self) -> int:
        return self.stats().sent

    @property
    def failed(self) -> int:
        return self.stats().failed

    @property
    def dropped(self) -> int:
        return self.stats().dropped

    def stats(self) -> WebhookStats:
        """One consistent snapshot: accepted = sent + failed + dropped + queued + in flight + unsent."""
        with self._cond:
            return WebhookStats(
                self._accepted,
                self._sent,
                self._failed,
                self._dropped,
                len(self._items),
                0 if self._in_flight is None else 1,
                len(self._unsent),
            )

    def failures(self) -> int:
        """Events not delivered: failed after the retries, or pushed out of the full queue."""
        s = self.stats()
        return s.failed + s.dropped

    def report_outcomes_to(self, handler: OutcomeHandler) -> None:
        self.on_outcome = handler

    def on_incident(self, notice: Notice) -> None:
        """Queue one event; never waits (when the queue is full the oldest event is dropped,
        counted and reported as lost)."""
        body = json.dumps(slack_payload(notice, self._host), allow_nan=False, default=str).encode("utf-8")
        item = (notice.event_id, notice.title, notice.run, body)
        old = None
        with self._cond:
            if len(self._items) >= self._queue_size:
                old = self._items.popleft()
                self._dropped += 1
            self._items.append(item)
            self._accepted += 1
            self._cond.notify_all()
        if old is not None:  # reported outside the lock: the watcher's callback takes its own
            self._report(
                Outcome(old[0], False, "the queue was full (an endpoint slower than the runs)", 0, old[1], old[2])
            )

    def _report(self, outcome: Outcome) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        else:
            self.outcomes.append(outcome)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stop.is_set():
                    self._cond.wait(0.1)
                if self._stop.is_set():
                    return
                item = self._items.popleft()
                self._in_flight = item[0]  # taken and in flight in one step: never counted nowhere
            try:
                outcome = self._post(item)
            except Exception as e:  # never let the thread die: the event is reported, the next one sent
                outcome = Outcome(item[0], False, f"{type(e).__name__}: {e}", 1, item[1], item[2])
            with self._cond:
                if outcome is None:  # stopped mid-retry: the event stays pending for the next start
                    self._unsent.append(item[0])
                elif outcome.ok:
                    self._sent += 1
                else:
                    self._failed += 1
                self._in_flight = None
                self._cond.notify_all()
            if outcome is not None:
                self._report(outcome)

    def _post(self, item: tuple) -> Outcome | None:
        eid, title, run, body = item
        delay = self.backoff_s
        tries = 0
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                if self._stop.wait(delay):  # closing: the event stays pending for the next start
                    return None
                delay *= 2
            tries += 1
            try:
                status = self._send(body, eid)
            except _Refused as e:
                return Outcome(eid, False, str(e), tries, title, run)
            except (OSError, http.client.HTTPException) as e:
                reason = _why(e)
                continue
            if 200 <= status < 300:
                return Outcome(eid, True, "", tries, title, run)
            reason = f"HTTP {status}"
        return Outcome(eid, False, reason, tries, title, run)

    def _send(self, body: bytes, event_id: str) -> int:
        parts = urlsplit(self.url)
        https = parts.scheme == "https"
        host = parts.hostname
        assert host, "check_url refused a URL without a host"
        # the event's stable id (also the body's `event_id`): a receiver drops a repeat by it
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "nummon-watch",
            "X-Nummon-Event-Id": event_id,
            "Idempotency-Key": event_id,
        }
        if parts.username is not None:
            cred = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(cred).decode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        proxy = _proxy_for(parts.scheme, host)
        proxy_host = proxy.hostname if proxy is not None else None  # _proxy_for gives only proxies with a host
        if proxy is None or proxy_host is None:
            conn = _connection(https, host, parts.port, self.timeout_s)
        elif https:  # a CONNECT tunnel through the proxy: TLS end to end
            conn = _connection(True, proxy_host, proxy.port or 8080, self.timeout_s)
            conn.set_tunnel(host, parts.port or 443)
        else:  # a plain-HTTP proxy takes the absolute URL (without the user:password part)
            conn = http.client.HTTPConnection(proxy_host, proxy.port or 8080, timeout=self.timeout_s)
            netloc = host if ":" not in host else f"[{host}]"
            path = f"http://{netloc}{f':{parts.port}' if parts.port else ''}{path}"
        try:
            conn.request("POST", path, body=body, headers=headers)
            if conn.sock is not None:  # the body is sent: wait longer for a slow receiver's answer
                conn.sock.settimeout(self.answer_timeout_s)
            resp = conn.getresponse()
            resp.read(65536)
            status = resp.status
            if 300 <= status < 400:
                where = resp.getheader("Location") or "?"
                raise _Refused(
                    f"HTTP {status} redirect to {safe_url(where) if '://' in where else 'another path'} "
                    f"not followed: a POST is never re-sent elsewhere, fix the URL"
                )
            if 400 <= status < 500 and status != 429:
                raise _Refused(f"HTTP {status} {resp.reason}".strip() + ": the endpoint refuses the message")
            return status
        finally:
            conn.close()

    def pending(self) -> bool:
        with self._cond:
            return bool(self._items) or self._in_flight is not None

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> list[str]:
        """Send what is queued, waiting at most `timeout_s`; the ids of events still not
        delivered then (queued, in flight or stopped mid-retry) are returned: the caller keeps
        them pending."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while (self._items or self._in_flight is not None) and time.monotonic() < deadline:
                self._cond.wait(min(WAIT_STEP_S, max(0.0, deadline - time.monotonic())))
            self._stop.set()
            self._cond.notify_all()
        self._thread.join(0.2)  # a post in progress ends at its timeout; its event is kept below
        with self._cond:
            left = list(self._unsent) + ([self._in_flight] if self._in_flight else []) + [i[0] for i in self._items]
            self._unsent.clear()
            self._items.clear()
        return [e for e in left if e]

    def describe(self, outcome: Outcome) -> str:
        """The failure line of one lost event (no secret, the reason, the event named)."""
        return (
            f'webhook {self.shown}: could not deliver "{outcome.title}" of run {outcome.run} '
            f"({outcome.reason}; {plural(outcome.tries, 'try')})"
        )


def _connection(https: bool, host: str, port: int | None, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to host:port (not yet opened); HTTPS verifies the certificate and the host name."""
    if https:
        return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ssl.create_default_context())
    return http.client.HTTPConnection(host, port, timeout=timeout_s)


def _proxy_for(scheme: str, host: str) -> SplitResult | None:
    """The proxy the environment names for this URL (HTTP(S)_PROXY, NO_PROXY), as urllib would
    pick it, or None."""
    import urllib.request

    url = urllib.request.getproxies().get(scheme)
    if not url or urllib.request.proxy_bypass(host):
        return None
    try:
        p = urlsplit(url if "://" in url else f"http://{url}")
        return p if p.hostname else None
    except ValueError:
        return None


def _why(e: BaseException) -> str:
    if isinstance(e, socket.timeout) or isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return "host not found"
    if isinstance(e, ssl.SSLError):
        return f"TLS error ({e.reason or e})"
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text
