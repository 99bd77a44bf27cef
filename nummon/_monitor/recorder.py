"""The flight recorder and the run folder it writes into."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from .._core.files import write_atomic
from .._core.json import dumps
from .._core.types import Alert, Health, StepRecord

__all__ = ["FlightRecorder", "FlightRecords", "RunFolder"]

log = logging.getLogger("nummon")


class RunFolder:
    """Where a run's own files go, resolved once, on first use: the policy's
    `recorder.directory`, else the Monitor's `run_dir`, else the first JSONL log's folder, else a
    new `nummon-runs/<timestamp>/` (announced once)."""

    def __init__(
        self, directory: str | os.PathLike[str] | None, run_dir: str | os.PathLike[str] | None, sinks: Iterable[Any]
    ) -> None:
        self._explicit = directory if directory is not None else run_dir
        self._sinks = list(sinks)
        self._path: Path | None = None

    @property
    def known(self) -> Path | None:
        """The folder if the user named one (directly or through a JSONL log), else None."""
        if self._explicit is not None:
            return Path(self._explicit)
        log_sink = next((s for s in self._sinks if s.durable), None)  # a durable event log names its `path`
        return log_sink.path.parent if log_sink is not None else None

    def path(self) -> Path:
        if self._path is None:
            known = self.known
            if known is None:
                known = Path("nummon-runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
                log.warning("nummon: no run folder given (Monitor(run_dir=...) or a JsonlSink); writing to %s", known)
            self._path = known
        return self._path


class FlightRecorder:
    """A ring buffer of the last N steps' statistics, dumped to JSON on the first critical alert."""

    def __init__(self, steps: int) -> None:
        # records are kept as they are and turned into dicts only when read (rarely)
        self._ring: deque[tuple[StepRecord, Health | None]] = deque(maxlen=steps)

    def add(self, rec: StepRecord, health: Health | None) -> None:
        self._ring.append((rec, health))

    @property
    def records(self) -> list[dict[str, Any]]:
        """The kept steps, oldest first, as plain dicts."""
        return [{**rec.to_dict(), "health": health.value if health else None} for rec, health in self._ring]

    def dump(self, path: Path, alert: Alert) -> Path:
        """Write the record atomically (a temporary file, then a rename); on failure (a full
        disk, a file-size limit) the temporary file is removed and the error raised."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, dumps({"alert": alert.to_dict(), "records": self.records}, indent=1), durable=True)
        return path


class FlightRecords:
    """The one place flight records are named and written: the first critical alert's
    (`nummon-flight-record-step<S>.json`) and each rollback's (`...-step<S>-rollback<N>.json`),
    with `-rank<R>` under torch.distributed, into the run folder."""

    def __init__(
        self, recorder: FlightRecorder, folder: RunFolder, *, enabled: bool = True, rank: int | None = None
    ) -> None:
        self.recorder = recorder
        self.folder = folder
        self.enabled = enabled  # policy recorder.write
        self._suffix = f"-rank{rank}" if rank is not None else ""
        self._failed_in: set[Path] = set()  # folders a write already failed in: said once each

    def write(self, alert: Alert, rollback: int | None = None) -> Path | None:
        """Write the trajectory up to `alert`; its path, or None when writing is off or failed
        (logged: a flight record never stops training)."""
        if not self.enabled:
            return None
        tag = f"-rollback{rollback}" if rollback is not None else ""
        name = f"nummon-flight-record-step{alert.step}{tag}{self._suffix}.json"
        folder = self.folder.path()
        try:
            return self.recorder.dump(folder / name, alert)
        except OSError as e:
            if folder not in self._failed_in:  # a read-only folder fails every time: once per folder
                self._failed_in.add(folder)
                log.warning(
                    "nummon: could not write the %sflight record: %s (not said again for %s)",
                    "rollback " if rollback is not None else "",
                    e,
                    folder,
                )
            return None
