"""What every log follower shares: incremental polls, a saved position, and the errors that
say a file is not a log."""
from __future__ import annotations

from typing import Any

from .._errors import NummonError
from .._types import StepRecord
from . import fs
from .keymap import KeyMap

__all__ = ["NotALogError", "Follower", "StepAssembler"]


class NotALogError(NummonError):
    """A path that does not hold a log of the expected format; the message names it."""


class Follower:
    """Reads one run's log incrementally. `poll()` returns only records not returned before;
    a half-written tail is left for the next poll. `position()` / `restore()` carry the read
    position across processes (plain JSON data)."""

    format = "?"

    def __init__(self, path: str, keymap: KeyMap | None = None) -> None:
        self.path = path
        self.keymap = keymap or KeyMap()
        self._failed_stat: fs.Stat | None = None  # (size, mtime) at the last unparsable read

    def poll(self, final: bool = False) -> list[StepRecord]:
        """New complete records; with `final`, also a held-back last step (the writer is done)."""
        raise NotImplementedError

    def position(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, pos: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _unparsable(self, path: str, why: str) -> None:
        """A whole-file format failed to parse: a writer mid-rewrite is retried silently; the same
        unparsable bytes twice in a row mean the file is not a log."""
        st = fs.stat(path)
        if st is not None and st == self._failed_stat:
            raise NotALogError(f"{path}: not a {self.format} log ({why})")
        self._failed_stat = st


class StepAssembler:
    """Collects (step, row) items from formats that log one tag (or one row) at a time into one
    record per step: a step is complete when a later step appears, or when a poll brings nothing
    new (the writer had a whole interval to finish it)."""

    def __init__(self, keymap: KeyMap) -> None:
        self.keymap = keymap
        self.step: int | None = None
        self.row: dict[str, Any] = {}
        self.last_emitted: int | None = None  # steps at or below it are old (a rewritten file)

    def add(self, step: int, row: dict[str, Any], out: list[StepRecord]) -> bool:
        """Add one item; True when it completed the previous step (appended to `out`)."""
        if self.last_emitted is not None and step <= self.last_emitted:
            return False
        done = False
        if self.step is not None and step != self.step:
            done = self.flush(out)
        self.step = step
        self.row.update(row)
        return done

    def flush(self, out: list[StepRecord]) -> bool:
        if self.step is None:
            return False
        rec = self.keymap.record(self.step, self.row)
        self.last_emitted = self.step
        self.step, self.row = None, {}
        if rec is not None:
            out.append(rec)
        return True
