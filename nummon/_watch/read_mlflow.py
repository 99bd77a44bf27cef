"""MLflow runs, read over the tracking server's REST API (no mlflow import: replay and watch run
without it, as they run without TensorBoard and W&B).

A source is ``mlflow:<tracking-uri>#<run-id>`` for one run. Each poll asks the server for the run's
latest metrics (one small request) and fetches the history only of the metrics that moved, page by
page, resuming at the page that was last read: a live run is never re-read from its start.
Credentials come from MLflow's own variables (``MLFLOW_TRACKING_TOKEN``, or
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``) and never appear in a message.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .._types import StepRecord
from .follow import Follower, NotALogError, as_step
from .keymap import KeyMap

__all__ = ["MLFLOW_PREFIX", "MlflowError", "MlflowFollower", "MlflowServer", "is_mlflow_source", "parse_source"]

MLFLOW_PREFIX = "mlflow:"
#: Rows asked for per history page; a poll reads at most `_PAGES_PER_POLL` pages per metric.
PAGE_ROWS = 1000
_PAGES_PER_POLL = 25
_TIMEOUT_S = 10.0


class MlflowError(NotALogError):
    """The server could not be asked, or said no; the message names the server, never a secret."""


def is_mlflow_source(path: str) -> bool:
    return str(path).startswith(MLFLOW_PREFIX)


def parse_source(source: str) -> tuple[str, str | None, dict[str, str]]:
    """``mlflow:<uri>[?experiment=NAME][#run-id]`` -> (tracking uri, run id or None, query)."""
    rest = source[len(MLFLOW_PREFIX) :]
    rest, _, run_id = rest.partition("#")
    rest, _, query = rest.partition("?")
    uri = rest.rstrip("/")
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise MlflowError(f"{MLFLOW_PREFIX}{safe_uri(uri)}: the tracking URI must be http(s)://host[:port]")
    return uri, (run_id or None), dict(urllib.parse.parse_qsl(query))


def safe_uri(uri: str) -> str:
    """scheme://host[:port]/path, without user, password or query: what a message may show."""
    p = urllib.parse.urlsplit(uri)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return f"{p.scheme}://{host}{p.path}" if p.scheme else "<tracking uri>"


class MlflowServer:
    """A tracking server's REST API: the few calls replay and watch need."""

    def __init__(self, uri: str, timeout_s: float = _TIMEOUT_S) -> None:
        self.uri = uri.rstrip("/")
        self.name = safe_uri(self.uri)
        self.timeout_s = timeout_s

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if token:
            h["Authorization"] = f"Bearer {token}"
        elif user and password:
            h["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return h

    def call(self, method: str, endpoint: str, params: dict[str, Any]) -> dict[str, Any]:
        """One API call (GET with a query, POST with a JSON body); MlflowError on any failure."""
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET":
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        else:
            data = json.dumps(params).encode()
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise MlflowError(f"mlflow:{self.name}: {endpoint} answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError):
            # one wording whatever the socket said (refused, reset, timed out): a watcher says it once
            raise MlflowError(f"mlflow:{self.name}: not reachable") from None
        try:
            out = json.loads(body or b"{}")
        except ValueError:
            raise MlflowError(
                f"mlflow:{self.name}: {endpoint} did not answer JSON (is this an MLflow server?)"
            ) from None
        if not isinstance(out, dict):
            raise MlflowError(f"mlflow:{self.name}: {endpoint} answered {type(out).__name__}, not an object")
        return out

    def latest_metrics(self, run_id: str) -> tuple[dict[str, tuple[int, int]], str]:
        """{metric key: (latest step, latest timestamp ms)} and the run's status (RUNNING, FINISHED...)."""
        try:
            run = self.call("GET", "runs/get", {"run_id": run_id}).get("run") or {}
        except MlflowError as e:
            if "HTTP 404" in str(e) or "HTTP 400" in str(e):
                raise MlflowError(f"mlflow:{self.name}: no run {run_id!r} on this server") from None
            raise
        info, data = run.get("info") or {}, run.get("data") or {}
        out: dict[str, tuple[int, int]] = {}
        for m in data.get("metrics") or []:
            if isinstance(m, dict) and isinstance(m.get("key"), str):
                out[m["key"]] = (as_step(m.get("step", 0)) or 0, as_step(m.get("timestamp", 0)) or 0)
        return out, str(info.get("status") or "")

    def history_page(self, run_id: str, key: str, page_token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of a metric's history (oldest first) and the token of the next page, if any."""
        got = self.call(
            "GET",
            "metrics/get-history",
            {"run_id": run_id, "metric_key": key, "max_results": PAGE_ROWS, "page_token": page_token},
        )
        rows = [m for m in got.get("metrics") or [] if isinstance(m, dict)]
        return rows, got.get("next_page_token") or None

    def search_runs(self, experiment: str | None, max_results: int = 1000) -> list[dict[str, Any]]:
        """The active (RUNNING) runs of one experiment (by name) or of every experiment."""
        if experiment is not None:
            got = self.call("GET", "experiments/get-by-name", {"experiment_name": experiment})
            ids = [str((got.get("experiment") or {}).get("experiment_id"))]
        else:
            exps = self.call("POST", "experiments/search", {"max_results": 1000}).get("experiments") or []
            ids = [str(e.get("experiment_id")) for e in exps if isinstance(e, dict)]
        if not ids:
            return []
        got = self.call(
            "POST",
            "runs/search",
            {"experiment_ids": ids, "filter": "attributes.status = 'RUNNING'", "max_results": max_results},
        )
        return [r.get("info") or {} for r in got.get("runs") or [] if isinstance(r, dict)]


class _History:
    """Where one metric's history was read to: the token of the last page read (None: the first)
    and how many of that page's rows were taken. The last page is asked for again next time, so
    at most one page is re-read."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.taken = 0
        self.seen: tuple[int, int] | None = None  # (step, timestamp) of the latest value read


class MlflowFollower(Follower):
    """One MLflow run's metrics, incrementally. Rows of every mapped metric are merged by step;
    the newest step is held back until a poll brings nothing new for it (or `final`)."""

    format = "mlflow"

    def __init__(self, path: str, keymap: KeyMap | None = None) -> None:
        super().__init__(path, keymap)
        uri, run_id, _ = parse_source(path)
        if run_id is None:
            raise MlflowError(f"{MLFLOW_PREFIX}{safe_uri(uri)}: name a run: {MLFLOW_PREFIX}<tracking-uri>#<run-id>")
        self.server = MlflowServer(uri)
        self.run_id = run_id
        self.status = ""
        self._hist: dict[str, _History] = {}
        self._pending: dict[int, dict[str, Any]] = {}  # step -> row, not yet emitted
        self._emitted: int | None = None  # the last step emitted

    def poll(self, final: bool = False) -> list[StepRecord]:
        self.more = False
        latest, self.status = self.server.latest_metrics(self.run_id)
        fresh = False
        for key, seen in latest.items():
            if self.keymap.field(key) is None:
                continue
            h = self._hist.setdefault(key, _History())
            if h.seen == seen:
                continue  # this metric has not moved since the last poll
            fresh |= self._read(key, h)
            if not self.more:
                h.seen = seen
        ready = sorted(self._pending)
        if not final and not self.more and ready and fresh:
            ready = ready[:-1]  # the newest step may still be written: wait for one quiet poll
        out: list[StepRecord] = []
        for step in ready:
            row = self._pending.pop(step)
            rec = self.record(step, row)
            if rec is not None:
                out.append(rec)
            self._emitted = step
        return out

    def _read(self, key: str, h: _History) -> bool:
        """Read the metric's new rows into the pending steps; True when any row was new."""
        new = False
        for _ in range(_PAGES_PER_POLL):
            rows, nxt = self.server.history_page(self.run_id, key, h.token)
            for m in rows[h.taken :]:
                step = as_step(m.get("step", 0))
                if step is None or (self._emitted is not None and step <= self._emitted):
                    continue  # a late value for a step already judged: the detectors moved on
                self._pending.setdefault(step, {})[key] = m.get("value")
                new = True
            if nxt is None:
                h.taken = len(rows)
                return new
            h.token, h.taken = nxt, 0
        self.more = True  # a long backlog: the rest on the next poll
        return new

    def position(self) -> dict[str, Any]:
        return {
            "emitted": self._emitted,
            "history": {k: {"token": h.token, "taken": h.taken} for k, h in self._hist.items()},
        }

    def restore(self, pos: dict[str, Any]) -> None:
        pos = pos if isinstance(pos, dict) else {}
        self._emitted = as_step(pos.get("emitted"))
        for key, d in (pos.get("history") or {}).items():
            if isinstance(d, dict):
                h = self._hist.setdefault(str(key), _History())
                h.token = d.get("token") if isinstance(d.get("token"), str) else None
                h.taken = as_step(d.get("taken")) or 0
