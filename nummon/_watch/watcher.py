"""The watch loop: discover runs under the roots, poll each, notify incident events, keep the
state file, retire idle runs, stop cleanly on a signal."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, Any

from .._errors import NummonError
from .._policy import Policy
from .base import NotALogError
from .discovery import RunSpec, discover
from .incidents import RunIncident
from .keymap import KeyMap
from .readers import make_follower
from .runs import WatchedRun
from .state import StateFile

__all__ = ["Watcher"]


class _SavedEvent:
    """An event read back from the state file's outbox (same interface as RunIncident)."""

    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d
        self.run, self.title, self.level = d.get("run"), d.get("title", "nummon: incident"), d.get("level", 1)

    def summary(self) -> str:
        return self._d.get("summary", "")

    def to_dict(self) -> dict[str, Any]:
        return self._d


class Watcher:
    def __init__(
        self,
        roots: list[str],
        policy: Policy,
        targets: list[Any],
        format: str | None = None,
        keymap: KeyMap | None = None,
        state_path: str | None = None,
        idle_timeout_s: float = 1800.0,
        state_every_s: float = 5.0,
        errors: IO[str] | None = None,
        exclude: set[str] = frozenset(),
        observer: Any = None,
        shard: Any = None,
    ) -> None:
        self.roots = roots
        self.policy = policy
        # the JSONL record of events is written before any other target is tried
        self.targets = sorted(targets, key=lambda t: type(t).__name__ != "JsonlTarget")
        self.format = format
        self.keymap = keymap or KeyMap()
        self.state = StateFile(state_path)
        self.idle_timeout_s = idle_timeout_s
        self.state_every_s = state_every_s
        self.errors = errors or sys.stderr
        self.exclude = set(exclude) | ({os.path.abspath(state_path)} if state_path else set())
        self.runs: dict[str, WatchedRun] = {}
        self.bad: set[str] = set()  # runs that are not logs: named once, then left alone
        self.stop = threading.Event()
        saved = self.state.load()
        self.saved_runs: dict[str, dict[str, Any]] = saved["runs"]  # retired or not yet seen again
        self.retired_sig: dict[str, tuple] = {}
        self.specs: dict[str, RunSpec] = {}
        self._outbox = [_SavedEvent(d) for d in saved.get("outbox", [])]
        self._last_save = 0.0
        self._dirty = False
        self.notified = 0
        self.observer = observer  # metrics.MetricsObserver: runs, records, polls, failures
        self.shard = shard  # shard.Shard: only the runs whose stable hash falls in this shard

    def say(self, line: str) -> None:
        self.errors.write(f"nummon watch: {line}\n")
        self.errors.flush()

    # --- discovery ---------------------------------------------------------------------
    def discover(self) -> None:
        specs, problems = discover(self.roots, self.format, self.exclude)
        if self.shard is not None:
            specs = self.shard.select(specs, self.roots)
        for p in problems:
            if p not in self.bad:
                self.bad.add(p)
                self.say(p)
        self.specs = specs
        for run_id, spec in specs.items():
            if run_id in self.runs or run_id in self.bad:
                continue
            if run_id in self.retired_sig and self.retired_sig[run_id] == _signature(spec):
                continue  # retired and untouched since
            self._start(spec)

    def _start(self, spec: RunSpec) -> None:
        try:
            follower = make_follower(spec.id, spec.format, self.keymap)
            run = WatchedRun(spec.id, follower, self.policy)
            if spec.id in self.saved_runs:
                run.load_state(self.saved_runs[spec.id])
        except (NummonError, ImportError) as e:  # not a log, a missing extra, a broken saved state
            self.bad.add(spec.id)
            self.say(str(e))
            return
        self.retired_sig.pop(spec.id, None)
        self.runs[spec.id] = run
        if self.observer is not None:
            self.observer.run_started(run, spec)

    # --- polling -------------------------------------------------------------------------
    def poll_once(self, final: bool = False) -> int:
        """One pass over every run; returns the number of incident events sent."""
        started = time.monotonic()
        try:
            return self._poll_once(final)
        finally:
            if self.observer is not None:
                self.observer.polled(time.monotonic() - started, len(self.runs))

    def _poll_once(self, final: bool = False) -> int:
        if self._outbox:  # sent before a crash, maybe not: targets skip what they already hold
            self._send(self._outbox)
        self.discover()
        events: list[RunIncident] = []
        now = time.monotonic()
        for run_id, run in list(self.runs.items()):
            if self.stop.is_set():
                break
            before = run.records
            try:
                events.extend(run.poll(final=final))
            except NotALogError as e:
                self.bad.add(run_id)
                self.say(str(e))
                self._retire(run_id, keep=False)
                continue
            for note in getattr(run.follower, "notes", [])[:]:
                self.say(note)
            if hasattr(run.follower, "notes"):
                run.follower.notes.clear()
            if run.records != before:
                self._dirty = True
            elif now - run.last_activity > self.idle_timeout_s:
                self._retire(run_id)
        if events:
            self._outbox = events
            self.save(force=True)  # write-ahead: a restart knows these were (about to be) sent
            self._send(events)
        elif self._dirty and now - self._last_save >= self.state_every_s:
            self.save()
        return len(events)

    def _send(self, events: list[Any]) -> None:
        for ev in events:
            for t in self.targets:
                try:
                    t.notify(ev)
                except Exception as e:  # one broken target must not stop the others or the loop
                    self.say(f"notification target {type(t).__name__} failed: {e}")
                    if self.observer is not None:
                        self.observer.target_failed(t)
            self.notified += 1
        self._outbox = []
        self.save(force=True)

    def _retire(self, run_id: str, keep: bool = True) -> None:
        run = self.runs.pop(run_id)
        if self.observer is not None:
            self.observer.run_retired(run_id)
        if keep:
            self.saved_runs[run_id] = run.to_state()
            self.retired_sig[run_id] = _signature(self.specs.get(run_id))
        run.close()

    def save(self, force: bool = False) -> None:
        runs = dict(self.saved_runs)
        runs.update({rid: r.to_state() for rid, r in self.runs.items()})
        self.state.save({"runs": runs, "outbox": [e.to_dict() for e in self._outbox]})
        self._last_save = time.monotonic()
        self._dirty = False

    # --- loop ----------------------------------------------------------------------------
    def run(self, interval_s: float = 5.0, once: bool = False) -> None:
        try:
            if once:
                self.poll_once(final=True)
                return
            while not self.stop.is_set():
                self.poll_once()
                self.stop.wait(interval_s)
        finally:
            self.close()

    def close(self) -> None:
        try:
            self.save()
        finally:
            for run in self.runs.values():
                run.close()
            for t in self.targets:
                try:
                    t.close()
                except Exception as e:
                    self.say(f"notification target {type(t).__name__} did not close: {e}")


def _signature(spec: RunSpec | None) -> tuple:
    """Sizes and mtimes of a run's files: a retired run wakes up when they change."""
    from . import fs

    if spec is None:
        return ()
    return tuple((f, fs.stat(f)) for f in sorted(spec.files))
