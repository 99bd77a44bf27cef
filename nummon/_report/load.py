"""What a report is made of: the step records, alerts and incident events of one run, and its
flight records, read from a Monitor run folder or from any log `replay` reads (no torch).

A Monitor's event log (`events.jsonl`: typed `step` / `alert` / `incident` lines) carries the
alerts and incident events as they were raised live (with the forensic cause of the first
non-finite value); any other log is run through the same detectors as `replay` to get them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._core.errors import NummonError, TraceError
from .._core.text import printable
from .._core.types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, SCALAR_FIELDS, StepRecord
from .._engine.engine import HealthEngine
from .._logs.trace import open_log
from .._policy.policy import PolicyLike, load_policy
from .fields import clean_alert, clean_event, step_of
from .stream import Collector, _new_record

__all__ = ["RunData", "ReportError", "load_run", "from_monitor", "FLIGHT_GLOB", "EVENT_LOG"]

FLIGHT_GLOB = "nummon-flight-record*.json"
EVENT_LOG = "events.jsonl"
_MAX_FLIGHT_RECORDS = 16  # a run that rolled back many times: the first ones tell the story

Warn = Callable[[str], None]


class ReportError(NummonError):
    """The path is not something a report can be made of (the message names it)."""


@dataclass
class RunData:
    """One run, as plain data: records in step order, alerts and incident events as dicts."""

    source: str
    records: list[StepRecord] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    flight_records: list[dict[str, Any]] = field(default_factory=list)  # {"path", "alert", "records"}
    format: str = "jsonl"
    typed: bool = False  # a Monitor's event log (typed lines): its alerts and incident events are the run's own
    segments: int = 1  # > 1: the steps went backwards (a resumed run appended to the log)
    total: int = 0  # steps in the log, when `records` holds only what a page draws of a long one

    @property
    def n_records(self) -> int:
        """How many steps the run logged (not only those kept to draw)."""
        return max(self.total, len(self.records))


def load_run(
    path: str | os.PathLike[str],
    format: str | None = None,
    policy: PolicyLike = None,
    warn: Warn | None = None,
    detect: bool | None = None,
) -> RunData:
    """The run at `path`: a Monitor run folder or event log, or any log `replay` reads
    (`format` forces one). ReportError (a NummonError naming the path) when it is none.
    `detect`: run the detectors over a nummon JSONL log (None: when it holds no incident
    event; a live Monitor, which knows its log holds every alert, passes False)."""
    text = os.fspath(path)
    if text.startswith("mlflow:"):
        return _replayed(text, format or "mlflow", policy, warn)
    p = Path(text)
    if not p.exists():
        raise ReportError(f"{text}: not found")
    events = _event_log(p, format)
    if events is not None:
        run = _from_event_log(events, text, warn, detect, policy)
        run.flight_records = read_flight_records(events.parent, warn)
        return run
    if p.is_dir() and format is None and any(p.glob(FLIGHT_GLOB)) and not _any_log(p):
        run = RunData(source=text, flight_records=read_flight_records(p, warn))
        run.records = _flight_steps(run.flight_records)
        run.alerts = [fr["alert"] for fr in run.flight_records if isinstance(fr.get("alert"), dict)]
        _, run.incidents, _ = _detect(run.records, policy, warn, text)
        return run
    return _replayed(text, format, policy, warn)


def from_monitor(
    source: str,
    records: Iterable[dict[str, Any]],
    alerts: Iterable[dict[str, Any]],
    incidents: Iterable[dict[str, Any]],
    flight_records: list[dict[str, Any]],
) -> RunData:
    """A run from a Monitor's memory (its flight recorder's records, alerts, incident events),
    for a run folder with no event log."""
    recs = [_record(r, source, i) for i, r in enumerate(records)]
    return RunData(
        source=source,
        records=_in_step_order(recs),
        alerts=[a for a in map(_first, map(clean_alert, alerts)) if a is not None],
        incidents=[e for e in map(_first, map(clean_event, incidents)) if e is not None],
        flight_records=flight_records,
    )


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _first(pair: tuple[Any, int]) -> Any:
    return pair[0]


def read_flight_records(folder: Path, warn: Warn | None = None) -> list[dict[str, Any]]:
    """The flight records in `folder` (oldest step first); unreadable ones are named to `warn`."""
    out = []
    for f in sorted(folder.glob(FLIGHT_GLOB), key=_flight_order)[:_MAX_FLIGHT_RECORDS]:
        try:  # through the readers' guard: a FIFO or device named like a flight record is never read
            with open_log(f) as fh:
                data = json.loads(b"".join(fh).decode("utf-8"))
        except TraceError as e:
            if warn:
                warn(f"{printable(str(f))}: flight record skipped ({str(e).rsplit(': ', 1)[-1]})")
            continue
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            if warn:
                warn(f"{printable(str(f))}: flight record skipped ({type(e).__name__})")
            continue
        if isinstance(data, dict):
            out.append(
                {
                    "path": str(f),
                    "alert": clean_alert(data.get("alert"))[0],
                    "records": [r for r in _list(data.get("records")) if isinstance(r, dict)],
                }
            )
    return out


def _flight_order(f: Path) -> tuple[int, str]:
    digits = "".join(ch for ch in f.stem.rsplit("step", 1)[-1] if ch.isdigit())
    return (int(digits) if digits else 0, f.name)


def _event_log(p: Path, format: str | None) -> Path | None:
    """The Monitor event log `p` is or holds (None: not a Monitor folder or nummon JSONL): a
    JSONL file, or of the logs `find_runs` names in a folder, its events.jsonl or its only JSONL log."""
    from .._logs.discovery import find_runs

    if format not in (None, "jsonl"):
        return None
    if not p.is_dir():
        return p if p.suffix in (".jsonl", ".ndjson") else None
    runs, _ = find_runs([str(p)], format)
    logs = [Path(run.id) for run in runs if run.format == "jsonl" and run.id != str(p)]
    own = [log for log in logs if log.name == EVENT_LOG and log.is_file()]
    return own[0] if own else logs[0] if len(logs) == 1 else None


def _any_log(folder: Path) -> bool:
    from .._logs.readers import detect_format

    try:
        detect_format(str(folder))
    except NummonError:
        return False
    return True


def _from_event_log(
    path: Path, source: str, warn: Warn | None, detect: bool | None = None, policy: PolicyLike = None
) -> RunData:
    """Alerts and incident events of one nummon JSONL log, and what a page draws of its records
    (read as a stream: memory bounded whatever the log's length). A broken line is skipped and
    named (a report is best effort: the rest of the run is still worth seeing). The detectors
    run over the records when `detect`, or (None) until the log shows incident events of its own."""
    run = RunData(source=source, format="jsonl")
    col = Collector()
    det = _Detector(policy) if detect is not False else None
    try:  # the readers' guard: a FIFO or device is refused, a read error (EIO) is one line
        fh = open_log(path)
    except TraceError as e:
        raise ReportError(str(e)) from None
    broken = fields = 0
    with fh:
        for lineno, raw in enumerate(fh, 1):
            obj = _line(raw, lineno, path, col.count == 0 and not run.alerts)
            if obj is None:
                broken += raw.strip() != b""
                continue
            if not isinstance(obj, dict):
                continue
            kind = obj.get("type", "step")
            run.typed = run.typed or "type" in obj
            if kind == "step":
                rec = _lean_record(obj, col.count)
                if rec is None:
                    broken += 1
                    continue
                _feed(col, det, rec)
            elif kind in ("alert", "incident"):
                item, bad = (clean_alert if kind == "alert" else clean_event)(obj)
                fields += bad
                if item is None:
                    continue
                if kind == "incident" and not detect and det is not None:
                    det = None  # the log holds its own incident events: they are the run's
                    col.forget()
                if kind == "incident":
                    run.incidents.append(item)
                elif _loud(item):  # info alerts and clearances are never drawn: not kept
                    run.alerts.append(item)
                if kind == "alert":
                    col.mark(item["step"])
                else:
                    col.state(item.get("state", ""))
    _warn_skipped(path, broken, fields, warn)
    if det is not None and (detect or not run.incidents):  # a plain trace: the detectors decide, as in replay
        run.alerts, run.incidents, run.segments = det.finish(warn, source)
    run.records, run.total = col.records(), col.count
    return run


def _loud(alert: dict[str, Any]) -> bool:
    return alert.get("severity") in ("warning", "critical") and not alert.get("cleared")


def _line(raw: bytes, lineno: int, path: Path, first: bool) -> Any:
    """The JSON value of one line (None: blank or broken); ReportError when the first line is no JSON."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        if first and lineno <= 1:
            raise ReportError(f"{path}:{lineno}: not a JSONL log (the first line is not JSON)") from None
        return None


def _feed(col: Collector, det: _Detector | None, rec: StepRecord) -> None:
    """One record to the collector, after the detectors (their incident states keep it near)."""
    alerted = False
    if det is not None:
        for state in det.step(rec):
            col.state(state)
        alerted = det.alerted
    col.add(rec, alerted)


def _warn_skipped(path: Path, broken: int, fields: int, warn: Warn | None) -> None:
    if broken and warn:
        warn(f"{path}: {broken} unreadable line(s) skipped")
    if fields and warn:
        warn(
            f"{path}: {fields} alert or incident field(s) of the wrong type left out (one without a usable step: skipped)"
        )


_FIELDS = frozenset(SCALAR_FIELDS + MECHANISM_FIELDS)
_LAYER_FIELDS = ("layer_grad_norms", "layer_activation_max") + MECHANISM_LAYER_FIELDS


def _num(v: Any) -> float | None:
    """A number of a JSONL line (strict JSON writes NaN/Inf as strings; an integer too large for
    a float is an overflow, as replay reads it); None for anything else."""
    if isinstance(v, float):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    if isinstance(v, str) and len(v) < 40:
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _lean_record(obj: dict[str, Any], default_step: int) -> StepRecord | None:
    """A StepRecord of the values a report draws, read leniently (a bad value is left out) and
    several times faster than the full check of `StepRecord.from_dict` (a 100,000-line log at close);
    None when the line has no usable step."""
    step = step_of(obj.get("step", default_step))
    if step is None:
        return None
    kw: dict[str, Any] = {}
    for k in _FIELDS.intersection(obj):
        v = _num(obj[k])
        if v is not None:
            kw[k] = v
    for k in _LAYER_FIELDS:
        d = obj.get(k)
        if isinstance(d, dict) and d:
            kw[k] = {str(name)[:200]: f for name, v in d.items() if (f := _num(v)) is not None}
    for k, limit in (("nonfinite_location", 500), ("headroom_dtype", 40)):
        if isinstance(obj.get(k), str):
            kw[k] = obj[k][:limit]
    if isinstance(obj.get("nonfinite_parts"), list):
        kw["nonfinite_parts"] = tuple(str(p)[:40] for p in obj["nonfinite_parts"][:16])
    if "nonfinite_count" in kw:
        kw["nonfinite_count"] = int(kw["nonfinite_count"]) if math.isfinite(kw["nonfinite_count"]) else None
    kw["step"] = step
    return _new_record(kw)


def _record(obj: dict[str, Any], where: str, default_step: int) -> StepRecord:
    rec = StepRecord.from_dict(obj, where, default_step)
    if isinstance(obj.get("headroom_dtype"), str) and rec.headroom_dtype is None:
        rec.headroom_dtype = obj["headroom_dtype"][:40]  # the Monitor's key for it
    return rec


def _replayed(path: str, format: str | None, policy: PolicyLike, warn: Warn | None) -> RunData:
    from .._logs.readers import detect_format, read_records

    fmt = format or detect_format(path)
    col, det = Collector(), _Detector(policy)
    for rec in read_records(path, fmt, warn=warn):
        _feed(col, det, rec)
    run = RunData(source=path, records=col.records(), format=fmt, total=col.count)
    run.alerts, run.incidents, run.segments = det.finish(warn, path)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    if not path.startswith("mlflow:") and folder.is_dir():
        run.flight_records = read_flight_records(folder, warn)
    return run


class _Detector:
    """The detectors over a stream of records, as `replay` runs them (a step that goes
    backwards starts a new segment); alerts and incident events kept as dicts."""

    def __init__(self, policy: PolicyLike) -> None:
        self.policy = load_policy(policy)
        self.engine = HealthEngine(self.policy)
        self.alerts: list[dict[str, Any]] = []
        self.incidents: list[dict[str, Any]] = []
        self.prev: int | None = None
        self.segments = 1
        self.alerted = False  # the last record raised an alert

    def step(self, rec: StepRecord) -> list[str]:
        """The incident states the record brought."""
        if self.prev is not None and rec.step <= self.prev:
            self.segments += 1
            self.engine = HealthEngine(self.policy)
        self.prev = rec.step
        got = self.engine.step(rec)
        self.alerts.extend(a.to_dict() for a in got.alerts)
        self.incidents.extend(e.to_dict() for e in got.incidents)
        self.alerted = bool(got.alerts)
        return [e.state.value for e in got.incidents]

    def finish(self, warn: Warn | None, source: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        if self.segments > 1 and warn:
            warn(
                f"{source}: the steps go backwards {self.segments - 1} time(s) (a resumed run): "
                "the report draws the last value of each step"
            )
        return self.alerts, self.incidents, self.segments


def _detect(
    records: list[StepRecord], policy: PolicyLike, warn: Warn | None, source: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Alerts and incident events of the detectors over `records` (as `replay` raises them)."""
    det = _Detector(policy)
    for rec in records:
        det.step(rec)
    return det.finish(warn, source)


def _in_step_order(records: list[StepRecord]) -> list[StepRecord]:
    """One record per step, in step order; a step written again (a resumed run) keeps its last."""
    by_step: dict[int, StepRecord] = {}
    for r in records:
        by_step[r.step] = r
    if all(records[i].step < records[i + 1].step for i in range(len(records) - 1)):
        return list(records)
    return [by_step[s] for s in sorted(by_step)]


def _flight_steps(flight_records: list[dict[str, Any]]) -> list[StepRecord]:
    seen: dict[int, StepRecord] = {}
    for fr in flight_records:
        for i, r in enumerate(fr["records"]):
            try:
                rec = StepRecord.from_dict(r, fr["path"], i)
            except TraceError:
                continue
            seen[rec.step] = rec
    return [seen[s] for s in sorted(seen)]
