"""The report a live Monitor writes into its run folder: on the step an incident reaches
critical (and goes non-finite), from what the Monitor holds in memory (its flight recorder's
last steps, every alert and incident event: bounded, whatever the run's length), and at close
from the whole event log when the folder has one. Never on a healthy step; a failure to write
is a warning, never an error in training."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._engine.incidents import escalated_to_critical
from . import _version
from .load import EVENT_LOG, from_monitor, load_run, read_flight_records
from .page import render

__all__ = ["LiveReport", "escalated_to_critical"]

_log = logging.getLogger("nummon")
NAME = "nummon-report.html"


class LiveReport:
    """Writes `nummon-report.html` into the run folder; `last_s` is what the last write cost (s)."""

    def __init__(self, folder: Callable[[], Path], version: str = "") -> None:
        self._folder = folder
        self._version = version or _version()
        self.path: Path | None = None
        self.last_s: float | None = None
        self._failed = False

    def from_memory(
        self, records: list[dict[str, Any]], alerts: Iterable[Any], incidents: Iterable[Any]
    ) -> Path | None:
        """The report of what the Monitor holds now (Alert / IncidentEvent objects or dicts)."""

        def write() -> str:
            folder = self._folder()
            run = from_monitor(
                str(folder),
                records,
                [_dict(a) for a in alerts],
                [_dict(e) for e in incidents],
                read_flight_records(folder) if folder.is_dir() else [],
            )
            return render(run, self._version)

        return self._write(write)

    def from_folder(self, fallback: Callable[[], Path | None]) -> Path | None:
        """The report of the whole event log in the run folder; `fallback()` when it has none."""
        folder = self._folder()
        if not (folder / EVENT_LOG).is_file():
            return fallback()
        return self._write(lambda: render(load_run(folder, detect=False), self._version))

    def _write(self, make: Callable[[], str]) -> Path | None:
        from . import write_html

        t0 = time.perf_counter()
        try:
            html = make()
            folder = self._folder()
            folder.mkdir(parents=True, exist_ok=True)
            self.path = write_html(html, folder / NAME)
        except Exception as e:  # noqa: BLE001  (a report is never worth a failed training step)
            if not self._failed:
                _log.warning("nummon: could not write the incident report (%s: %s)", type(e).__name__, e)
            self._failed = True
            return None
        self.last_s = time.perf_counter() - t0
        return self.path


def _dict(obj: Any) -> dict[str, Any]:
    return obj if isinstance(obj, dict) else obj.to_dict()
