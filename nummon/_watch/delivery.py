"""The watcher's outbox and its delivery to the targets, at least once: each event goes into the
outbox with the keys of the targets it is pending for, and leaves it when every target has it
(or some target has lost it, which is said). A synchronous target that fails is tried again at
the next pass, `SYNC_TRIES` times in all; an asynchronous one reports each event's `Outcome`
from its own thread, applied at the next `settle`. With a journal (beside the watcher's state
file), each asynchronous delivery is on disk before the target's next post: a watcher killed
before its state file caught up does not post it again after a restart."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._core.files import write_atomic
from .._core.text import plural
from .notices import Notice
from .output import WAIT_STEP_S, Outcome, Target

__all__ = ["OutboxEntry", "Delivery", "SYNC_TRIES"]

SYNC_TRIES = 3  # passes a failing synchronous target is tried before the event counts as lost


@dataclass
class OutboxEntry:
    """One event in the outbox: the targets (by key) it is still pending for, the failed tries of
    each synchronous one, and whether it was counted as notified (handed to the targets)."""

    notice: Notice
    pending: list[str]
    tries: dict[str, int] = field(default_factory=dict)
    counted: bool = False

    def to_state(self) -> dict[str, Any]:
        """The entry as the state file keeps it (version 2: the event and its pending keys)."""
        return {"event": self.notice.to_dict(), "pending": list(self.pending)}


class Delivery:
    """The targets (the durable record first), the outbox and what became of its events:
    `notified` (handed to the targets), `delivered` (every target has it), `lost` (some target
    never got it, each said on the `say` line). `failed(target)` is told of each failure."""

    def __init__(
        self,
        targets: list[Target],
        say: Callable[[str], None],
        failed: Callable[[Target], None],
        journal: str | None = None,
    ) -> None:
        # the JSONL record of events is written before any other target is tried
        self.targets = sorted(targets, key=lambda t: not t.durable)
        self.by_key = {t.key: t for t in self.targets}
        self.outbox: dict[str, OutboxEntry] = {}  # event_id -> entry, in event order
        self.say = say
        self.failed = failed
        self.notified = 0
        self.delivered = 0
        self.lost = 0
        self._lost_ids: set[str] = set()  # events some target never got, until they leave the outbox
        self._in_flight: set[tuple[str, str]] = set()  # (event_id, key) queued at an asynchronous target
        self._outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self.journal = journal  # "<event_id> <target key>" per delivery, fsync'ed before the next post
        self._journal_failed = False
        for t in self.targets:
            if t.asynchronous:
                t.report_outcomes_to(functools.partial(self._outcome, key=t.key))

    def load(self, saved: list[Any]) -> None:
        """The outbox a previous watcher saved: each event pending for the targets it names that
        are still given (a version-1 outbox holds bare events, pending for every target)."""
        for item in saved:
            event = item.get("event", item)
            pending = [k for k in item.get("pending", list(self.by_key)) if k in self.by_key]
            if pending:
                n = Notice.from_dict(event)
                self.outbox[n.event_id] = OutboxEntry(n, pending)
        for eid, key in self._journalled():  # delivered after the state file was last written
            entry = self.outbox.get(eid)
            if entry is not None and key in entry.pending:
                entry.pending.remove(key)
                if not entry.pending:
                    del self.outbox[eid]

    def _journalled(self) -> list[tuple[str, str]]:
        if not self.journal:
            return []
        try:
            with open(self.journal, encoding="utf-8", errors="replace") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return []
        return [(p[0], p[1]) for p in (line.split(" ", 1) for line in lines) if len(p) == 2]

    def compact_journal(self) -> None:
        """Keep only the deliveries of events still in the outbox (the state file holds the rest)."""
        if not self.journal:
            return
        with self._lock:
            keep = [f"{e} {k}\n" for e, k in self._journalled() if e in self.outbox]
            try:
                if keep or os.path.exists(self.journal):
                    write_atomic(self.journal, "".join(keep), durable=True)
            except OSError:
                pass  # the journal only saves re-posts: the state file is the record

    def add(self, notice: Notice) -> None:
        self.outbox[notice.event_id] = OutboxEntry(notice, list(self.by_key))

    def to_state(self) -> list[dict[str, Any]]:
        return [e.to_state() for e in self.outbox.values()]

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def fates(self, kept: int) -> str:
        """What became of this session's events, `kept` of them for the next start."""
        fates = (
            [f"{self.delivered} delivered"]
            + ([f"{plural(self.lost, 'notification')} lost"] if self.lost else [])
            + ([f"{kept} kept for the next start"] if kept else [])
        )
        return f"{plural(self.notified, 'incident event')} notified ({', '.join(fates)})"

    def pending(self) -> int:
        """Events some target has not taken yet."""
        return sum(1 for e in self.outbox.values() if e.pending)

    def deliver(self) -> bool:
        """Hand every pending event to every target it is pending for (in event order); True
        when the outbox changed."""
        for eid, entry in list(self.outbox.items()):
            for key in list(entry.pending):
                t = self.by_key.get(key)
                if t is None or (eid, key) in self._in_flight:
                    continue
                if t.asynchronous:
                    self._in_flight.add((eid, key))
                    t.on_incident(entry.notice)
                    continue
                try:
                    t.on_incident(entry.notice)
                except Exception as e:  # one broken target must not stop the others or the loop
                    self._failed_try(t, entry, e)
                    continue
                entry.pending.remove(key)
            if not entry.counted:
                entry.counted = True
                self.notified += 1
        return self.settle()

    def _failed_try(self, t: Target, entry: OutboxEntry, e: Exception) -> None:
        self.failed(t)
        notice = entry.notice
        tries = entry.tries[t.key] = entry.tries.get(t.key, 0) + 1
        if tries >= SYNC_TRIES:
            entry.pending.remove(t.key)
            self._lose(notice.event_id)
            self.say(
                f'{t.shown}: could not deliver "{notice.title}" of run {notice.run} '
                f"({type(e).__name__}: {e}; {plural(tries, 'try')})"
            )
        else:
            self.say(f'{t.shown}: failed on "{notice.title}" ({e}); tried again at the next poll')

    def _lose(self, eid: str) -> None:
        self.lost += 1
        self._lost_ids.add(eid)

    def _outcome(self, outcome: Outcome, key: str) -> None:  # from a target's thread, before its next post
        with self._lock:
            self._outcomes.append(outcome)
            if outcome.ok and self.journal and not self._journal_failed:
                try:
                    with open(self.journal, "a", encoding="utf-8") as fh:
                        fh.write(f"{outcome.event_id} {key}\n")
                        fh.flush()
                        os.fsync(fh.fileno())
                except OSError:
                    self._journal_failed = True  # at least once still holds; a restart may re-post

    def settle(self) -> bool:
        """Apply the outcomes the asynchronous targets reported; drop events every target has.
        True when the outbox changed."""
        with self._lock:
            got, self._outcomes = self._outcomes, []
        changed = False
        for o in got:
            changed = self._apply(o) or changed
        for eid, entry in list(self.outbox.items()):
            if not entry.pending:
                del self.outbox[eid]
                if eid in self._lost_ids:
                    self._lost_ids.discard(eid)
                else:
                    self.delivered += 1
                changed = True
        return changed

    def _apply(self, o: Outcome) -> bool:
        """One outcome, at the first asynchronous target that has its event in flight."""
        for key, t in self.by_key.items():
            if (o.event_id, key) not in self._in_flight or not t.asynchronous:
                continue
            self._in_flight.discard((o.event_id, key))
            entry = self.outbox.get(o.event_id)
            changed = entry is not None and key in entry.pending
            if entry is not None and changed:
                entry.pending.remove(key)
            if not o.ok:
                self._lose(o.event_id)
                self.failed(t)
                self.say(t.describe(o))
            return changed
        return False

    def drain(self, stop: threading.Event, timeout_s: float | None) -> bool:
        """Wait for the asynchronous targets' outcomes (bounded by their own retries); True
        when the outbox changed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        changed = False
        while self._in_flight and not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            stop.wait(WAIT_STEP_S)
            changed = self.settle() or changed
            changed = self.deliver() or changed
        return changed

    def close_asynchronous(self, deadline: float) -> bool:
        """Close the asynchronous targets by `deadline` (monotonic seconds); what they have not
        delivered stays pending. True when the outbox changed."""
        changed = False
        for t in self.targets:
            if not t.asynchronous:
                continue
            try:
                left = t.close(timeout_s=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                left = []
                self.say(f"notification target {t.shown} did not close: {e}")
            changed = self.settle() or changed
            for eid in left:
                self._in_flight.discard((eid, t.key))
        return changed

    def close_synchronous(self, deadline: float) -> None:
        """Close the other targets; those with threads of their own (Alertmanager) get what is
        left until `deadline`."""
        for t in self.targets:
            if t.asynchronous:
                continue
            try:
                t.close(timeout_s=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                self.say(f"notification target {type(t).__name__} did not close: {e}")
