"""Closing live Monitors at interpreter exit and on SIGTERM, so the event log holds the last
steps of a script that never called `close()` or was stopped by its scheduler.

The SIGTERM handler runs on the main thread between two bytecodes, possibly in the middle of a
Monitor call there (half a step done, a sink's lock held). So it only sets a flag when the main
thread is inside a Monitor call; that call acts on the flag as it leaves (the safe point). Outside
any Monitor call (a forward, a data loader wait) there is nothing half-done, and it acts at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from typing import Any

__all__ = ["SAFE_POINT", "register", "unregister"]

log = logging.getLogger("nummon")

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_main_ident = threading.main_thread().ident
_depth = 0  # Monitor calls in progress on the main thread (the thread signal handlers run on)
_requested = False  # a SIGTERM arrived while one was in progress


def _close_all() -> None:
    for mon in list(_live):
        try:
            mon.close()
        except Exception as e:  # never turn an exit into a traceback
            log.warning("nummon: closing the monitor at exit failed (%s: %s)", type(e).__name__, e)


def _terminate() -> None:
    """Close every live Monitor, then die of SIGTERM as the process would have without us."""
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _requested
    if _depth:  # inside a Monitor call: only the flag; the call acts on it as it leaves
        _requested = True
        return
    _terminate()


class _SafePoint:
    """Wraps every Monitor call that changes its state: a SIGTERM that arrives within it is acted
    on when it ends (on the main thread; other threads are not interrupted by signals). One
    shared object: entering it costs two Python calls, not a generator's seven."""

    def __enter__(self) -> None:
        global _depth
        if threading.get_ident() == _main_ident:
            _depth += 1

    def __exit__(self, *exc: Any) -> None:
        global _depth, _requested
        if threading.get_ident() != _main_ident:
            return
        _depth -= 1
        if _requested and not _depth:
            _requested = False
            _terminate()


#: `with SAFE_POINT: ...` around a Monitor call
SAFE_POINT = _SafePoint()


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
