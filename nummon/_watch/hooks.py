"""The watcher's hooks (`Watcher(observer=...)`): `run_started(run, spec)`, `run_retired(run_id)`,
`polled(duration_s, watched)`, `target_failed(target)`; an observer implements those it needs.
`Observers` fans them out (the metrics, and targets that follow runs, e.g. Alertmanager's)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Observers", "HOOKS"]

HOOKS = ("run_started", "run_retired", "polled", "target_failed")


class Observers:
    """Several observers as one; each hook goes to those that define it, in order."""

    def __init__(self, observers: Iterable[Any]) -> None:
        self.observers = [o for o in observers if o is not None and any(hasattr(o, h) for h in HOOKS)]

    def __bool__(self) -> bool:
        return bool(self.observers)

    def _call(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            fn = getattr(o, hook, None)
            if fn is not None:
                fn(*args)

    def run_started(self, run: Any, spec: Any) -> None:
        self._call("run_started", run, spec)

    def run_retired(self, run_id: str) -> None:
        self._call("run_retired", run_id)

    def polled(self, duration_s: float, watched: int) -> None:
        self._call("polled", duration_s, watched)

    def target_failed(self, target: Any) -> None:
        self._call("target_failed", target)
