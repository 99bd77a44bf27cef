"""The incident reports `nummon watch` writes for the runs it follows: one self-contained HTML
page per run (`nummon report`'s page) in `reports/` beside the state file, written when a run's
incident reaches critical or goes non-finite, and refreshed when the run is retired and when the
watcher stops. Its path goes into the incident event once the page exists (a page that could not be
written is never named), so the console line, the webhook text and
the JSONL record name it (as the Monitor's do).

Cost is bounded whatever the fleet: a page is drawn from what the run holds in memory (never by
reading its log again), at most once per `min_interval_s` per run (a flapping run is written once
and refreshed later), only for runs that reached critical, and the writes at stop get a time
budget (a run left over keeps its last page, and is counted). The memory a page is drawn from is
bounded per run: the detectors' own window of recent records (shared, not copied), a thinned
long view of the drawn signals (`LONG_VIEW` compact points), and every record near an incident
(`NEAR_MAX`), which only runs with an incident hold."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._core.text import plural, printable, raw_bytes
from .._core.types import StepRecord
from .._engine.incidents import escalated_to_critical
from .._report import _version, write_html
from .._report.load import RunData
from .._report.page import SIGNALS, render
from .._report.stream import _new_record
from .notices import RunIncident

__all__ = ["RunMemory", "WatchReports", "REPORTS_DIR"]

REPORTS_DIR = "reports"  # beside the state file
RECENT = 256  # the lead-up kept dense (the engine's own window: the same record objects)
LONG_VIEW = 256  # compact points of the drawn signals over the whole run (stride doubles as it grows)
NEAR_MAX = 4096  # full records kept around incidents (per run)
EVENTS_MAX = 2000  # alerts (and incident events) kept per run; later ones are counted
_DRAWN = tuple(f for f, *_ in SIGNALS)


class RunMemory:
    """What one watched run's report is drawn from; `keep` is called once per record."""

    def __init__(self) -> None:
        self.first: list[StepRecord] = []
        self.recent: deque[StepRecord] = deque(maxlen=RECENT)
        self.long: list[tuple[int, dict[str, float]]] = []  # (step, drawn signals): a strided sample
        self.stride = 1
        self.near: dict[int, StepRecord] = {}
        self.alerts: list[dict[str, Any]] = []
        self.incidents: list[dict[str, Any]] = []
        self.dropped = 0  # alerts and events past EVENTS_MAX
        self.active = False  # an incident is open: every record is kept near it
        self.seen = 0

    def clear(self) -> None:
        """A new segment (the log rewritten, the run re-run): the page draws the new one."""
        self.__init__()  # type: ignore[misc]

    def keep(self, rec: StepRecord, alerts: Any, incidents: Any) -> None:
        if len(self.first) < 32:
            self.first.append(rec)
        if self.seen % self.stride == 0:
            self.long.append((rec.step, {f: v for f in _DRAWN if (v := getattr(rec, f, None)) is not None}))
            if len(self.long) > LONG_VIEW:
                self.long = self.long[::2]  # every other point: the stride doubles
                self.stride *= 2
        self.seen += 1
        for ev in incidents:
            if not self.active and ev.state.active:
                for r in self.recent:  # the lead-up, from the detectors' window
                    self._near(r)
            self.active = ev.state.active
        for src, out in ((alerts, self.alerts), (incidents, self.incidents)):
            for a in src:
                if len(self.alerts) + len(self.incidents) < EVENTS_MAX:
                    out.append(a.to_dict())
                else:
                    self.dropped += 1
        if self.active or alerts:
            self._near(rec)
        self.recent.append(rec)

    def _near(self, rec: StepRecord) -> None:
        if len(self.near) < NEAR_MAX:
            self.near[rec.step] = rec

    def run_data(self, source: str, format: str) -> RunData:
        """The run as the report draws it: full records near incidents and at both ends, the
        long view's points in between."""
        by_step: dict[int, StepRecord] = {s: _new_record({"step": s, **v}) for s, v in self.long}
        for r in [*self.first, *self.near.values(), *self.recent]:
            by_step[r.step] = r
        records = [by_step[s] for s in sorted(by_step)]
        return RunData(
            source, records, list(self.alerts), list(self.incidents), [], format=format, typed=True, total=self.seen
        )


class WatchReports:
    """Writes and refreshes `<folder>/<run name>-<hash>.html` for the watched runs."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        version: str = "",
        min_interval_s: float = 10.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.say = say
        self.version = version or _version()
        self.min_interval_s = min_interval_s
        self.written: dict[str, float] = {}  # run id -> monotonic time of its last write (or try)
        self.pages: dict[str, Path] = {}  # run id -> its page, once one was written
        self.due: set[str] = set()  # runs whose page is older than what they hold (throttled)
        self.writes = 0
        self.failed: str | None = None  # the last failure, said once
        self.clock = time.monotonic

    @classmethod
    def beside(cls, state_path: str, say: Callable[[str], None] | None = None) -> WatchReports:
        """The reports of a watcher whose state file is `state_path`: in REPORTS_DIR beside it."""
        return cls(os.path.join(os.path.dirname(os.path.abspath(state_path)), REPORTS_DIR), say=say)

    def path_for(self, run_id: str, name: str) -> Path:
        """A file name from the run's short name (readable) and a hash of its id (unique)."""
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[-80:] or "run"
        digest = hashlib.blake2b(raw_bytes(run_id), digest_size=4).hexdigest()
        return self.folder / f"{stem}-{digest}.html"

    def on_events(self, run: Any, events: list[RunIncident], name: str) -> list[RunIncident]:
        """`events` of `run`, naming its report when one of them takes it to critical or
        non-finite (the page is written now, or within `min_interval_s` when it was just written)."""
        if not escalated_to_critical(ev.event for ev in events):
            return events
        if self.clock() - self.written.get(run.id, -1e18) >= self.min_interval_s:
            self.write(run, name)
        else:
            self.due.add(run.id)
        page = self.pages.get(run.id)
        if page is None:  # never written (reports/ cannot be made, a full disk): no page to name
            return events
        path = str(page)
        named: set[int] = set()  # incidents that reached critical in this batch: named from then on
        for ev in events:
            if escalated_to_critical([ev.event]):
                named.add(ev.event.number)
            if ev.event.state.active and ev.event.number in named:
                ev.event = replace(ev.event, report=path)
        return events

    def write_due(self, runs: dict[str, Any], names: Any) -> None:
        """Write the throttled pages whose interval has passed (called once a poll pass)."""
        now = self.clock()
        for rid in [r for r in self.due if r in runs and now - self.written.get(r, -1e18) >= self.min_interval_s]:
            self.write(runs[rid], names(rid))

    def refresh(self, run: Any, name: str) -> Path | None:
        """The run's page again, from all it holds now (a retired run, the watcher's stop):
        only for a run that has one."""
        if run.id not in self.written and run.id not in self.due:
            return None
        return self.write(run, name)

    def write(self, run: Any, name: str) -> Path | None:
        self.due.discard(run.id)
        self.written[run.id] = self.clock()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            html = render(run.memory.run_data(run.id, run.follower.format), self.version)
            path = write_html(html, self.path_for(run.id, name))
        except Exception as e:  # noqa: BLE001  (a page is never worth the watching)
            why = f"{type(e).__name__}: {e}"
            if self.failed != why and self.say is not None:
                self.say(f"run {printable(name)}: could not write its incident report ({printable(why)})")
            self.failed = why
            return None
        self.writes += 1
        self.pages[run.id] = path
        return path

    def refresh_at_stop(self, runs: dict[str, Any], names: Any, deadline: float) -> None:
        """The pages of the runs that have one, drawn once more at the watcher's stop, until
        `deadline` (time.monotonic(), s: a run left over keeps its last page, and is counted)."""
        left = 0
        for rid, run in runs.items():
            if rid not in self.written and rid not in self.due:
                continue
            if time.monotonic() >= deadline:
                left += 1
                continue
            self.refresh(run, names(rid))
        if self.writes and self.say is not None:
            self.say(
                f"{plural(len(self.pages), 'incident report')} under {self.folder}"
                + (f" ({left} not refreshed at stop: no time left)" if left else "")
            )
