"""One step record from a plain dict (a JSONL line, a saved engine's history): the inverse of
`StepRecord.to_dict`. Unknown keys are ignored; a value of the wrong type is a TraceError naming
where it was read."""

from __future__ import annotations

import math
from typing import Any

from .errors import TraceError
from .text import clean_text

__all__ = ["NONFINITE_WORDS", "record_fields"]

#: The words logs use for non-finite numbers (lower-cased), and their values: one map for replay and watch.
NONFINITE_WORDS = {"nan": math.nan, "infinity": math.inf, "-infinity": -math.inf, "inf": math.inf, "-inf": -math.inf}


def _number(v, where: str, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise TraceError(f"{where}: {key} must be a number, got {_show(v)}")
    if isinstance(v, float):
        return v
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:  # an integer beyond float's range is an infinite value
            return math.inf if v > 0 else -math.inf
    if isinstance(v, str) and v.strip().lower() in NONFINITE_WORDS:
        return NONFINITE_WORDS[v.strip().lower()]
    raise TraceError(f"{where}: {key} must be a number, got {_show(v)}")


def _show(v: object, limit: int = 60) -> str:
    """A short, printable repr of a bad value for an error message."""
    text = repr(v)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return clean_text(text)


def _text(v: str, limit: int = 500) -> str:
    return clean_text(v[:limit])


def record_fields(
    obj: dict, where: str, default_step: int, scalars: tuple[str, ...], layers: tuple[str, ...]
) -> dict[str, Any]:
    """The StepRecord fields one trace object holds (unknown keys are ignored): `StepRecord.from_dict`
    passes its field names (`scalars`, per-layer `layers`), so this module needs no record type."""
    step = obj.get("step", default_step)
    if (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or (isinstance(step, float) and not step.is_integer())
    ):
        raise TraceError(f"{where}: step must be an integer, got {_show(step)}")
    rec: dict[str, Any] = {"step": int(step)}
    for key in scalars:
        if key in obj:
            rec[key] = _number(obj[key], where, key)
    top = obj.get("sample_loss_top")
    if isinstance(top, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in top):
        rec["sample_loss_top"] = tuple(top[:100])
    for key in layers:
        if isinstance(obj.get(key), dict):
            values = {_text(str(k), 200): _number(v, where, f"{key}.{_text(str(k), 60)}") for k, v in obj[key].items()}
            rec[key] = {k: v for k, v in values.items() if v is not None}  # null: not measured
    if isinstance(obj.get("dtype"), str):
        rec["headroom_dtype"] = _text(obj["dtype"], 40)
    if isinstance(obj.get("nonfinite_location"), str):
        rec["nonfinite_location"] = _text(obj["nonfinite_location"])
    return rec
