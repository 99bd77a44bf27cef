"""Strict JSON for everything nummon writes: non-finite floats become the strings "NaN",
"Infinity" and "-Infinity", so `jq`, JavaScript's `JSON.parse` and every other parser read the
event log, flight records and reports. This is the one encoding of non-finite numbers: every
`to_dict` uses `json_float` / `json_safe` (nummon's readers also take bare literals and the old
"inf" / "nan" strings, and `null` where an audit report once wrote it)."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_float", "json_safe", "dumps"]


def json_float(v: float | None) -> float | str | None:
    """A float as strict JSON carries it: finite as it is, NaN/Inf as "NaN", "Infinity", "-Infinity"."""
    if v is None:
        return None
    v = float(v)
    if math.isfinite(v):
        return v
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float (at any depth) replaced by its JSON-safe string."""
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return json_safe(obj.tolist())
    if hasattr(obj, "value") and not isinstance(obj, (str, int)):  # enums
        return json_safe(obj.value)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text of `obj` (never a bare NaN or Infinity)."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)
