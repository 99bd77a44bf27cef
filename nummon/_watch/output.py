"""The one interface of the watcher's outputs: a `Target` is given each incident event as a
typed `Notice` and formats it itself (the JSONL line, the HTTP body); an asynchronous target
reports what became of each event as an `Outcome`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .notices import Notice

__all__ = ["Target", "Outcome", "OutcomeHandler", "CLOSE_TIMEOUT_S", "HTTP_TIMEOUT_S", "WAIT_STEP_S"]

#: Seconds a target may take to close (drain what is queued) unless the caller says otherwise.
CLOSE_TIMEOUT_S = 5.0
#: Seconds one HTTP request of a target may take.
HTTP_TIMEOUT_S = 5.0
#: Seconds between two looks at a queue being drained: short, so a close ends soon after the last send.
WAIT_STEP_S = 0.05


@dataclass(frozen=True)
class Outcome:
    """What became of one event at one asynchronous target: delivered, or lost with the reason."""

    event_id: str
    ok: bool
    reason: str = ""
    tries: int = 1
    title: str = ""
    run: str = ""


OutcomeHandler = Callable[[Outcome], None]


class Target(ABC):
    """Where the watcher sends incident events; every member the watcher uses is declared here.

    A synchronous target delivers in `on_incident` (an exception: not delivered, tried again at
    the next poll). An `asynchronous` one queues in `on_incident`, never waits, and reports each
    event's `Outcome` to the handler the watcher gives it (`report_outcomes_to`), from a thread
    of its own; `close` returns the ids of the events it has not delivered yet (kept pending).
    `run_started` / `run_retired` tell targets that follow runs (Alertmanager) what the watcher
    follows."""

    #: what metrics label it (its kind only: a URL may be a secret)
    kind: ClassVar[str] = "target"
    #: delivers from a thread of its own and reports outcomes (else: delivered when `on_incident` returns)
    asynchronous: ClassVar[bool] = False
    #: the durable record of what was sent: written before any other target is tried
    durable: ClassVar[bool] = False
    #: names it in the state file's outbox (stable across restarts)
    key: str
    #: the one form of it that is ever printed
    shown: str

    @abstractmethod
    def on_incident(self, notice: Notice) -> None:
        """Deliver (or queue) one incident event."""

    @abstractmethod
    def close(self, timeout_s: float = 5.0) -> list[str]:
        """Deliver what is queued within `timeout_s` seconds and release what the target holds;
        the ids of the events not delivered then (always empty for a synchronous target). A
        second call does nothing more."""

    def report_outcomes_to(self, handler: OutcomeHandler) -> None:  # noqa: B027 - a no-op by default
        """Where an asynchronous target reports outcomes (a synchronous one has none)."""

    def describe(self, outcome: Outcome) -> str:
        """The line that says one event was lost at this target (no secret in it)."""
        return f'{self.shown}: could not deliver "{outcome.title}" of run {outcome.run} ({outcome.reason})'

    def failures(self) -> int | None:
        """Events this target counted as not delivered (failed or dropped), or None when it keeps
        no count (the watcher counts its failures)."""
        return None

    def run_started(self, run: Any, spec: Any) -> None:  # noqa: B027 - a no-op by default
        """A run the watcher follows from now on (resumed with its saved state, if any)."""

    def run_retired(self, run_id: str) -> None:  # noqa: B027 - a no-op by default
        """A run the watcher no longer follows (idle, or its files are gone)."""
