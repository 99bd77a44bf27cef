"""What every log follower shares: incremental, bounded polls; a saved position that carries the
file's identity; the choice of the best source of each metric; and the errors that say a file
is not a log."""

from __future__ import annotations

import math
from typing import Any

from .._core.errors import NummonError
from .._core.types import StepRecord
from . import fs
from .keymap import KeyMap

__all__ = ["NotALogError", "Follower", "OneFileFollower", "StepAssembler", "FileMark", "as_step", "POLL_BYTES"]

#: Bytes one poll reads at most: a long backlog streams through in bounded memory.
POLL_BYTES = 4 * 1024 * 1024
_MARK_BYTES = fs.HEAD_BYTES


class NotALogError(NummonError):
    """A path that does not hold a log of the expected format; the message names it."""


def as_step(v: Any) -> int | None:
    """A step number from a logged value, or None when it is not a finite integer-valued number
    (NaN, Infinity, 1e400, "abc", 2.5, true): such a row is skipped, never a crash."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v if -(2**63) <= v < 2**63 else None
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    return None


class FileMark:
    """What a saved byte offset into one file is valid for: the file's (device, inode) and hashes
    of its first bytes and of the bytes just before the offset. `check` says why reading must
    start over (truncated, replaced, rewritten in place), or None."""

    def __init__(self) -> None:
        self.ident: tuple | None = None
        self.head = self.tail = ""
        self.offset = 0
        self._last_stat: fs.Stat | None = None

    def take(self, path: str, offset: int, st: fs.Stat | None = None) -> None:
        st = st or fs.stat(path)
        self.offset = offset
        self.ident = st.identity if st is not None else None
        self.head = fs.digest(path, 0, min(offset, _MARK_BYTES))
        self.tail = fs.digest(path, max(0, offset - _MARK_BYTES), min(offset, _MARK_BYTES))
        self._last_stat = st

    def check(self, path: str, st: fs.Stat) -> str | None:
        if st == self._last_stat or self.offset == 0:
            return None
        self._last_stat = st
        if self._unmarked:  # nothing to compare with: trust the offset, and mark it from now on
            self._unmarked = False
            if st.size >= self.offset:
                self.take(path, self.offset, st)
                return None
        if st.size < self.offset:
            return f"truncated to {st.size} bytes (was read to byte {self.offset})"
        if self.ident is not None and st.identity[0] is not None and tuple(st.identity) != tuple(self.ident):
            return "replaced by a new file (rotated?)"
        if (
            fs.digest(path, 0, min(self.offset, _MARK_BYTES)) != self.head
            or fs.digest(path, max(0, self.offset - _MARK_BYTES), min(self.offset, _MARK_BYTES)) != self.tail
        ):
            return "rewritten in place"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"ident": list(self.ident) if self.ident else None, "head": self.head, "tail": self.tail}

    def load(self, d: Any, offset: int) -> None:
        d = d if isinstance(d, dict) else {}
        ident = d.get("ident")
        self.ident = tuple(ident) if isinstance(ident, list) and len(ident) == 2 else None
        self.head, self.tail = str(d.get("head") or ""), str(d.get("tail") or "")
        self.offset = offset
        self._last_stat = None
        self._unmarked = not self.head and self.ident is None  # saved by an older version

    _unmarked = False


class Follower:
    """Reads one run's log incrementally. `poll()` returns only records not returned before,
    reading at most about POLL_BYTES (then `more` is True: poll again); a half-written tail is
    left for the next poll. `position()` / `restore()` carry the read position across processes
    (plain JSON data). `notes` collects one-line warnings (corruption skipped, a file started
    over) for the caller to print."""

    format = "?"

    def __init__(self, path: str, keymap: KeyMap | None = None) -> None:
        self.path = path
        self.keymap = keymap or KeyMap()
        self.notes: list[str] = []
        self.more = False
        self.poll_bytes = POLL_BYTES  # the most one poll reads (the watcher may set a smaller bound)
        self._noted: set[str] = set()
        self._own_fields: set[str] = set()  # fields this run logs under nummon's own tags

    def poll(self, final: bool = False) -> list[StepRecord]:
        """New complete records; with `final`, also a held-back last step (the writer is done)."""
        raise NotImplementedError

    def position(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, pos: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def note(self, line: str, once: str | None = None) -> None:
        """A warning for the caller; with `once`, only the first note under that key."""
        if once is not None:
            if once in self._noted:
                return
            self._noted.add(once)
        self.notes.append(line)

    def record(self, step: int, row: dict[str, Any]) -> StepRecord | None:
        """A StepRecord from one row, the best source first: once a run logs a field under
        nummon's own tag (`nummon/loss`, per step, unfiltered), the trainer's averaged copies of
        that field (`train/loss`, every logging_steps, NaN filtered to 0) are ignored."""
        own = {k[len("nummon/") :] for k in row if k.startswith("nummon/") and self.keymap.field(k) is not None}
        self._own_fields |= own
        if self._own_fields:
            if not own:  # a row of the trainer's alone (its logging step, maybe out of order): not a step of nummon's
                return None
            row = {
                k: v for k, v in row.items() if k.startswith("nummon/") or self.keymap.field(k) not in self._own_fields
            }
        return self.keymap.record(step, row)


class StepAssembler:
    """Collects (step, row) items from formats that log one tag (or one row) at a time into one
    record per step: a step is complete when a later step appears, or when a poll brings nothing
    new (the writer had a whole interval to finish it). With `skip_old`, steps at or below the
    last emitted one are dropped (a CSV rewritten with a new header repeats its rows)."""

    def __init__(self, follower: Follower, skip_old: bool = False) -> None:
        self.follower = follower
        self.skip_old = skip_old
        self.step: int | None = None
        self.row: dict[str, Any] = {}
        self.last_emitted: int | None = None

    def add(self, step: int, row: dict[str, Any], out: list[StepRecord]) -> bool:
        """Add one item; True when it completed the previous step (appended to `out`)."""
        if self.skip_old and self.last_emitted is not None and step <= self.last_emitted:
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
        rec = self.follower.record(self.step, self.row)
        self.last_emitted = self.step
        self.step, self.row = None, {}
        if rec is not None:
            out.append(rec)
        return True


class OneFileFollower(Follower):
    """A follower of one file, which it knows by identity (`FileMark`): a file replaced,
    truncated or re-run since the last poll is read again from the start."""

    def __init__(self, path: str, keymap: KeyMap | None = None) -> None:
        super().__init__(path, keymap)
        self.mark = FileMark()

    def _restart(self) -> None:
        """Forget the read position (the file is read again from its start)."""
        raise NotImplementedError

    def _stat(self) -> fs.Stat | None:
        """The file's stat (None while it does not exist), after restarting when it is no longer
        the file read so far."""
        st = fs.stat(self.path)
        if st is None:
            return None
        why = self.mark.check(self.path, st)
        if why:
            self.note(f"{self.path}: {why}; reading it again from the start")
            self._restart()
        return st
