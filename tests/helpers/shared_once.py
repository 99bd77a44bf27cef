"""A module fixture's costly value computed once per test session, not once per xdist worker.

`pytest -n 2 --dist worksteal` spreads one module's tests over both workers, and a module-scoped
fixture then runs in each (the demo's real run, 11-13 s; the real-log scorer, 10 s). The first
worker to ask computes the value under a file lock in the session's shared temporary folder and
pickles it there; the other waits for the lock and loads it. Values must be picklable, and any
files they name must be read, not changed, by the tests that share them.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["once_per_session"]


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """`make(folder)` run once for the session (its files go into `folder`); its value."""
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's folder is popen-gwN inside the session's own folder
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / f"shared-{name}"
    with open(shared / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        done = folder / "value.pickle"
        if done.exists():
            return pickle.loads(done.read_bytes())
        folder.mkdir(exist_ok=True)
        value = make(folder)
        part = folder / "value.pickle.part"
        part.write_bytes(pickle.dumps(value))
        part.replace(done)
        return value
