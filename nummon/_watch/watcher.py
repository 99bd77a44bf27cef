"""The watch loop: each pass finds runs under the roots and reads a bounded chunk of each
(`roster.Roster`), hands the incident events to the targets (`delivery.Delivery`) and keeps the
state file (`saving.StateSaver`); `run` polls until stopped (or once) and closes cleanly.

A problem with one run (not a log, unreadable, a reader's bug) is that run's problem: logged
once with the run named, the run marked unhealthy and tried again when its files change; it is
never the watcher's exit. Delivery is at least once: each event goes into the outbox (saved in
the state file before any target is tried) with the targets it is pending for, and leaves it
when every target has it; an event still pending at exit is sent again at the next start (its
`event_id` lets receivers drop the duplicate). A state file that cannot be written is warned
about once; the watcher goes on in memory and retries at each poll."""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from .._logs.discovery import RunSpec
from .._policy.policy import Policy
from .announce import pending_line, stopped_line
from .delivery import Delivery
from .notices import Notice, RunIncident
from .output import CLOSE_TIMEOUT_S, Target
from .remote import BackgroundAsk
from .reports import WatchReports
from .roster import Roster
from .runs import WatchedRun
from .saving import StateSaver
from .settings import INTERVAL_S, WatchSettings

__all__ = ["Watcher"]

_ONCE_DRAIN_S = 120.0  # --once waits this long at most for slow endpoints (then: kept or lost, said)


class Watcher:
    """Follows the runs under `roots` (`poll_once`, or `run` until `stop` is set) and notifies
    `targets` of their incident events; `close` when done (`run` closes by itself). `errors`
    receives the one-line problems (default stderr), `observer` the hooks (hooks.py)."""

    def __init__(
        self,
        roots: list[str],
        policy: Policy,
        targets: list[Target],
        settings: WatchSettings | None = None,
        *,
        errors: IO[str] | None = None,
        observer: Any = None,
    ) -> None:
        settings = settings or WatchSettings()
        state_path = settings.state_path
        self.roots = roots
        self.observer = observer  # metrics.MetricsObserver: runs, records, polls, failures
        self.backlog = False  # some run had more to read than one pass reads: the next pass comes at once
        self.passes = 0
        self.policy = policy
        self.errors = errors or sys.stderr
        self.state = StateSaver(state_path, self.say)
        self.delivery = Delivery(targets, self.say, self._target_failed, self.state.file.journal_path)
        self.targets = self.delivery.targets  # the JSONL record of events first
        saved = self.state.open()
        self.idle_timeout_s = settings.idle_timeout_s
        self.state_every_s = settings.state_every_s
        self.stop = threading.Event()
        # incident reports beside the state file (reports.py: on critical, at retire and stop)
        self.reports = WatchReports.beside(state_path, say=self.say) if state_path and policy.report.enabled else None
        self.roster = Roster(
            roots,
            policy,
            self.targets,
            saved["runs"],
            self.state,
            self.say,
            settings,
            exclude=set(settings.exclude) | self.state.file.own_files(),  # the state file is never a run
            observer=observer,
            reports=self.reports,
        )
        self.delivery.load(saved.get("outbox", []))
        self._once = False
        self.records_read = 0  # step records read in this session, all runs
        self.stop_reason: str | None = None  # set with `stop` by whoever stops the loop ("SIGTERM")

    @property
    def runs(self) -> dict[str, WatchedRun]:
        """The runs followed now, by id."""
        return self.roster.runs

    @property
    def specs(self) -> dict[str, RunSpec]:
        """The runs found under the roots at the last look, by id."""
        return self.roster.specs

    @property
    def bad(self) -> dict[str, Any]:
        """Unhealthy runs and problem lines said (with --once, any makes the exit 2)."""
        return self.roster.bad

    @property
    def wall_clock(self) -> Any:
        """The wall clock that dates runs gone (a test sets its own)."""
        return self.roster.wall_clock

    @wall_clock.setter
    def wall_clock(self, clock: Any) -> None:
        self.roster.wall_clock = clock

    @property
    def notified(self) -> int:
        """Events handed to the targets in this session."""
        return self.delivery.notified

    @property
    def delivered(self) -> int:
        """Events every target has taken."""
        return self.delivery.delivered

    @property
    def lost(self) -> int:
        """Events some target never got (each named on stderr)."""
        return self.delivery.lost

    def say(self, line: str) -> None:
        try:
            self.errors.write(f"nummon watch: {line}\n")
            self.errors.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the watching
            pass

    # --- polling -------------------------------------------------------------------------
    def poll_once(self, final: bool = False, discover: bool = True) -> int:
        """One pass over every run (at most one bounded chunk of each log: `backlog` says when
        some run has more); returns the number of incident events it found."""
        started = time.monotonic()
        try:
            return self._poll_once(final, discover)
        finally:
            if self.observer is not None:
                self.observer.polled(time.monotonic() - started, len(self.runs))

    def _poll_once(self, final: bool = False, discover: bool = True) -> int:
        self._settle()
        if discover:
            self.roster.discover()
        self.passes += 1
        found = 0
        backlog = False
        now = time.monotonic()
        for run_id, run in list(self.runs.items()):
            if self.stop.is_set():
                break
            before = run.records
            events = self.roster.read(run_id, run, final, self.stop)
            if events is None:
                continue
            backlog = backlog or run.backlog
            self.roster.notes(run)
            self.records_read += max(0, run.records - before)
            if self.reports is not None and events:
                events = self.reports.on_events(run, events, self.roster.name(run_id))
            for ev in events:
                self._enqueue(ev)
            found += len(events)
            if run.records != before:
                self.state.touch()
            elif now - run.last_activity > self.idle_timeout_s:
                self.roster.retire(run_id)
        self.backlog = backlog
        if self.reports is not None:
            self.reports.write_due(self.runs, self.roster.name)
        if found:
            self.save(force=True)  # write-ahead: a restart knows these were (about to be) sent
        self._deliver()
        if self.state.due(self.state_every_s):
            self.save()  # what was delivered leaves the saved outbox at once (no resend after a crash)
        return found

    def _enqueue(self, ev: RunIncident) -> None:
        ev.name = self.roster.name(ev.run)
        self.delivery.add(Notice.from_incident(ev))

    def _deliver(self) -> None:
        """Hand every pending event to every target it is pending for (in event order)."""
        self._outbox_touched(self.delivery.deliver())

    def _settle(self) -> None:
        """Apply the outcomes the asynchronous targets reported; drop events every target has."""
        self._outbox_touched(self.delivery.settle())

    def _outbox_touched(self, changed: bool) -> None:
        if changed:
            self.state.touch(outbox=True)

    def _target_failed(self, target: Target) -> None:
        if self.observer is not None:
            self.observer.target_failed(target)

    def save(self, force: bool = False) -> None:
        """Write the state file; a failure is warned about once and survived (retried next time)."""
        self.state.save(
            lambda: {"runs": self.roster.to_state(), "outbox": self.delivery.to_state()}, self.delivery.compact_journal
        )

    # --- loop ----------------------------------------------------------------------------
    def run(self, interval_s: float = INTERVAL_S, once: bool = False) -> None:
        """Poll every `interval_s` until `stop` is set (or once); on stop, exit within one
        interval: what a slow endpoint has not taken by then stays in the outbox."""
        self._once = once
        try:
            if once:
                self.poll_once(final=True)
                while self.backlog and not self.stop.is_set():  # read every backlog, fairly
                    self.poll_once(final=True, discover=False)
                self._drain(self.stop, _ONCE_DRAIN_S)
                return
            found_at = 0.0
            self.roster.asks = BackgroundAsk(interval_s)
            while not self.stop.is_set():
                # a pass that only goes on with backlogs finds no new runs (a big root is walked once an interval)
                look = not self.backlog or time.monotonic() - found_at >= interval_s
                if look:
                    found_at = time.monotonic()
                self.poll_once(discover=look)
                if not self.backlog:
                    self.stop.wait(interval_s)
        finally:
            if self.roster.asks is not None:
                self.roster.asks.close()
            self.close(timeout_s=interval_s)

    def _drain(self, stop: threading.Event, timeout_s: float | None) -> None:
        """--once: wait for the asynchronous targets' outcomes (bounded by their own retries)."""
        self._outbox_touched(self.delivery.drain(stop, timeout_s))

    def _summary(self, kept: int) -> str:
        """The last line: why the watcher stops and what it did in this session."""
        why = self.stop_reason or ("the --once pass is done" if self._once else "closed")
        return stopped_line(why, len(self.roster.seen), self.records_read, self.delivery.fates(kept))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            self._outbox_touched(self.delivery.close_asynchronous(deadline))
            pending = self.delivery.pending()
            if pending:
                self.delivery.lost += 0 if self.state.path else pending
                self.say(pending_line(pending, self.state.path))
            self.save()
            if self.reports is not None:
                self.reports.refresh_at_stop(self.runs, self.roster.name, time.monotonic() + timeout_s)
            self.say(self._summary(pending if self.state.path else 0))
        finally:
            for run in self.runs.values():
                run.close()
            self.delivery.close_synchronous(deadline)
            self.state.release()
