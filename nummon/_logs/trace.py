"""Recorded traces: JSONL, one object per step (plain json, no torch).

One rule for every JSONL line, shared by `nummon replay` and the watcher (`parse_step_line`): a
step object becomes a record; an empty line or an object whose ``type`` is not ``"step"``
(nummon's own alert lines) is passed over; anything else (not UTF-8, not JSON, not an object, a
step with an unusable value) is an UnreadableLine. A file whose first line is not a JSON object
is not a trace; after that, unreadable lines (a torn line, a killed writer's half record) are
skipped, and replay names them in one warning at the end: the first one's file:line, and how
many in all. A file with no readable step record and some unreadable line is an error.
Non-finite numbers are read in both spellings: strict-JSON strings ("NaN", "Infinity",
"-Infinity") and the bare literals Python and Hugging Face write (NaN, Infinity).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from .._core.errors import TraceError
from .._core.record_dict import NONFINITE_WORDS
from .._core.text import clean_text
from .._core.types import StepRecord

__all__ = [
    "NONFINITE_WORDS",
    "TraceError",
    "LogFile",
    "UnreadableLine",
    "WarnFn",
    "iter_steps",
    "open_log",
    "parse_step_line",
    "read_trace",
]

#: Receives one-line warnings (a torn last line, a step that goes backwards).
WarnFn = Callable[[str], None]

_log = logging.getLogger("nummon")


class UnreadableLine(TraceError):
    """One JSONL line that is not a usable step record. `reason` says why, in words; `structural`
    is true when the line is not a JSON object at all (on a file's first line: not a trace)."""

    def __init__(self, where: str, reason: str, structural: bool) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.structural = where, reason, structural


def _json_value(raw: bytes, where: str) -> object:
    """One line's JSON value; UnreadableLine with the reason when it is not JSON."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UnreadableLine(where, "not UTF-8 text (a binary file, or another encoding?)", True) from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise UnreadableLine(where, f"not valid JSON ({e.msg} at column {e.colno})", True) from None
    except RecursionError:
        raise UnreadableLine(where, "not a usable JSON line (nested too deeply)", True) from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise UnreadableLine(where, f"not a usable JSON line ({clean_text(str(e)[:80])})", True) from None


def parse_step_line(raw: bytes, where: str, default_step: int) -> StepRecord | None:
    """The record one JSONL line holds (`where` is its file:line, for messages); None for an
    empty line or a non-step event line; UnreadableLine when the line is not a usable record."""
    raw = raw.strip()
    if not raw:
        return None
    obj = _json_value(raw, where)
    if not isinstance(obj, dict):
        raise UnreadableLine(where, f"expected a JSON object, got {type(obj).__name__}", True)
    kind = obj.get("type")
    if kind is not None and kind != "step":
        return None  # alert and other event lines of nummon's own log
    try:
        return StepRecord.from_dict(obj, where, default_step)
    except UnreadableLine:
        raise
    except TraceError as e:
        raise UnreadableLine(where, str(e)[len(where) + 2 :], False) from None


class LogFile:
    """A log opened for reading, line by line: refused unless it is a regular file (a FIFO never
    blocks the reader, a device such as /dev/zero never floods it), and a read that fails (EIO) is
    a TraceError naming the file. The one guard of every JSONL reader (replay, report)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:  # non-blocking: opening a FIFO with no writer must not wait for one
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        except FileNotFoundError:
            raise TraceError(f"trace not found: {self.path}") from None
        except IsADirectoryError:
            raise TraceError(f"trace is a directory: {self.path}") from None
        except OSError as e:
            raise TraceError(f"cannot read trace {self.path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            kind = "a directory" if os.path.isdir(self.path) else "not a regular file (a FIFO or device is never read)"
            raise TraceError(f"{self.path}: {kind}")
        os.set_blocking(fd, True)
        self._fh = os.fdopen(fd, "rb")

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                line = self._fh.readline()
            except OSError as e:  # EIO from a failing disk or a special file
                raise TraceError(f"cannot read trace {self.path}: {e.strerror or e}") from None
            if not line:
                return
            yield line

    def __enter__(self) -> LogFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._fh.close()


def open_log(path: str | os.PathLike[str]) -> LogFile:
    """`path` opened for reading through the guard (`LogFile`): TraceError, one line, when it is
    missing, a folder, a FIFO or a device, or cannot be read."""
    return LogFile(path)


def iter_steps(path: str | Path, warn: WarnFn | None = None) -> Iterator[tuple[int, StepRecord]]:
    """(line number, record) for each step object of one JSONL trace, in file order.

    Unreadable lines after the first are skipped and named in one warning to `warn` (default:
    the "nummon" logger) once the file is read; TraceError when the first line is not a JSON
    object, or when no line was a readable step record but some line was unreadable."""
    path = Path(path)
    warn = warn or _log.warning
    n = 0  # step records so far (the default step of a record without one)
    first_line = True
    skipped: list[tuple[int, UnreadableLine]] = []  # (line number, why)
    last_lineno = 0  # the last non-empty line: a skipped line there is a torn tail
    with open_log(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            last_lineno = lineno
            try:
                rec = parse_step_line(raw, f"{path}:{lineno}", n)
            except UnreadableLine as e:
                if first_line and e.structural:  # not a trace at all
                    raise TraceError(str(e)) from None
                skipped.append((lineno, e))
                continue
            finally:
                first_line = False
            if rec is not None:
                yield lineno, rec
                n += 1
    if not skipped:
        return
    if n == 0:
        raise TraceError(f"{skipped[0][1]} (no readable step record in the file)")
    warn(_skipped_message(skipped, last_lineno))


def _skipped_message(skipped: list[tuple[int, UnreadableLine]], last_lineno: int) -> str:
    """One warning for every unreadable line of a file: the first one's file:line and reason,
    and the count (a lone torn last line says so)."""
    lineno, first = skipped[0]
    if len(skipped) == 1 and lineno == last_lineno and first.structural:
        return f"{first.where}: last line ignored, {first.reason} (torn by a full disk or a killed writer?)"
    more = "" if len(skipped) == 1 else f", the last at line {skipped[-1][0]}"
    return f"{first.where}: line skipped, {first.reason}; {_lines(len(skipped))} skipped in all{more}"


def _lines(n: int) -> str:
    return f"{n} unreadable line" + ("" if n == 1 else "s")


def read_trace(path: str | Path, warn: WarnFn | None = None) -> Iterator[StepRecord]:
    """Step records of one JSONL trace, in file order (see `iter_steps` for the error rules)."""
    for _, rec in iter_steps(path, warn):
        yield rec
