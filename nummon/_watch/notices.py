"""Incident events of one watched run: nummon's own incident state machine (the HealthEngine's
`IncidentTracker`, as in the Monitor), each event labelled with the run it belongs to, and the
`Notice` every notification target receives. Notifications go per event, never per alert."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .._core.alert_text import TITLE_MAX
from .._core.events import IncidentEvent
from .._core.text import cut_at_word, printable, raw_bytes
from .._core.types import IncidentState

__all__ = ["RunIncident", "Notice", "event_id"]


def event_id(readable_id: str) -> str:
    """The idempotency key of an event (32 hex digits): the same for every retry, restart and
    target, so a receiver that keeps the ids it has seen drops duplicates."""
    return hashlib.blake2b(raw_bytes(readable_id), digest_size=16).hexdigest()  # a run named in bytes too


class RunIncident:
    """One incident event of one watched run."""

    def __init__(self, run: str, event: IncidentEvent, name: str | None = None) -> None:
        self.run = run
        self.event = event
        self.name = name or run

    @property
    def id(self) -> str:
        """Unique per run, incident and state (skips events already written after a restart)."""
        return f"{self.run}#{self.event.number}:{self.transition}:{self.level}"

    @property
    def transition(self) -> str:
        """opened, escalated or resolved."""
        if not self.event.state.active:
            return "resolved"
        return "escalated" if self.event.previous.active else "opened"

    @property
    def level(self) -> int:
        """0 resolved, 1 warning, 2 critical, 3 non-finite."""
        return self.event.state.rank

    @property
    def title(self) -> str:
        """The event's title, cut at a word (never mid-word) to W&B's 63 characters."""
        e = self.event
        if e.action:
            return cut_at_word(f"nummon: {e.action}", TITLE_MAX)
        head = replace(e, contributors=()).title  # "nummon: run unstable" (short: never cut)
        if e.contributors and e.state in (IncidentState.OPEN, IncidentState.CRITICAL):
            c = e.contributors[0]
            head += f": {c.kind.value} in {c.metric}"
        return cut_at_word(head, TITLE_MAX)

    def summary(self) -> str:
        return f"run `{printable(self.run)}`: {self.event.summary()}"

    def to_dict(self) -> dict[str, Any]:
        """The event as strict JSON data: run paths that are not UTF-8 or hold control
        characters are printed escaped (`printable`); `event_id` is the hash of the exact bytes."""
        return {
            "type": "incident",
            "id": printable(self.id),
            "event_id": event_id(self.id),
            "run": printable(self.run),
            "run_name": printable(self.name),
            "level": self.level,
            "transition": self.transition,
            "summary": self.summary(),
            **self.event.to_dict(),
            "title": self.title,
        }


@dataclass(frozen=True)
class Notice:
    """What a target is given: one incident event of one run, typed, from the moment the watcher
    finds it (`from_incident`) or reads it back from the state file's outbox (`from_dict`) until
    a target formats it (`to_dict`: the JSONL line, the webhook's body, the state file)."""

    id: str  # readable: run, incident number, transition, level (printable)
    event_id: str  # the idempotency key (32 hex digits)
    run: str  # the run's path (printable)
    name: str  # the run's short name below its watch root
    title: str
    level: int  # 0 resolved, 1 warning, 2 critical, 3 non-finite
    text: str  # the summary (Markdown)
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the whole event, as JSON data

    @classmethod
    def from_incident(cls, incident: RunIncident) -> Notice:
        return cls.from_dict(incident.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Notice:
        """A notice from the event's JSON data (a missing `event_id` is made from its `id`; an
        older state file's event without title or level gets the defaults)."""
        readable = str(d.get("id", ""))
        eid = str(d.get("event_id") or event_id(readable))
        level = d.get("level", 1)
        run = str(d.get("run", ""))
        data = dict(d)
        data.setdefault("event_id", eid)
        return cls(
            id=readable,
            event_id=eid,
            run=run,
            name=str(d.get("run_name") or run),
            title=str(d.get("title") or "nummon: incident"),
            level=level if isinstance(level, int) and not isinstance(level, bool) else 1,
            text=str(d.get("summary", "")),
            fields=data,
        )

    def summary(self) -> str:
        return self.text

    def to_dict(self) -> dict[str, Any]:
        """The event as strict JSON data (a copy: the notice stays as it is)."""
        return dict(self.fields)
