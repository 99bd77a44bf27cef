"""Closing live Monitors at interpreter exit and on SIGTERM, so the event log holds the last
steps of a script that never called `close()` or was stopped by its scheduler."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from typing import Any

__all__ = ["register", "unregister"]

log = logging.getLogger("nummon")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_installed = False


def _close_all() -> None:
    for mon in list(_live):
        try:
            mon.close()
        except Exception as e:  # never turn an exit into a traceback
            log.warning("nummon: closing the monitor at exit failed (%s: %s)", type(e).__name__, e)


def _on_sigterm(signum: int, frame: Any) -> None:
    _close_all()
    # then die of SIGTERM as the process would have without us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def register(monitor: Any, handle_sigterm: bool) -> None:
    """Close `monitor` at exit; on SIGTERM too when `handle_sigterm` and nobody else handles it."""
    global _installed
    _live.add(monitor)
    if _installed:
        return
    _installed = True
    atexit.register(_close_all)
    if handle_sigterm and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or signals unavailable
            pass


def unregister(monitor: Any) -> None:
    _live.discard(monitor)
