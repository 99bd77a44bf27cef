"""The runs a watcher follows, and what it knows of the others: a look finds the runs under
the roots (`find_runs`), starts the new ones (resumed from the state file when it knows them),
leaves alone the retired and unhealthy ones whose files did not change, and forgets the runs
whose files are gone for long; `read` gives a pass one chunk of a run's log. A problem with one
run (not a log, unreadable, a reader's bug) is that run's: said once with the run named, the run
left alone until its files change; it is never the watcher's exit."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from .._core.errors import NummonError
from .._core.text import printable
from .._logs.discovery import RunSpec, find_runs, root_is_here
from .._logs.keymap import KeyMap
from .._logs.read_mlflow import MlflowError, is_mlflow_source
from .._logs.readers import make_follower
from .._policy.policy import Policy
from .announce import forgot_line, started_lines, watching_lines
from .notices import RunIncident
from .output import Target
from .remote import BackgroundAsk, RemoteFollower
from .reports import RunMemory, WatchReports
from .runpaths import gone_since, run_name, signature, under
from .runs import WatchedRun
from .saving import StateSaver
from .settings import WatchSettings
from .state import runs_state

__all__ = ["Roster"]


class Roster:
    """The watched runs (`runs`), the unhealthy ones and problem lines said (`bad`), the saved
    states of runs not followed now (`saved_runs`), and since when runs' files are gone."""

    def __init__(
        self,
        roots: list[str],
        policy: Policy,
        targets: list[Target],
        saved_runs: dict[str, dict[str, Any]],
        state: StateSaver,
        say: Callable[[str], None],
        settings: WatchSettings,
        *,
        exclude: Collection[str] = frozenset(),
        observer: Any = None,
        reports: WatchReports | None = None,
    ) -> None:
        self.roots, self.policy, self.targets, self.state, self.say = roots, policy, targets, state, say
        self.format, self.keymap, self.exclude = settings.format, settings.keymap or KeyMap(), exclude
        self.observer = observer  # metrics.MetricsObserver: told of each run started and retired
        self.shard = settings.shard  # shard.Shard: only the runs whose stable hash falls in this shard
        self.poll_bytes = settings.poll_bytes  # the most one run's log gives a pass (base.POLL_BYTES): others get turns
        self.reports = reports
        self.runs: dict[str, WatchedRun] = {}
        self.bad: dict[str, Any] = {}  # unhealthy runs (and problem lines) -> their files' signature then
        self.saved_runs = saved_runs  # retired or not yet seen again
        # runs whose files were not found: since when (wall-clock seconds, kept in the state file)
        self.forget_after_s = settings.forget_after_s
        self.wall_clock = time.time  # a test may put its own clock here
        self.gone_since = gone_since(saved_runs)
        self.retired_sig: dict[str, tuple] = {}
        self.specs: dict[str, RunSpec] = {}
        self.seen: set[str] = set()  # runs picked up in this session
        self.asks: BackgroundAsk | None = None  # live: remote sources are asked on their own threads
        self._announced = False
        self._said: dict[str, str] = {}
        self._empty_roots: set[str] = set()

    def to_state(self) -> dict[str, Any]:
        """The state file's `runs`."""
        return runs_state(self.saved_runs, self.runs, self.gone_since)

    def name(self, run_id: str) -> str:
        """The run's short name below its root."""
        return run_name(run_id, self.roots)

    def problem(self, line: str) -> None:
        """A problem line (a root, a file, a server): said once, until it is a new one."""
        if line not in self.bad:
            self.bad[line] = None
            self.say(line)

    def discover(self) -> None:
        """Find the runs under the roots; start the new ones and those whose files changed."""
        found, problems = find_runs(self.roots, self.format, roots=True, exclude=self.exclude, ask=self.asks)
        specs = {spec.id: spec for spec in found}
        started: list[tuple[RunSpec, bool]] = []
        if self.shard is not None:
            specs = self.shard.select(specs, self.roots)
        for p in problems:
            self.problem(p)
        self.specs = specs
        for run_id, spec in specs.items():
            for rid in set(spec.covered) & set(self.runs):  # the same run's other log, read until its own appeared
                self.retire(rid, keep=False)
                self.say(printable(f"run {self.name(rid)}: the same run as {self.name(run_id)}"))
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

    def read(self, run_id: str, run: WatchedRun, final: bool, stop: Any) -> list[RunIncident] | None:
        """One bounded chunk of the run's log through its detectors: the events it caused, or
        None when it could not be read (said once; the run asked again, or marked unhealthy)."""
        try:
            return run.poll(final=final, stop=stop, chunks=1)
        except MlflowError as e:  # the tracking server is away: like an unreadable file, asked again next pass
            self.notes(run)
            self.problem(f"{e}; asked again at each poll")  # the words discovery uses: said once for both
            return None
        except (NummonError, OSError) as e:  # not a log (any more), a FIFO swapped in, a missing extra
            why = str(e)
        except Exception as e:  # a reader's bug is that run's problem, never the watcher's exit
            why = (
                f"run {run_id}: could not be read ({type(e).__name__}: {str(e)[:200]}); "
                "marked unhealthy, the other runs are watched"
            )
        self.notes(run)
        self.retire(run_id, keep=False)
        self.unhealthy(run_id, why)
        return None

    def notes(self, run: WatchedRun) -> None:
        """Say the run's warnings (its reader's and its detectors')."""
        for line in run.follower.notes + run.notes:
            self.say(line)
        run.follower.notes.clear()
        run.notes.clear()

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
                    self.state.touch()
                continue  # found, or its root is away (an unmounted share): nothing is forgotten
            if self.shard is not None and not self.shard.owns(rid, self.roots):
                continue  # another shard's
            since = self.gone_since.setdefault(rid, now)
            if since == now:
                self.state.touch()
            if now - since >= self.forget_after_s:
                if rid in self.runs:
                    self.retire(rid, keep=False)
                self.saved_runs.pop(rid, None)
                self.retired_sig.pop(rid, None)
                self.gone_since.pop(rid, None)
                forgotten.append(rid)
        if forgotten:
            self.state.touch(outbox=True)  # saved at the end of this pass
            self.say(forgot_line(forgotten, self.forget_after_s, self.roots))

    def _name_started(self, started: list[tuple[RunSpec, bool]], first: bool) -> None:
        self.seen.update(spec.id for spec, _ in started)
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
            self.unhealthy(spec.id, str(e), spec)
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
                self.say_once(
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

    def unhealthy(self, run_id: str, why: str, spec: RunSpec | None = None) -> None:
        """Name the run's problem once; leave it alone until its files change (then try it
        again, and say its problem again only if it is a new one)."""
        self.bad[run_id] = signature(spec or self.specs.get(run_id))
        self.say_once(f"run:{run_id}", why if run_id in why else f"run {run_id}: {why}")

    def say_once(self, key: str, line: str) -> None:
        if self._said.get(key) != line:
            self._said[key] = line
            self.say(line)

    def retire(self, run_id: str, keep: bool = True) -> None:
        """Stop following the run (with `keep`: its state kept, woken when its files change)."""
        run = self.runs.pop(run_id)
        if self.observer is not None:
            self.observer.run_retired(run_id)
        for t in self.targets:
            t.run_retired(run_id)
        if keep:
            self.saved_runs[run_id] = run.to_state()
            self.retired_sig[run_id] = signature(self.specs.get(run_id))
            if self.reports is not None:
                self.reports.refresh(run, self.name(run_id))  # the run ended: its whole page
        run.close()
