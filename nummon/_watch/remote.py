"""Remote sources polled off the watcher's own path: each remote run (an MLflow run) is read by
its own thread, which hands what it read (records, notes, the read position after them, or the
error) over a bounded queue. The watcher takes what is there and never waits, so a stalled or
slow tracking server delays only its own run, never the local runs' alerts nor the others."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .._core.types import StepRecord
from .._logs.follow import Follower

__all__ = ["BackgroundAsk", "RemoteFollower"]

_QUEUE = 4  # batches held at most: a watcher that falls behind makes the thread wait, memory stays bounded


class _Batch:
    """One poll's outcome: its records, the follower's notes, and its position after them."""

    __slots__ = ("records", "notes", "position", "error")

    def __init__(self, records: list[StepRecord], notes: list[str], position: Any, error: BaseException | None):
        self.records, self.notes, self.position, self.error = records, notes, position, error


class RemoteFollower(Follower):
    """A Follower that reads another (`inner`, not thread-safe) on a thread of its own, every
    `interval_s` seconds (at once while it has a backlog). `poll` returns at once with every
    record handed over since the last call, and raises the error a poll of the thread met (the
    thread goes on asking). `position` is the position after the records handed over, so a saved
    state never skips a record still in the queue."""

    def __init__(self, inner: Follower, interval_s: float) -> None:
        super().__init__(inner.path, inner.keymap)
        self.inner = inner
        self.format = inner.format
        self.interval_s = interval_s
        self._queue: queue.Queue[_Batch] = queue.Queue(maxsize=_QUEUE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: BaseException | None = None
        self._position: Any = inner.position()  # read here, before the thread owns `inner`

    def poll(self, final: bool = False) -> list[StepRecord]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"nummon-remote {self.path[:60]}", daemon=True)
            self._thread.start()
        if self._held is not None:  # an error met after records handed over by the last call
            error, self._held = self._held, None
            raise error
        out: list[StepRecord] = []
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return out
            self.notes.extend(batch.notes)
            if batch.error is not None:
                if not out:
                    raise batch.error
                self._held = batch.error  # the records before it first
                return out
            out.extend(batch.records)
            self._position = batch.position

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                records, error = self.inner.poll(final=False), None
            except Exception as e:  # handed to the watcher, which names it and asks again
                records, error = [], e
            notes, self.inner.notes[:] = list(self.inner.notes), []
            batch = _Batch(records, notes, None if error else self.inner.position(), error)
            if records or notes or error is not None:
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            if error is not None or not self.inner.more:
                self._stop.wait(self.interval_s)
        self.inner.close()

    def position(self) -> dict[str, Any]:
        return self._position

    def restore(self, pos: dict[str, Any]) -> None:
        self.inner.restore(pos)  # before the thread starts (the watcher restores right after making it)
        self._position = self.inner.position()

    def close(self) -> None:
        """Stop the thread; a request it is waiting on is abandoned (the thread is a daemon and ends
        when the request's own deadline does), never waited for."""
        self._stop.set()
        if self._thread is None:
            self.inner.close()


class BackgroundAsk:
    """Questions to remote servers (an MLflow root's search for its runs) asked on threads, one
    per key, again every `interval_s`: `latest` returns at once with the last answer (None before
    the first) and the error of the last try (None when it answered)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[Any, BaseException | None]] = {}
        self._threads: dict[str, threading.Thread] = {}

    def latest(self, key: str, ask: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        if key not in self._threads:
            t = threading.Thread(target=self._loop, args=(key, ask), name=f"nummon-ask {key[:60]}", daemon=True)
            self._threads[key] = t
            t.start()
        with self._lock:
            return self._answers.get(key, (None, None))

    def _loop(self, key: str, ask: Callable[[], Any]) -> None:
        while not self._stop.is_set():
            try:
                answer: tuple[Any, BaseException | None] = (ask(), None)
            except Exception as e:  # said by the caller, asked again
                answer = (self._answers.get(key, (None, None))[0], e)
            with self._lock:
                self._answers[key] = answer
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()  # a question in flight is abandoned, never waited for
