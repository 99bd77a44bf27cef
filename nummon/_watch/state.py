"""The watcher's state file: each run's read position, incident state and recent records (to
re-warm its detectors), plus events not yet delivered to every target (the outbox). Written
atomically (temp file in the same folder + fsync + os.replace), so a crash leaves the previous or
the new state. One watcher per state file: a lock file beside it holds the owner's PID; it is
opened with O_NOFOLLOW and must be a regular file (a symbolic link there is refused, never
followed: its target would be truncated). A state
file whose fields have the wrong types is refused at start (one line naming the field)."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from .._core.errors import NummonError
from .._core.files import write_atomic
from .._core.json import dumps
from .._logs.fs import MAX_READ

__all__ = ["StateFile", "STATE_VERSION", "runs_state"]

STATE_VERSION = 1
_LINKED = "--state {path}: {lock} is a symbolic link; refused (the lock file is written: remove the link)"
_INT_FIELDS = ("offset", "lineno", "count", "rows", "records", "number", "opened_step", "quiet_since")


def runs_state(saved: dict[str, dict[str, Any]], live: dict[str, Any], gone: dict[str, float]) -> dict[str, Any]:
    """The state file's `runs`: the saved (retired, not seen again) runs' states, the live runs'
    own (`to_state()`), each with the wall-clock time its files went missing when they did."""
    runs = dict(saved)
    runs.update({rid: r.to_state() for rid, r in live.items()})
    for rid, since in gone.items():
        if rid in runs:
            runs[rid] = {**runs[rid], "gone_since": since}
    return runs


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(obj: Any, where: str) -> None:
    """Types of the fields a reader will trust: integers where offsets and counts go, lists and
    mappings where they are expected (recursively)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            here = f"{where}.{k}"
            if k in _INT_FIELDS and not (_is_int(v) and v >= 0):
                raise ValueError(f"{here} must be a non-negative integer, got {json.dumps(v)[:40]}")
            if k in ("last_step", "step") and v is not None and not _is_int(v):
                raise ValueError(f"{here} must be an integer or null, got {json.dumps(v)[:40]}")
            if k in ("first", "history", "pending") and not isinstance(v, list):
                raise ValueError(f"{here} must be a list, got {type(v).__name__}")
            if k in ("position", "incident", "files", "mark", "event") and not isinstance(v, dict) and v is not None:
                raise ValueError(f"{here} must be a mapping, got {type(v).__name__}")
            if k in ("first", "history") and not all(isinstance(r, dict) for r in v):
                raise ValueError(f"{here} must hold records (mappings)")
            if isinstance(v, (dict, list)) and k not in ("first", "history"):
                _check(v, here)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check(v, f"{where}[{i}]")


class StateFile:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock_fd: int | None = None

    def own_files(self) -> set[str]:
        """The state file, its lock and its delivery journal, absolute (empty without a state file)."""
        if not self.path:
            return set()
        return {os.path.abspath(f"{self.path}{suffix}") for suffix in ("", ".lock", ".delivered")}

    @property
    def journal_path(self) -> str | None:
        """The delivery journal: the deliveries made since the state file was last written."""
        return f"{self.path}.delivered" if self.path else None

    @property
    def lock_path(self) -> str | None:
        return f"{self.path}.lock" if self.path else None

    def acquire(self) -> None:
        """Take the state file's lock; NummonError naming the other watcher's PID when it is held."""
        if not self.path:
            return
        folder = os.path.dirname(os.path.abspath(self.path))
        lock_path = self.lock_path
        assert lock_path is not None  # there is a lock path whenever there is a path
        try:
            os.makedirs(folder, exist_ok=True)
            if os.path.lexists(self.path) and not os.path.isfile(self.path):
                raise NummonError(f"--state {self.path}: not a regular file")
            if os.path.islink(lock_path):
                raise NummonError(_LINKED.format(path=self.path, lock=self.lock_path))
            # never through a link (the lock file is truncated and written: a link's target would be)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(lock_path, flags, 0o644)
        except NummonError:
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:  # a link put there between the check and the open
                raise NummonError(_LINKED.format(path=self.path, lock=self.lock_path)) from None
            raise NummonError(f"--state {self.path}: cannot use this path ({e.strerror or e})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NummonError(f"--state {self.path}: {self.lock_path} is not a regular file; refused (remove it)")
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock (Windows): no protection, as before
            pass
        except OSError:
            try:
                other = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise NummonError(
                f"--state {self.path}: in use by another nummon watch (pid {other}); one watcher per state file"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            try:
                os.close(self._lock_fd)  # closing drops the lock; the file stays (no unlink race)
            finally:
                self._lock_fd = None

    def load(self) -> dict[str, Any]:
        """The saved state ({} with no path or no file yet); NummonError when it is unreadable."""
        if not self.path or not os.path.lexists(self.path):
            return {"version": STATE_VERSION, "runs": {}, "outbox": []}
        if not os.path.isfile(self.path):
            raise NummonError(f"--state {self.path}: not a regular file")
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_READ + 1)
            if len(raw) > MAX_READ:
                raise NummonError(
                    f"--state {self.path}: larger than {MAX_READ >> 20} MiB, not a nummon watch state file"
                )
            data = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise NummonError(f"--state {self.path}: cannot read the state file ({str(e)[:120]})") from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or not isinstance(data.get("runs"), dict):
            raise NummonError(f"--state {self.path}: not a nummon watch state file (version {STATE_VERSION})")
        data.setdefault("outbox", [])
        try:
            if not isinstance(data["outbox"], list):
                raise ValueError(f"outbox must be a list, got {type(data['outbox']).__name__}")
            for i, item in enumerate(data["outbox"]):
                if not isinstance(item, dict) or not isinstance(item.get("event", item).get("id"), str):
                    raise ValueError(f"outbox[{i}] must be an event (a mapping with an id)")
            for run_id, run in data["runs"].items():
                if not isinstance(run, dict):
                    raise ValueError(f"runs[{json.dumps(run_id)}] must be a mapping, got {type(run).__name__}")
                _check(run, f"runs[{json.dumps(run_id)}]")
            _check(data["outbox"], "outbox")
        except ValueError as e:
            raise NummonError(f"--state {self.path}: not a usable state file ({e})") from None
        return data

    def save(self, data: dict[str, Any]) -> None:
        """Write atomically; OSError when it cannot (the caller goes on in memory)."""
        if not self.path:
            return
        write_atomic(self.path, dumps({**data, "version": STATE_VERSION}), durable=True)
