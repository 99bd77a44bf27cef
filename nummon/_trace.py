"""Recorded traces: JSONL, one object per step (plain json, no torch)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

from ._errors import NummonError
from ._types import SCALAR_FIELDS, StepRecord

_SPECIAL = {"nan": math.nan, "infinity": math.inf, "-infinity": -math.inf, "inf": math.inf, "-inf": -math.inf}


class TraceError(NummonError):
    """A trace file that cannot be read; the message names the file and line."""


def _number(v, where: str, key: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        raise TraceError(f"{where}: {key} must be a number, got {v!r}")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() in _SPECIAL:
        return _SPECIAL[v.strip().lower()]
    raise TraceError(f"{where}: {key} must be a number, got {v!r}")


def record_from_dict(obj: dict, where: str, default_step: int) -> StepRecord:
    """A StepRecord from one trace object (unknown keys are ignored)."""
    step = obj.get("step", default_step)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or (isinstance(step, float) and not step.is_integer()):
        raise TraceError(f"{where}: step must be an integer, got {step!r}")
    rec = StepRecord(step=int(step))
    for key in SCALAR_FIELDS:
        if key in obj:
            setattr(rec, key, _number(obj[key], where, key))
    for key in ("layer_grad_norms", "layer_activation_max"):
        if isinstance(obj.get(key), dict):
            setattr(rec, key, {str(k): _number(v, where, f"{key}.{k}") for k, v in obj[key].items()})
    if isinstance(obj.get("dtype"), str):
        rec.headroom_dtype = obj["dtype"]
    if isinstance(obj.get("nonfinite_location"), str):
        rec.nonfinite_location = obj["nonfinite_location"]
    return rec


def read_trace(path: Path) -> Iterator[StepRecord]:
    """Records of one JSONL trace, in file order; raises TraceError naming the broken line."""
    try:
        fh = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"trace not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"trace is a directory: {path}") from None
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    with fh:
        n = 0
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield record_from_dict(obj, where, n)
            n += 1


def expand_paths(paths: list[str]) -> list[Path]:
    """Files as given; a directory means every *.jsonl in it (sorted)."""
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise TraceError(f"no *.jsonl traces in directory {path}")
            out.extend(found)
        elif path.exists():
            out.append(path)
        else:
            raise TraceError(f"trace not found: {path}")
    return out
