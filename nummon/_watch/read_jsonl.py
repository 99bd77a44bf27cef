"""nummon's own JSONL logs (event logs from JsonlSink and plain traces), followed by byte offset."""
from __future__ import annotations

import json
from typing import Any

from .._trace import TraceError, record_from_dict
from .._types import StepRecord
from . import fs
from .base import Follower, NotALogError

__all__ = ["JsonlFollower"]


class JsonlFollower(Follower):
    """One JSONL file: step lines become records, `"type": "alert"` (and other non-step) lines are
    skipped; a last line without its newline is read again next poll."""

    format = "jsonl"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self.offset = 0  # bytes consumed (always at a line start)
        self.lineno = 0
        self.count = 0  # records returned: the default step of a line without "step"
        self.notes: list[str] = []

    def poll(self, final: bool = False) -> list[StepRecord]:
        st = fs.stat(self.path)
        if st is None:
            return []
        if st.size < self.offset:  # truncated or replaced: start over
            self.offset = self.lineno = self.count = 0
        if st.size == self.offset:
            return []
        data = fs.read_bytes(self.path, self.offset)
        end = data.rfind(b"\n") + 1
        if final and end < len(data) and data[end:].strip():
            end = len(data)  # the writer is done: a last line without newline is complete
        out: list[StepRecord] = []
        for raw in data[:end].splitlines():
            self.lineno += 1
            rec = self._parse(raw)
            if rec is not None:
                out.append(rec)
        self.offset += end
        return out

    def _parse(self, raw: bytes) -> StepRecord | None:
        line = raw.strip()
        if not line:
            return None
        where = f"{self.path}:{self.lineno}"
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if self.count == 0 and self.lineno <= 1:
                raise NotALogError(f"{self.path}: not a JSONL log (line 1: {getattr(e, 'msg', e)})") from None
            self.notes.append(f"{where}: skipped a line that is not valid JSON")
            return None
        if not isinstance(obj, dict):
            if self.count == 0 and self.lineno <= 1:
                raise NotALogError(f"{self.path}: not a JSONL log (line 1 is not a JSON object)")
            return None
        kind = obj.get("type", "step")
        if kind != "step":
            return None
        try:
            rec = record_from_dict(obj, where, self.count)
        except TraceError as e:
            self.notes.append(f"{e}; line skipped")
            return None
        self.count += 1
        return rec

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset, "lineno": self.lineno, "count": self.count}

    def restore(self, pos: dict[str, Any]) -> None:
        self.offset = int(pos.get("offset", 0))
        self.lineno = int(pos.get("lineno", 0))
        self.count = int(pos.get("count", 0))
