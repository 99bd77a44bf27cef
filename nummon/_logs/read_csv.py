"""Lightning CSVLogger `metrics.csv`: appended rows, and the whole file rewritten with a new
header when new keys appear (then steps already seen are skipped). Read in bounded chunks; a row
whose step is not an integer (`inf`, `nan`, text) is skipped with a warning naming its line."""

from __future__ import annotations

import csv
from typing import Any

from .._core.types import StepRecord
from . import fs
from .follow import Follower, NotALogError, StepAssembler, as_step

__all__ = ["CsvFollower"]

_MAX_HEADER = 1024 * 1024


class CsvFollower(Follower):
    format = "csv"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self.header: list[str] | None = None
        self.header_bytes = b""
        self.offset = 0  # bytes consumed (at a row start)
        self.done_offset = 0  # bytes whose rows are all in returned records
        self.rows = 0  # rows read: the step of a row without a step column
        self.ident: tuple | None = None
        self.asm = StepAssembler(self, skip_old=True)

    def poll(self, final: bool = False) -> list[StepRecord]:
        self.more = False
        st = fs.stat(self.path)
        if st is None or st.size == 0:
            return []
        out: list[StepRecord] = []
        if self.ident is not None and st.identity[0] is not None and tuple(st.identity) != tuple(self.ident):
            self.note(f"{self.path}: replaced by a new file; reading it again from the start")
            self.header, self.asm.last_emitted = None, None
        self.ident = st.identity
        if self.header is None or st.size < self.offset or not self._same_header():
            if not self._read_header():
                return out
        new_rows = False
        if st.size > self.offset:
            data = fs.read_bytes(self.path, self.offset, self.poll_bytes)
            end = data.rfind(b"\n") + 1
            if final and end < len(data) and data[end:].strip() and len(data) < self.poll_bytes:
                end = len(data)
            if end == 0 and len(data) == self.poll_bytes:  # one absurdly long row: not a metrics row
                self.note(f"{self.path}: byte {self.offset}: a row longer than {self.poll_bytes / 2**20:g} MiB skipped")
                end = len(data)
                data = b""
            pos = self.offset
            for raw in data[:end].splitlines(keepends=True):
                self._row(raw, pos, out)
                pos += len(raw)
            self.offset += end
            new_rows = end > 0
            self.more = len(data) == self.poll_bytes
        if (not new_rows or (final and not self.more)) and self.asm.flush(out):  # quiet poll: the held step is complete
            self.done_offset = self.offset
        return out

    def _same_header(self) -> bool:
        return fs.read_bytes(self.path, 0, len(self.header_bytes)) == self.header_bytes

    def _read_header(self) -> bool:
        """(Re)read the header; the rows after it are read again (old steps skipped)."""
        data = fs.read_bytes(self.path, 0, _MAX_HEADER)
        nl = data.find(b"\n")
        if nl < 0:
            if len(data) == _MAX_HEADER:
                raise NotALogError(f"{self.path}: not a CSV metrics log (no header line in its first MiB)")
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
        text = raw.decode("utf-8", "replace").replace("\x00", "").strip()
        if not text:
            return
        try:
            cells = next(csv.reader([text]), [])
        except csv.Error:
            self.note(f"{self.path}: byte {pos}: a row that is not CSV skipped")
            return
        row = {k: v for k, v in zip(self.header or [], cells) if v != ""}
        self.rows += 1
        step_text = row.pop("step", None)
        step = self.rows - 1  # without a step column the row's number is the step
        if step_text is not None:
            parsed = as_step(step_text)
            if parsed is None:
                self.note(
                    f"{self.path}: byte {pos}: row skipped, its step {step_text[:40]!r} is not an integer",
                    once="bad-step",
                )
                return
            step = parsed
        if self.asm.add(step, row, out):
            self.done_offset = pos

    def position(self) -> dict[str, Any]:
        return {
            "header": self.header_bytes.decode("utf-8", "replace"),
            "offset": self.done_offset,
            "rows": self.rows,
            "last_step": self.asm.last_emitted,
            "ident": list(self.ident) if self.ident and self.ident[0] is not None else None,
        }

    def restore(self, pos: dict[str, Any]) -> None:
        ident = pos.get("ident")
        self.ident = tuple(ident) if isinstance(ident, list) and len(ident) == 2 else None
        last = pos.get("last_step")
        self.asm.last_emitted = None if last is None else int(last)
        header = str(pos.get("header", "")).encode("utf-8")
        if header:
            self.header_bytes = header
            self.header = next(csv.reader([header.decode("utf-8").strip()]), [])
            self.offset = self.done_offset = int(pos.get("offset", 0))
            self.rows = int(pos.get("rows", 0))
