"""How a watcher reads and keeps its runs: `WatchSettings`, with `nummon watch`'s defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._logs.keymap import KeyMap

__all__ = ["FORGET_AFTER_S", "IDLE_TIMEOUT_S", "INTERVAL_S", "WatchSettings"]

#: Seconds between polls (and between state-file saves) unless told otherwise.
INTERVAL_S = 5.0
#: Seconds without a new record after which a run is retired (its state kept; it wakes on a change).
IDLE_TIMEOUT_S = 1800.0
FORGET_AFTER_S = 24 * 3600.0  # a run whose files are gone this long (wall clock, across restarts) is forgotten


@dataclass(frozen=True)
class WatchSettings:
    """How a Watcher reads and keeps its runs; every field has `nummon watch`'s default."""

    format: str | None = None  # one log format for every run (None: each run's own, found by name and content)
    keymap: KeyMap | None = None  # logged tags -> StepRecord fields, beyond the common loggers' names
    state_path: str | None = None  # the state file (None: nothing survives a restart)
    idle_timeout_s: float = IDLE_TIMEOUT_S  # s without a new record before a run is retired
    state_every_s: float = INTERVAL_S  # s between state-file saves
    exclude: frozenset[str] = frozenset()  # paths that are never runs
    shard: Any = None  # shard.Shard: this watcher's part of a shared root (None: all of it)
    poll_bytes: int | None = None  # bytes read from one run per pass (None: the reader's own bound)
    forget_after_s: float = FORGET_AFTER_S  # s a run's files may be gone before it is forgotten
