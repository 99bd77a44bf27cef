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

from .._engine import HealthEngine
from .._errors import NummonError
from .._policy import PolicyLike, load_policy
from .._trace import TraceError, record_from_dict
from .._types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, SCALAR_FIELDS, StepRecord
from .fields import clean_alert, clean_event, step_of

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
    events = _event_log(p) if format in (None, "jsonl") else None
    if events is not None:
        run = _from_event_log(events, text, warn)
        run.flight_records = read_flight_records(events.parent, warn)
        if detect or (detect is None and not run.incidents):  # a plain trace: the detectors decide, as in replay
            run.alerts, run.incidents, run.segments = _detect(run.records, policy, warn, text)
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
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            if warn:
                warn(f"{f}: flight record skipped ({type(e).__name__})")
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


def _event_log(p: Path) -> Path | None:
    """The Monitor event log `p` is or holds (None: not a Monitor folder or nummon JSONL)."""
    if p.is_dir():
        if (p / EVENT_LOG).is_file():
            return p / EVENT_LOG
        logs = sorted(p.glob("*.jsonl"))
        return logs[0] if len(logs) == 1 else None
    if p.suffix in (".jsonl", ".ndjson"):
        return p
    return None


def _any_log(folder: Path) -> bool:
    from .._watch.readers import detect_format

    try:
        detect_format(str(folder))
    except NummonError:
        return False
    return True


def _from_event_log(path: Path, source: str, warn: Warn | None) -> RunData:
    """Records, alerts and incident events of one nummon JSONL log. A broken line is skipped
    and named (a report is best effort: the rest of the run is still worth seeing)."""
    run = RunData(source=source, format="jsonl")
    records: list[StepRecord] = []
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise ReportError(f"{path}: cannot read ({e.strerror})") from None
    broken = fields = 0
    with fh:
        for lineno, raw in enumerate(fh, 1):
            raw = raw.strip()
            if not raw:
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError):
                if not records and not run.alerts and lineno <= 1:
                    raise ReportError(f"{path}:{lineno}: not a JSONL log (the first line is not JSON)") from None
                broken += 1
                continue
            if not isinstance(obj, dict):
                continue
            kind = obj.get("type", "step")
            run.typed = run.typed or "type" in obj
            if kind == "step":
                rec = _lean_record(obj, len(records))
                if rec is None:
                    broken += 1
                else:
                    records.append(rec)
            elif kind in ("alert", "incident"):
                item, bad = (clean_alert if kind == "alert" else clean_event)(obj)
                fields += bad
                if item is not None:
                    (run.alerts if kind == "alert" else run.incidents).append(item)
    if broken and warn:
        warn(f"{path}: {broken} unreadable line(s) skipped")
    if fields and warn:
        warn(
            f"{path}: {fields} alert or incident field(s) of the wrong type left out (one without a usable step: skipped)"
        )
    run.records = _in_step_order(records)
    return run


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
    several times faster than the full check of `record_from_dict` (a 100,000-line log at close);
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


_DEFAULTS = {k: v for k, v in StepRecord(step=0).__dict__.items() if not isinstance(v, dict)}
_DICT_FIELDS = tuple(k for k, v in StepRecord(step=0).__dict__.items() if isinstance(v, dict))


def _new_record(values: dict[str, Any]) -> StepRecord:
    """StepRecord(**values) without its per-field __setattr__ (a third of a 100,000-line log's
    load time); the values are already checked, each record gets dicts of its own."""
    rec = object.__new__(StepRecord)
    d = rec.__dict__
    d.update(_DEFAULTS)
    for k in _DICT_FIELDS:
        d[k] = {}
    d.update(values)
    return rec


def _record(obj: dict[str, Any], where: str, default_step: int) -> StepRecord:
    rec = record_from_dict(obj, where, default_step)
    if isinstance(obj.get("headroom_dtype"), str) and rec.headroom_dtype is None:
        rec.headroom_dtype = obj["headroom_dtype"][:40]  # the Monitor's key for it
    return rec


def _replayed(path: str, format: str | None, policy: PolicyLike, warn: Warn | None) -> RunData:
    from .._watch.readers import detect_format, read_records

    fmt = format or detect_format(path)
    records = list(read_records(path, fmt, warn=warn))
    run = RunData(source=path, records=_in_step_order(records), format=fmt)
    run.alerts, run.incidents, run.segments = _detect(records, policy, warn, path)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    if not path.startswith("mlflow:") and folder.is_dir():
        run.flight_records = read_flight_records(folder, warn)
    return run


def _detect(
    records: list[StepRecord], policy: PolicyLike, warn: Warn | None, source: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Alerts and incident events of the detectors over `records` (as `replay` raises them; a
    step that goes backwards starts a new segment)."""
    pol = load_policy(policy)
    engine = HealthEngine(pol)
    alerts: list[dict[str, Any]] = []
    incidents: list[dict[str, Any]] = []
    prev: int | None = None
    segments = 1
    for rec in records:
        if prev is not None and rec.step <= prev:
            segments += 1
            engine = HealthEngine(pol)
        prev = rec.step
        got = engine.step(rec)
        alerts.extend(a.to_dict() for a in got.alerts)
        incidents.extend(e.to_dict() for e in got.incidents)
    if segments > 1 and warn:
        warn(
            f"{source}: the steps go backwards {segments - 1} time(s) (a resumed run): the report draws the last value of each step"
        )
    return alerts, incidents, segments


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
                rec = record_from_dict(r, fr["path"], i)
            except TraceError:
                continue
            seen[rec.step] = rec
    return [seen[s] for s in sorted(seen)]
