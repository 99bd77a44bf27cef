"""The state file as the watcher keeps it: locked for the session, read at the start, and
written when something changed (at once when the outbox did, else at most every few seconds).
A state file that cannot be written is warned about once; the watcher goes on in memory and
retries at each save, and says so when a write succeeds again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .state import StateFile

__all__ = ["StateSaver"]


class StateSaver:
    """The watcher's `StateFile` and what is due to be written to it."""

    def __init__(self, path: str | None, say: Callable[[str], None]) -> None:
        self.file = StateFile(path)
        self.say = say
        self.dirty = False  # a run's state changed since the last write
        self.outbox_changed = False  # the outbox changed: written at the end of the pass
        self._last_save = 0.0
        self._failed: str | None = None  # why the last write failed (said once)

    @property
    def path(self) -> str | None:
        return self.file.path

    def open(self) -> dict[str, Any]:
        """Lock the state file and read it (the lock is let go again when it cannot be read)."""
        self.file.acquire()
        try:
            return self.file.load()
        except BaseException:
            self.file.release()
            raise

    def touch(self, outbox: bool = False) -> None:
        """Something to write changed (with `outbox`: the outbox, written at the end of the pass)."""
        self.dirty = True
        self.outbox_changed = self.outbox_changed or outbox

    def due(self, every_s: float) -> bool:
        """The outbox changed (written at once: no resend after a crash), or runs changed and
        `every_s` seconds went by since the last write."""
        return self.outbox_changed or (self.dirty and time.monotonic() - self._last_save >= every_s)

    def save(self, data: Callable[[], dict[str, Any]], written: Callable[[], None]) -> None:
        """Write `data()`, then call `written`; a failure is warned about once and survived."""
        if not self.file.path:
            self.dirty = False
            return
        payload = data()
        try:
            self.file.save(payload)
            written()
        except OSError as e:
            why = e.strerror or str(e)
            if self._failed is None:
                self.say(
                    f"--state {self.file.path}: cannot write the state file ({why}); going on in memory, "
                    "retrying at each poll"
                )
            self._failed = why
            self._last_save = time.monotonic()
            return
        if self._failed is not None:
            self.say(f"--state {self.file.path}: written again")
            self._failed = None
        self._last_save = time.monotonic()
        self.dirty = self.outbox_changed = False

    def release(self) -> None:
        self.file.release()
