"""Recorded traces: JSONL, one object per step (plain json, no torch).

Reading is streaming and forgiving at the tail: records come out as their lines are read; a
last line that is not valid JSON (what a full disk or a killed writer leaves) is reported as a
warning and skipped, while a broken line anywhere else is a TraceError naming file:line.
Objects with a ``type`` other than ``"step"`` (nummon's own alert lines) are skipped. Non-finite
numbers are read in both spellings: strict-JSON strings ("NaN", "Infinity", "-Infinity") and the
bare literals Python and Hugging Face write (NaN, Infinity).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Iterator

from ._errors import NummonError
from ._format import clean_text
from ._types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, SCALAR_FIELDS, StepRecord

__all__ = ["TraceError", "WarnFn", "expand_paths", "iter_steps", "read_trace", "record_from_dict"]

_SPECIAL = {"nan": math.nan, "infinity": math.inf, "-infinity": -math.inf, "inf": math.inf, "-inf": -math.inf}

#: Receives one-line warnings (a torn last line, a step that goes backwards).
WarnFn = Callable[[str], None]

_log = logging.getLogger("nummon")


class TraceError(NummonError):
    """A trace file that cannot be read; the message names the file and line."""


class _BrokenLine(Exception):
    """A line that is not a JSON object: fatal in the middle of a file, a warning at its end."""


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
    if isinstance(v, str) and v.strip().lower() in _SPECIAL:
        return _SPECIAL[v.strip().lower()]
    raise TraceError(f"{where}: {key} must be a number, got {_show(v)}")


def _show(v: object, limit: int = 60) -> str:
    """A short, printable repr of a bad value for an error message."""
    text = repr(v)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return clean_text(text)


def _text(v: str, limit: int = 500) -> str:
    return clean_text(v[:limit])


def record_from_dict(obj: dict, where: str, default_step: int) -> StepRecord:
    """A StepRecord from one trace object (unknown keys are ignored)."""
    step = obj.get("step", default_step)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or (isinstance(step, float) and not step.is_integer()):
        raise TraceError(f"{where}: step must be an integer, got {_show(step)}")
    rec = StepRecord(step=int(step))
    for key in SCALAR_FIELDS + MECHANISM_FIELDS:
        if key in obj:
            setattr(rec, key, _number(obj[key], where, key))
    top = obj.get("sample_loss_top")
    if isinstance(top, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in top):
        rec.sample_loss_top = tuple(top[:100])
    for key in ("layer_grad_norms", "layer_activation_max") + MECHANISM_LAYER_FIELDS:
        if isinstance(obj.get(key), dict):
            layers = {_text(str(k), 200): _number(v, where, f"{key}.{_text(str(k), 60)}") for k, v in obj[key].items()}
            setattr(rec, key, {k: v for k, v in layers.items() if v is not None})  # null: not measured
    if isinstance(obj.get("dtype"), str):
        rec.headroom_dtype = _text(obj["dtype"], 40)
    if isinstance(obj.get("nonfinite_location"), str):
        rec.nonfinite_location = _text(obj["nonfinite_location"])
    return rec


def _parse_line(raw: bytes) -> object:
    """One line's JSON value; _BrokenLine with the reason when it is not JSON."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BrokenLine("not UTF-8 text (a binary file, or another encoding?)") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise _BrokenLine(f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise _BrokenLine("not a usable JSON line (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise _BrokenLine(f"not a usable JSON line ({_text(str(e), 80)})") from None


def _open(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"trace not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"trace is a directory: {path}") from None
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None


def iter_steps(path: str | Path, warn: WarnFn | None = None) -> Iterator[tuple[int, StepRecord]]:
    """(line number, record) for each step object of one JSONL trace, in file order.

    A broken last line goes to `warn` (default: the "nummon" logger) and ends the trace; a
    broken line followed by more lines raises TraceError naming file:line, after the records
    before it were yielded."""
    path = Path(path)
    warn = warn or _log.warning
    held: tuple[int, str] | None = None  # a broken line, fatal only if another line follows
    n = 0  # step records so far (the default step of a record without one)
    parsed = 0  # lines that were JSON
    with _open(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            raw = raw.strip()
            if not raw:
                continue
            if held is not None:
                raise TraceError(f"{path}:{held[0]}: {held[1]}")
            try:
                obj = _parse_line(raw)
            except _BrokenLine as e:
                if parsed == 0:  # nothing parsed yet: this is not a trace at all
                    raise TraceError(f"{path}:{lineno}: {e}") from None
                held = (lineno, str(e))
                continue
            parsed += 1
            where = f"{path}:{lineno}"
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            kind = obj.get("type")
            if kind is not None and kind != "step":
                continue  # alert and other event lines of nummon's own log
            yield lineno, record_from_dict(obj, where, n)
            n += 1
    if held is not None:
        warn(f"{path}:{held[0]}: last line ignored, {held[1]} (torn by a full disk or a killed writer?)")


def read_trace(path: str | Path, warn: WarnFn | None = None) -> Iterator[StepRecord]:
    """Step records of one JSONL trace, in file order (see `iter_steps` for the error rules)."""
    for _, rec in iter_steps(path, warn):
        yield rec


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
