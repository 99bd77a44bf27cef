"""MLflow runs, read over the tracking server's REST API (no mlflow import: replay and watch run
without it, as they run without TensorBoard and W&B).

A source is ``mlflow:<tracking-uri>#<run-id>`` for one run. Each poll asks the server for the run's
latest metrics (one small request) and fetches the history only of the metrics that moved, page by
page, resuming at the page that was last read: a live run is never re-read from its start.
Credentials come from MLflow's own variables (``MLFLOW_TRACKING_TOKEN``, or
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``), never appear in a message and never
leave the tracking URI's origin (a redirect elsewhere is not followed). Every request has a total
deadline and a cap on the bytes of its answer; a history whose page tokens repeat is not read
further. MLflow's +-max double (its +-inf) and values beyond float's range read as +-inf, and
nummon's ``nummon/nonfinite/<stat>`` markers as the value they mark.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .._core.deadline import Deadline
from .._core.redirects import origin
from .._core.types import StepRecord
from .follow import Follower, NotALogError, as_step
from .keymap import KeyMap

__all__ = [
    "MLFLOW_PREFIX",
    "NONFINITE_PREFIX",
    "MlflowError",
    "MlflowFollower",
    "MlflowServer",
    "is_mlflow_source",
    "nonfinite_marker",
    "parse_source",
    "value_of",
]

MLFLOW_PREFIX = "mlflow:"
#: Rows asked for per history page; a poll reads at most `_PAGES_PER_POLL` pages per metric.
PAGE_ROWS = 1000
_PAGES_PER_POLL = 25
_TIMEOUT_S = 10.0
#: A request's whole time, however slowly the server sends its bytes.
_DEADLINE_S = 30.0
#: What one answer may hold: a page of `PAGE_ROWS` values is well under 1 MB.
_MAX_BODY = 32 << 20
_CHUNK = 1 << 16
_MAX_REDIRECTS = 5
#: Pages read of one metric's history in all: 10 million values. A server whose page tokens
#: never end (a gateway that drops ``page_token`` and answers the first page again) is stopped
#: by the repeated token at once, and by this bound whatever its tokens.
_MAX_PAGES = 10_000
#: MLflow stores +-inf as +-max double (1.7976931348623157e308): at or beyond this, an overflow.
_MAX_DOUBLE = 1.79e308
#: nummon's marker series: ``nummon/nonfinite/<stat>`` at a step where ``nummon/<stat>`` was
#: NaN (1), +inf (2) or -inf (-2); the stat's own series holds finite values only.
NONFINITE_PREFIX = "nummon/nonfinite/"
_NONFINITE_CODES = {1: math.nan, 2: math.inf, -2: -math.inf}


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


def _json_int(text: str) -> int | float:
    """A JSON integer: Python's int up to 19 digits, a float beyond (1e400 is +inf, never an
    int too large for float or for int()'s digit limit)."""
    return int(text) if len(text.lstrip("-")) <= 19 else float(text)


def value_of(v: Any) -> Any:
    """A metric value as the detectors must see it: MLflow's +-max double (how it stores +-inf)
    and numbers beyond float's range are +-inf; anything that is no number is passed on."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return v
    try:
        f = float(v)
    except OverflowError:  # an int beyond float's range
        return math.inf if v > 0 else -math.inf  # type: ignore[operator]
    except ValueError:
        return v
    return math.copysign(math.inf, f) if abs(f) >= _MAX_DOUBLE else f


def nonfinite_marker(key: str) -> str:
    """The marker series of a ``nummon/`` metric: nummon/loss -> nummon/nonfinite/loss."""
    return NONFINITE_PREFIX + key[len("nummon/") :]


class MlflowServer:
    """A tracking server's REST API: the few calls replay and watch need."""

    def __init__(self, uri: str, timeout_s: float = _TIMEOUT_S, deadline_s: float = _DEADLINE_S) -> None:
        self.uri = uri.rstrip("/")
        self.name = safe_uri(self.uri)
        self.timeout_s = timeout_s  # per read
        self.deadline_s = deadline_s  # per request, in all (connecting, redirects and every read)

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
        """One API call (GET with a query, POST with a JSON body) within `deadline_s` in all;
        MlflowError on any failure. A redirect is followed within the tracking URI's origin only:
        credentials never go to another scheme, host or port."""
        url = f"{self.uri}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET":
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        else:
            data = json.dumps(params).encode()
        deadline = Deadline(self.deadline_s)
        try:
            for _ in range(_MAX_REDIRECTS + 1):
                req = urllib.request.Request(url, data=data, method=method, headers=self._headers())
                try:
                    return self._parse(endpoint, self._fetch(req, endpoint, deadline))
                except urllib.error.HTTPError as e:
                    url = self._redirected(endpoint, e, url)
            raise MlflowError(f"mlflow:{self.name}: {endpoint} redirected more than {_MAX_REDIRECTS} times")
        finally:
            deadline.cancel()

    def _fetch(self, req: urllib.request.Request, endpoint: str, deadline: Deadline) -> bytes:
        """The body of one answer, read in chunks of at most `_MAX_BODY` bytes in all, before
        the deadline (a server trickling bytes cannot hold the caller)."""
        try:
            with deadline.opener().open(req, timeout=max(0.001, min(self.timeout_s, deadline.left()))) as resp:
                length = resp.headers.get("Content-Length")
                if length and length.strip().isdigit() and int(length) > _MAX_BODY:
                    raise self._too_big(endpoint)
                chunks, size = [], 0
                while chunk := resp.read(_CHUNK):
                    size += len(chunk)
                    if size > _MAX_BODY:
                        raise self._too_big(endpoint)
                    if deadline.left() <= 0:
                        raise TimeoutError
                    chunks.append(chunk)
                return b"".join(chunks)
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            if deadline.expired or deadline.left() <= 0:
                raise MlflowError(
                    f"mlflow:{self.name}: {endpoint} did not answer within {self.deadline_s:g} s"
                ) from None
            # one wording whatever the socket said (refused, reset, timed out): a watcher says it once
            raise MlflowError(f"mlflow:{self.name}: not reachable") from None

    def _too_big(self, endpoint: str) -> MlflowError:
        return MlflowError(
            f"mlflow:{self.name}: {endpoint} answered more than {_MAX_BODY >> 20} MB: not read "
            f"(nummon asks for at most {PAGE_ROWS} values a page, far less)"
        )

    def _redirected(self, endpoint: str, e: urllib.error.HTTPError, url: str) -> str:
        """Where a redirect leads, when it stays within the tracking URI's origin; MlflowError
        for any other HTTP error, and for a redirect to another origin (never followed)."""
        e.close()
        where = e.headers.get("Location") if 300 <= e.code < 400 and e.headers is not None else None
        if not where:
            raise MlflowError(f"mlflow:{self.name}: {endpoint} answered HTTP {e.code}") from None
        target = urllib.parse.urljoin(url, where)
        if origin(target) != origin(self.uri):
            raise MlflowError(
                f"mlflow:{self.name}: {endpoint} answered HTTP {e.code}, a redirect to {safe_uri(target)} "
                "(another origin): not followed, so that credentials stay with the tracking URI; "
                "name that server in the source if it is the tracking server"
            ) from None
        return target

    def _parse(self, endpoint: str, body: bytes) -> dict[str, Any]:
        try:
            out = json.loads(body or b"{}", parse_int=_json_int)
        except (ValueError, RecursionError):
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
        self.pages = 0  # pages read in all
        self.tokens: set[str] = set()  # every page token met: one met twice never ends


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
            if self._series(key) is None:
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

    def _series(self, key: str) -> str | None:
        """The mapped metric a key feeds: itself, or for a marker (``nummon/nonfinite/loss``)
        the metric it marks; None when neither is mapped."""
        if key.startswith(NONFINITE_PREFIX):
            base = "nummon/" + key[len(NONFINITE_PREFIX) :]
            return base if self.keymap.field(base) is not None else None
        return key if self.keymap.field(key) is not None else None

    def _read(self, key: str, h: _History) -> bool:
        """Read the metric's new rows into the pending steps; True when any row was new."""
        new = False
        base = self._series(key) or key
        for _ in range(_PAGES_PER_POLL):
            rows, nxt = self.server.history_page(self.run_id, key, h.token)
            h.pages += 1
            for m in rows[h.taken :]:
                step = as_step(m.get("step", 0))
                if step is None or (self._emitted is not None and step <= self._emitted):
                    continue  # a late value for a step already judged: the detectors moved on
                row = self._pending.setdefault(step, {})
                if base != key:  # a marker: the metric was non-finite at this step
                    row[base] = _NONFINITE_CODES.get(as_step(value_of(m.get("value"))) or 1, math.nan)
                elif not (isinstance(row.get(base), float) and not math.isfinite(row[base])):
                    row[base] = value_of(m.get("value"))
                new = True
            if nxt is None:
                h.taken = len(rows)
                return new
            self._check_token(key, h, str(nxt))
            h.token, h.taken = str(nxt), 0
        self.more = True  # a long backlog: the rest on the next poll
        return new

    def _check_token(self, key: str, h: _History, token: str) -> None:
        """A page token met before, or a history past `_MAX_PAGES`, is a history that never ends."""
        if token in h.tokens or token == h.token:
            raise MlflowError(
                f"mlflow:{self.server.name}: the history of {key!r} gave the same page token twice "
                "(is a proxy dropping page_token?): not read further"
            )
        if h.pages >= _MAX_PAGES:
            raise MlflowError(
                f"mlflow:{self.server.name}: the history of {key!r} passed {_MAX_PAGES:,} pages "
                f"({_MAX_PAGES * PAGE_ROWS:,} values): not read further"
            )
        h.tokens.add(token)

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
