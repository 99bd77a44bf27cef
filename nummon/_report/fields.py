"""The alert and incident-event fields a report reads, type-checked as they come from a log: a
field of the wrong type (a `details` that is a string, a range of strings, a `suspect` that is
not a mapping, a step that is markup) is left out and counted, never drawn and never a crash.

Every kept text is a `str` cut to a bound, every kept number a finite float or an int in range,
so the page can trust what it is given (it still escapes every text it writes)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["clean_alert", "clean_event", "step_of", "MAX_STEP"]

MAX_STEP = 2**53  # steps beyond this are no step a run reached (a float could not even count them)
_TEXT = 2000  # longest text kept from a log

_ALERT_TEXT = ("severity", "kind", "metric", "message", "hint", "location", "flight_record")
_EVENT_TEXT = ("state", "explanation", "hint", "action", "report")
_CAUSE_TEXT = ("cause", "op", "stage", "location", "module", "source", "input_ranges", "remedy")
_DETAIL_TEXT = ("why", "batch_fingerprint", "verdict")
_SUSPECT = ("rank", "host", "device")


def step_of(v: Any) -> int | None:
    """A step read from a log: an integer (or integral float) within ±MAX_STEP; None otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return None
    return int(v) if abs(v) <= MAX_STEP else None


_SKIP = object()  # a value of the right type the report has no use for (an infinite count): left out, not counted


def _float(v: Any) -> float | None:
    """A number of a log (strict JSON writes NaN and Inf as strings); None when it is none."""
    if isinstance(v, str) and len(v) < 40:
        try:
            return float(v)
        except ValueError:
            return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf if v > 0 else -math.inf


def _number(v: Any) -> Any:
    """A finite number; _SKIP for NaN or an infinity, None for anything that is no number."""
    f = _float(v)
    return None if f is None else (f if math.isfinite(f) else _SKIP)


def _text(v: Any) -> str | None:
    return v[:_TEXT] if isinstance(v, str) else None


class _Checker:
    """Copies the fields of the right type; counts the ones left out."""

    def __init__(self) -> None:
        self.bad = 0

    def take(self, src: dict[str, Any], dst: dict[str, Any], key: str, check: Any) -> None:
        if key not in src or src[key] is None:
            return
        v = check(src[key])
        if v is None:
            self.bad += 1
        elif v is not _SKIP:
            dst[key] = v

    def texts(self, src: dict[str, Any], dst: dict[str, Any], keys: tuple[str, ...]) -> None:
        for k in keys:
            self.take(src, dst, k, _text)


def clean_alert(obj: Any) -> tuple[dict[str, Any] | None, int]:
    """(the alert with only the fields the report reads, each of its type; fields left out). None
    when it has no usable step (or is no mapping): such an alert cannot be placed."""
    if not isinstance(obj, dict):
        return None, 1
    step = step_of(obj.get("step"))
    if step is None:
        return None, 1
    c = _Checker()
    out: dict[str, Any] = {"type": "alert", "step": step}
    c.texts(obj, out, _ALERT_TEXT)
    c.take(obj, out, "value", _number)
    c.take(obj, out, "threshold", _number)
    c.take(obj, out, "rank", step_of)
    c.take(obj, out, "cleared", lambda v: v if isinstance(v, bool) else None)
    c.take(obj, out, "details", lambda v: _details(v, c) if isinstance(v, dict) else None)
    return out, c.bad


def _details(d: dict[str, Any], c: _Checker) -> dict[str, Any]:
    out: dict[str, Any] = {}
    c.take(d, out, "steps_to_overflow", _number)
    c.take(d, out, "steps_to_overflow_range", _pair)
    c.take(d, out, "overflow_bound", lambda v: v if isinstance(v, bool) else None)
    c.texts(d, out, _DETAIL_TEXT)
    c.take(d, out, "parts", lambda v: _scalars(v, 16))
    c.take(d, out, "worst_samples", lambda v: _scalars(v, 8))
    # a mapping: the forensic cause of a non-finite value; a text: why recovery acted (not drawn)
    c.take(d, out, "cause", lambda v: _SKIP if isinstance(v, str) else _mapping(v, _CAUSE_TEXT, c))
    c.take(d, out, "suspect", lambda v: _mapping(v, _SUSPECT, c))
    return out


def _pair(v: Any) -> Any:
    if not isinstance(v, list) or len(v) != 2:
        return None
    a, b = _float(v[0]), _float(v[1])
    if a is None or b is None or not a <= b:  # NaN or a reversed range: no range
        return None
    return [a, b] if math.isfinite(a) else _SKIP


def _scalars(v: Any, limit: int) -> list[str] | None:
    """A list of names or numbers, as short texts (the first `limit`)."""
    if not isinstance(v, list):
        return None
    out = [str(x)[:200] for x in v[:limit] if isinstance(x, (str, int, float)) and not isinstance(x, bool)]
    return out if len(out) == len(v[:limit]) else None


def _mapping(v: Any, keys: tuple[str, ...], c: _Checker) -> dict[str, str] | None:
    """The text-or-number fields `keys` of a mapping, as texts."""
    if not isinstance(v, dict):
        return None
    out: dict[str, str] = {}
    for k in keys:
        x = v.get(k)
        if x is None:
            continue
        if isinstance(x, str) or (isinstance(x, (int, float)) and not isinstance(x, bool)):
            out[k] = str(x)[:_TEXT]
        else:
            c.bad += 1
    return out


def clean_event(obj: Any) -> tuple[dict[str, Any] | None, int]:
    """(the incident event with only the fields the report reads; fields left out); None when it
    has no usable step."""
    if not isinstance(obj, dict):
        return None, 1
    step = step_of(obj.get("step"))
    if step is None:
        return None, 1
    c = _Checker()
    out: dict[str, Any] = {"type": "incident", "step": step}
    c.texts(obj, out, _EVENT_TEXT)
    c.take(obj, out, "number", step_of)
    c.take(obj, out, "opened_step", step_of)
    return out, c.bad
