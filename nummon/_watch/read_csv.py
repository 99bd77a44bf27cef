"""Lightning CSVLogger `metrics.csv`: appended rows, and the whole file rewritten with a new
header when new keys appear (then steps already seen are skipped)."""
from __future__ import annotations

import csv
import io
from typing import Any

from .._types import StepRecord
from . import fs
from .base import Follower, NotALogError, StepAssembler

__all__ = ["CsvFollower"]


class CsvFollower(Follower):
    format = "csv"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self.header: list[str] | None = None
        self.header_bytes = b""
        self.offset = 0  # bytes consumed (at a row start)
        self.done_offset = 0  # bytes whose rows are all in returned records
        self.rows = 0  # rows read: the step of a row without a step column
        self.asm = StepAssembler(self.keymap)

    def poll(self, final: bool = False) -> list[StepRecord]:
        st = fs.stat(self.path)
        if st is None or st.size == 0:
            return []
        out: list[StepRecord] = []
        if self.header is None or st.size < self.offset or not self._same_header():
            if not self._read_header():
                return out
        new_rows = False
        if st.size > self.offset:
            data = fs.read_bytes(self.path, self.offset)
            end = data.rfind(b"\n") + 1
            if final and end < len(data) and data[end:].strip():
                end = len(data)
            pos = self.offset
            for raw in data[:end].splitlines(keepends=True):
                self._row(raw, pos, out)
                pos += len(raw)
            self.offset += end
            new_rows = end > 0
        if (not new_rows or final) and self.asm.flush(out):  # quiet poll: the held-back step is complete
            self.done_offset = self.offset
        return out

    def _same_header(self) -> bool:
        return fs.read_bytes(self.path, 0, len(self.header_bytes)) == self.header_bytes

    def _read_header(self) -> bool:
        """(Re)read the header; the rows after it are read again (old steps skipped)."""
        data = fs.read_bytes(self.path, 0)
        nl = data.find(b"\n")
        if nl < 0:
            return False  # header still being written
        line = data[: nl + 1]
        try:
            cols = next(csv.reader([line.decode("utf-8").strip()]))
        except (UnicodeDecodeError, StopIteration, csv.Error):
            raise NotALogError(f"{self.path}: not a CSV metrics log (unreadable header)") from None
        if "step" not in cols and not any(self.keymap.field(c) for c in cols):
            raise NotALogError(f"{self.path}: not a metrics CSV (no 'step' column and no known metric in its header)")
        self.header, self.header_bytes = cols, line
        self.offset = self.done_offset = nl + 1
        self.asm.step, self.asm.row = None, {}
        self.rows = 0
        return True

    def _row(self, raw: bytes, pos: int, out: list[StepRecord]) -> None:
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            return
        cells = next(csv.reader([text]), [])
        row = {k: v for k, v in zip(self.header or [], cells) if v != ""}
        self.rows += 1
        step_text = row.pop("step", None)
        try:
            step = int(float(step_text)) if step_text is not None else self.rows - 1
        except ValueError:
            return
        if self.asm.add(step, row, out):
            self.done_offset = pos

    def position(self) -> dict[str, Any]:
        return {
            "header": self.header_bytes.decode("utf-8", "replace"),
            "offset": self.done_offset,
            "rows": self.rows,
            "last_step": self.asm.last_emitted,
        }

    def restore(self, pos: dict[str, Any]) -> None:
        self.asm.last_emitted = pos.get("last_step")
        header = str(pos.get("header", "")).encode("utf-8")
        if header:
            self.header_bytes = header
            self.header = next(csv.reader([header.decode("utf-8").strip()]), [])
            self.offset = self.done_offset = int(pos.get("offset", 0))
            self.rows = int(pos.get("rows", 0))
