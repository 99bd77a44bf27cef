"""The watcher's state file: each run's read position, incident state and recent records (to
re-warm its detectors), plus events not yet known to be sent. Written atomically (temp file in
the same folder + fsync + os.replace), so a crash leaves the previous or the new state."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from .._errors import NummonError
from .._json import dumps

__all__ = ["StateFile", "STATE_VERSION"]

STATE_VERSION = 1


class StateFile:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def load(self) -> dict[str, Any]:
        """The saved state ({} with no path or no file yet); NummonError when it is unreadable."""
        if not self.path or not os.path.exists(self.path):
            return {"version": STATE_VERSION, "runs": {}, "outbox": []}
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise NummonError(f"--state {self.path}: cannot read the state file ({e})") from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or not isinstance(data.get("runs"), dict):
            raise NummonError(f"--state {self.path}: not a nummon watch state file (version {STATE_VERSION})")
        data.setdefault("outbox", [])
        return data

    def save(self, data: dict[str, Any]) -> None:
        if not self.path:
            return
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".nummon-watch-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(dumps({**data, "version": STATE_VERSION}))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
