"""nummon's own JSONL logs (event logs from JsonlSink and plain traces), followed by byte offset
in bounded reads. A line that is not JSON is skipped with a warning naming its byte offset (the
next line resynchronises); a last line without its newline is read again next poll."""

from __future__ import annotations

from typing import Any

from .._core.types import StepRecord
from . import fs
from .follow import NotALogError, OneFileFollower
from .trace import UnreadableLine, parse_step_line

__all__ = ["JsonlFollower", "MAX_LINE"]

#: A longer line is not a step record: it is skipped (and named), never held in memory.
MAX_LINE = 16 * 1024 * 1024


class JsonlFollower(OneFileFollower):
    """One JSONL file: step lines become records, `"type": "alert"` (and other non-step) lines are
    skipped."""

    format = "jsonl"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self.offset = 0  # bytes consumed (always at a line start)
        self.lineno = 0
        self.count = 0  # records returned: the default step of a line without "step"
        self._skipping = False  # inside an over-long line

    def _restart(self) -> None:
        self.offset = self.lineno = self.count = 0
        self._skipping = False

    def poll(self, final: bool = False) -> list[StepRecord]:
        self.more = False
        st = self._stat()
        if st is None or st.size <= self.offset:
            return []
        data = fs.read_bytes(self.path, self.offset, self.poll_bytes)
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) == self.poll_bytes:  # one long line: look further, within a bound
            data = fs.read_bytes(self.path, self.offset, MAX_LINE)
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) == MAX_LINE:
                if not self._skipping:
                    self.note(f"{self.path}: byte {self.offset}: a line longer than {MAX_LINE >> 20} MiB skipped")
                self._skipping = True
                self.offset += len(data)
                self.more = True
                return []
        out: list[StepRecord] = []
        torn = final and end < len(data) and bool(data[end:].strip()) and len(data) < self.poll_bytes
        pos = self.offset
        for raw in data[:end].splitlines(keepends=True):
            if self._skipping:  # the rest of an over-long line
                self._skipping = False
            else:
                self.lineno += 1
                rec = self._parse(raw, pos)
                if rec is not None:
                    out.append(rec)
            pos += len(raw)
        self.offset += end
        if torn:
            self.lineno += 1
            tail = data[end:]
            rec = self._parse(tail, self.offset, last=True)
            if rec is not None:
                out.append(rec)
            self.offset += len(tail)
        self.more = len(data) == self.poll_bytes and end > 0
        if end:
            self.mark.take(self.path, self.offset)
        return out

    def _parse(self, raw: bytes, at: int, last: bool = False) -> StepRecord | None:
        where = f"{self.path}:{self.lineno}"
        try:  # the rule replay follows too (nummon._logs.trace.parse_step_line)
            rec = parse_step_line(raw, where, self.count)
        except UnreadableLine as e:
            if e.structural and self.count == 0 and self.lineno <= 1 and not last:
                raise NotALogError(f"{self.path}: not a JSONL log (line 1: {e.reason})") from None
            if last and e.structural:
                self.note(
                    f"{where}: last line ignored at byte {at}, {e.reason} (torn by a full disk or a killed writer?)"
                )
            else:
                self.note(f"{where}: skipped a line at byte {at}: {e.reason}")
            return None
        if rec is not None:
            self.count += 1
        return rec

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset, "lineno": self.lineno, "count": self.count, "mark": self.mark.to_dict()}

    def restore(self, pos: dict[str, Any]) -> None:
        self.offset = int(pos.get("offset", 0))
        self.lineno = int(pos.get("lineno", 0))
        self.count = int(pos.get("count", 0))
        self.mark.load(pos.get("mark"), self.offset)
