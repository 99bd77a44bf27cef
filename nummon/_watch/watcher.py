"""The watch loop: discover runs under the roots, poll each, notify incident events, keep the
state file, retire idle runs, stop cleanly on a signal.

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
from collections.abc import Collection
from typing import IO, Any

from .._core.display import printable
from .._core.errors import NummonError
from .._logs.discovery import RunSpec, find_runs, root_is_here
from .._logs.keymap import KeyMap
from .._logs.read_mlflow import MlflowError, is_mlflow_source
from .._logs.readers import make_follower
from .._policy.policy import Policy
from .announce import forgot_line, pending_line, started_lines, stopped_line, watching_lines
from .delivery import Delivery
from .notices import Notice, RunIncident
from .output import CLOSE_TIMEOUT_S, Target
from .remote import BackgroundAsk, RemoteFollower
from .reports import RunMemory, WatchReports
from .runpaths import gone_since, run_name, signature, under
from .runs import WatchedRun
from .state import StateFile, runs_state

__all__ = ["Watcher"]

#: Seconds between polls (and between state-file saves) unless told otherwise.
INTERVAL_S = 5.0
#: Seconds without a new record after which a run is retired (its state kept; it wakes on a change).
IDLE_TIMEOUT_S = 1800.0

_ONCE_DRAIN_S = 120.0  # --once waits this long at most for slow endpoints (then: kept or lost, said)
FORGET_AFTER_S = 24 * 3600.0  # a run whose files are gone this long (wall clock, across restarts) is forgotten


class Watcher:
    def __init__(
        self,
        roots: list[str],
        policy: Policy,
        targets: list[Target],
        format: str | None = None,
        keymap: KeyMap | None = None,
        state_path: str | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        state_every_s: float = INTERVAL_S,
        errors: IO[str] | None = None,
        exclude: Collection[str] = frozenset(),
        observer: Any = None,
        shard: Any = None,
        poll_bytes: int | None = None,
        forget_after_s: float = FORGET_AFTER_S,
    ) -> None:
        self.roots = roots
        self.observer = observer  # metrics.MetricsObserver: runs, records, polls, failures
        self.shard = shard  # shard.Shard: only the runs whose stable hash falls in this shard
        self.poll_bytes = poll_bytes  # the most one run's log gives a pass (base.POLL_BYTES): others get turns
        self.backlog = False  # some run had more to read than one pass reads: the next pass comes at once
        self.passes = 0
        self.policy = policy
        self.state = StateFile(state_path)
        self.delivery = Delivery(targets, self.say, self._target_failed, self.state.journal_path)
        self.targets = self.delivery.targets  # the JSONL record of events first
        self.format = format
        self.keymap = keymap or KeyMap()
        self.idle_timeout_s = idle_timeout_s
        self.state_every_s = state_every_s
        self.errors = errors or sys.stderr
        self.exclude = set(exclude) | self.state.own_files()  # the state file is never a run
        self.runs: dict[str, WatchedRun] = {}
        self.bad: dict[str, Any] = {}  # unhealthy runs (and problem lines) -> their files' signature then
        self.stop = threading.Event()
        saved = self._load_state()
        self.saved_runs: dict[str, dict[str, Any]] = saved["runs"]  # retired or not yet seen again
        # runs whose files were not found: since when (wall-clock seconds, kept in the state file)
        self.forget_after_s = forget_after_s
        self.wall_clock = time.time
        self.gone_since = gone_since(self.saved_runs)
        self.retired_sig: dict[str, tuple] = {}
        self.specs: dict[str, RunSpec] = {}
        self.delivery.load(saved.get("outbox", []))
        self._last_save = 0.0
        self._dirty = self._outbox_changed = False
        self._state_failed: str | None = None
        self._announced = False
        self._once = False
        self._said: dict[str, str] = {}
        self._empty_roots: set[str] = set()
        self.records_read = 0  # step records read in this session, all runs
        self.stop_reason: str | None = None  # set with `stop` by whoever stops the loop ("SIGTERM")
        self._seen: set[str] = set()  # runs picked up in this session
        # incident reports beside the state file (reports.py: on critical, at retire and stop)
        self.reports = WatchReports.beside(state_path, say=self.say) if state_path and policy.report.enabled else None
        self.asks: BackgroundAsk | None = None  # live (set by `run`): remote sources are asked on their own threads

    def _load_state(self) -> dict[str, Any]:
        """Lock the state file and read it (the lock is let go again when it cannot be read)."""
        self.state.acquire()
        try:
            return self.state.load()
        except BaseException:
            self.state.release()
            raise

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

    # --- discovery ---------------------------------------------------------------------
    def discover(self) -> None:
        found, problems = find_runs(self.roots, self.format, roots=True, exclude=self.exclude, ask=self.asks)
        specs = {spec.id: spec for spec in found}
        started: list[tuple[RunSpec, bool]] = []
        if self.shard is not None:
            specs = self.shard.select(specs, self.roots)
        for p in problems:
            if p not in self.bad:
                self.bad[p] = None
                self.say(p)
        self.specs = specs
        for run_id, spec in specs.items():
            for rid in set(spec.covered) & set(self.runs):  # the same run's other log, read until its own appeared
                self._retire(rid, keep=False)
                self.say(printable(f"run {run_name(rid, self.roots)}: the same run as {run_name(run_id, self.roots)}"))
            if run_id in self.runs:
                continue
            if run_id in self.bad:
                if self.bad[run_id] == signature(spec):
                    continue  # unhealthy and untouched since: not tried again
                del self.bad[run_id]
            if run_id in self.retired_sig and self.retired_sig[run_id] == signature(spec):
                continue  # retired and untouched since
            revived = run_id in self.retired_sig
            self._start(spec)
            if run_id in self.runs:
                started.append((spec, revived))
        first = not self._announced
        if first:
            self._announce()
        self._name_started(started, first)
        self._forget_gone(specs)

    def _forget_gone(self, specs: dict[str, RunSpec]) -> None:
        """Runs whose files are no longer found under a root that is still there: marked gone
        (the time kept in the state file); after `forget_after_s` their state is dropped (a run
        that comes back later is read from its start; its events keep their ids)."""
        now = self.wall_clock()
        here = [r for r in self.roots if root_is_here(r)]
        forgotten = []
        for rid in list(self.saved_runs) + list(self.runs):
            if rid in specs or not any(under(rid, r) for r in here):
                if self.gone_since.pop(rid, None) is not None:
                    self.saved_runs.get(rid, {}).pop("gone_since", None)
                    self._dirty = True
                continue  # found, or its root is away (an unmounted share): nothing is forgotten
            if self.shard is not None and not self.shard.owns(rid, self.roots):
                continue  # another shard's
            since = self.gone_since.setdefault(rid, now)
            if since == now:
                self._dirty = True
            if now - since >= self.forget_after_s:
                if rid in self.runs:
                    self._retire(rid, keep=False)
                self.saved_runs.pop(rid, None)
                self.retired_sig.pop(rid, None)
                self.gone_since.pop(rid, None)
                forgotten.append(rid)
        if forgotten:
            self._dirty = self._outbox_changed = True  # saved at the end of this pass
            self.say(forgot_line(forgotten, self.forget_after_s, self.roots))

    def _name_started(self, started: list[tuple[RunSpec, bool]], first: bool) -> None:
        self._seen.update(spec.id for spec, _ in started)
        for line in started_lines(started, self.roots, first):
            self.say(line)

    def _announce(self) -> None:
        self._announced = True
        lines, empty = watching_lines(self.specs, self.roots, self.targets, self.bad)
        self._empty_roots.update(empty)
        for line in lines:
            self.say(line)

    def _start(self, spec: RunSpec) -> None:
        try:
            run = WatchedRun(spec.id, self._follower(spec), self.policy)
        except (NummonError, ImportError, OSError) as e:  # not a log, a missing extra, a FIFO
            self._unhealthy(spec.id, str(e), spec)
            return
        if spec.id in self.saved_runs:
            try:
                run.load_state(self.saved_runs[spec.id])
            except (NummonError, ValueError, TypeError, KeyError) as e:
                self.say(f"run {spec.id}: its saved state is not usable ({e}); reading it from the start")
                run.close()
                run = WatchedRun(spec.id, self._follower(spec), self.policy)
        self.retired_sig.pop(spec.id, None)
        if self.reports is not None:
            run.memory = RunMemory()
        self.runs[spec.id] = run
        for hook in ([self.observer] if self.observer is not None else []) + list(self.targets):
            try:
                hook.run_started(run, spec)  # the metrics first, then targets that follow runs
            except Exception as e:  # an observer's bug must not stop the watching
                self._say_once(
                    f"observer:{type(e).__name__}",
                    f"run {spec.id}: an observer failed on its start ({type(e).__name__}: {e})",
                )

    def _follower(self, spec: RunSpec) -> Any:
        """The run's reader, bounded per pass; a remote run's, when live, on a thread of its own."""
        follower = make_follower(spec.id, spec.format, self.keymap)
        if self.poll_bytes:
            follower.poll_bytes = int(self.poll_bytes)
        if self.asks is not None and is_mlflow_source(spec.id):
            return RemoteFollower(follower, self.asks.interval_s)
        return follower

    def _unhealthy(self, run_id: str, why: str, spec: RunSpec | None = None) -> None:
        """Name the run's problem once; leave it alone until its files change (then try it
        again, and say its problem again only if it is a new one)."""
        self.bad[run_id] = signature(spec or self.specs.get(run_id))
        self._say_once(f"run:{run_id}", why if run_id in why else f"run {run_id}: {why}")

    def _say_once(self, key: str, line: str) -> None:
        if self._said.get(key) != line:
            self._said[key] = line
            self.say(line)

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
            self.discover()
        self.passes += 1
        found = 0
        backlog = False
        now = time.monotonic()
        for run_id, run in list(self.runs.items()):
            if self.stop.is_set():
                break
            before = run.records
            events = self._read(run_id, run, final)
            if events is None:
                continue
            backlog = backlog or run.backlog
            self._notes(run)
            self.records_read += max(0, run.records - before)
            if self.reports is not None and events:
                events = self.reports.on_events(run, events, run_name(run_id, self.roots))
            for ev in events:
                self._enqueue(ev)
            found += len(events)
            if run.records != before:
                self._dirty = True
            elif now - run.last_activity > self.idle_timeout_s:
                self._retire(run_id)
        self.backlog = backlog
        if self.reports is not None:
            self.reports.write_due(self.runs, lambda rid: run_name(rid, self.roots))
        if found:
            self.save(force=True)  # write-ahead: a restart knows these were (about to be) sent
        self._deliver()
        if self._outbox_changed or (self._dirty and time.monotonic() - self._last_save >= self.state_every_s):
            self.save()  # what was delivered leaves the saved outbox at once (no resend after a crash)
        return found

    def _read(self, run_id: str, run: WatchedRun, final: bool) -> list[RunIncident] | None:
        """One bounded chunk of the run's log through its detectors: the events it caused, or
        None when it could not be read (said once; the run asked again, or marked unhealthy)."""
        try:
            return run.poll(final=final, stop=self.stop, chunks=1)
        except MlflowError as e:  # the tracking server is away: like an unreadable file, asked again next pass
            self._notes(run)
            line = f"{e}; asked again at each poll"  # the words discovery uses: said once for both
            if line not in self.bad:
                self.bad[line] = None
                self.say(line)
            return None
        except (NummonError, OSError) as e:  # not a log (any more), a FIFO swapped in, a missing extra
            why = str(e)
        except Exception as e:  # a reader's bug is that run's problem, never the watcher's exit
            why = (
                f"run {run_id}: could not be read ({type(e).__name__}: {str(e)[:200]}); "
                "marked unhealthy, the other runs are watched"
            )
        self._notes(run)
        self._retire(run_id, keep=False)
        self._unhealthy(run_id, why)
        return None

    def _notes(self, run: WatchedRun) -> None:
        for line in run.follower.notes + run.notes:
            self.say(line)
        run.follower.notes.clear()
        run.notes.clear()

    def _enqueue(self, ev: RunIncident) -> None:
        ev.name = run_name(ev.run, self.roots)
        self.delivery.add(Notice.from_incident(ev))

    def _deliver(self) -> None:
        """Hand every pending event to every target it is pending for (in event order)."""
        self._outbox_touched(self.delivery.deliver())

    def _settle(self) -> None:
        """Apply the outcomes the asynchronous targets reported; drop events every target has."""
        self._outbox_touched(self.delivery.settle())

    def _outbox_touched(self, changed: bool) -> None:
        if changed:
            self._dirty = self._outbox_changed = True

    def _target_failed(self, target: Target) -> None:
        if self.observer is not None:
            self.observer.target_failed(target)

    def _retire(self, run_id: str, keep: bool = True) -> None:
        run = self.runs.pop(run_id)
        if self.observer is not None:
            self.observer.run_retired(run_id)
        for t in self.targets:
            t.run_retired(run_id)
        if keep:
            self.saved_runs[run_id] = run.to_state()
            self.retired_sig[run_id] = signature(self.specs.get(run_id))
            if self.reports is not None:
                self.reports.refresh(run, run_name(run_id, self.roots))  # the run ended: its whole page
        run.close()

    def save(self, force: bool = False) -> None:
        """Write the state file; a failure is warned about once and survived (retried next time)."""
        if not self.state.path:
            self._dirty = False
            return
        runs = runs_state(self.saved_runs, self.runs, self.gone_since)
        try:
            self.state.save({"runs": runs, "outbox": self.delivery.to_state()})
            self.delivery.compact_journal()
        except OSError as e:
            why = e.strerror or str(e)
            if self._state_failed is None:
                self.say(
                    f"--state {self.state.path}: cannot write the state file ({why}); going on in memory, "
                    "retrying at each poll"
                )
            self._state_failed = why
            self._last_save = time.monotonic()
            return
        if self._state_failed is not None:
            self.say(f"--state {self.state.path}: written again")
            self._state_failed = None
        self._last_save = time.monotonic()
        self._dirty = self._outbox_changed = False

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
            self.asks = BackgroundAsk(interval_s)
            while not self.stop.is_set():
                # a pass that only goes on with backlogs finds no new runs (a big root is walked once an interval)
                look = not self.backlog or time.monotonic() - found_at >= interval_s
                if look:
                    found_at = time.monotonic()
                self.poll_once(discover=look)
                if not self.backlog:
                    self.stop.wait(interval_s)
        finally:
            if self.asks is not None:
                self.asks.close()
            self.close(timeout_s=interval_s)

    def _drain(self, stop: threading.Event, timeout_s: float | None) -> None:
        """--once: wait for the asynchronous targets' outcomes (bounded by their own retries)."""
        self._outbox_touched(self.delivery.drain(stop, timeout_s))

    def _summary(self, kept: int) -> str:
        """The last line: why the watcher stops and what it did in this session."""
        why = self.stop_reason or ("the --once pass is done" if self._once else "closed")
        return stopped_line(why, len(self._seen), self.records_read, self.delivery.fates(kept))

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
                self.reports.refresh_at_stop(
                    self.runs, lambda rid: run_name(rid, self.roots), time.monotonic() + timeout_s
                )
            self.say(self._summary(pending if self.state.path else 0))
        finally:
            for run in self.runs.values():
                run.close()
            self.delivery.close_synchronous(deadline)
            self.state.release()
