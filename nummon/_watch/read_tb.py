"""TensorBoard event directories, read with the tensorboard package's own EventFileLoader:
each poll yields only new events, and a half-written record is read again next poll."""
from __future__ import annotations

import struct
from typing import Any

from .._types import StepRecord
from . import fs
from .base import Follower, NotALogError, StepAssembler

__all__ = ["TensorBoardFollower", "is_event_file", "EVENT_PREFIX"]

EVENT_PREFIX = "events.out.tfevents."


def is_event_file(path: str) -> bool:
    return EVENT_PREFIX in fs.basename(path)


def _tb():
    from .._lazy import require

    require("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.util import tensor_util

    return event_file_loader, tensor_util, masked_crc32c


def check_event_header(path: str) -> None:
    """Raise NotALogError when the first record header fails its CRC (the file is not an event log)."""
    _, _, masked_crc32c = _tb()
    head = fs.read_bytes(path, 0, 12)
    if len(head) == 12 and struct.unpack("<I", head[8:])[0] != masked_crc32c(head[:8]):
        raise NotALogError(f"{path}: not a TensorBoard event file (bad record header)")


class TensorBoardFollower(Follower):
    """One event directory (or one event file): its event files in name (= creation) order."""

    format = "tensorboard"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self._loader_mod, self._tensor_util, _ = _tb()
        self.single = is_event_file(path) and not fs.is_dir(path)
        self.loaders: dict[str, Any] = {}
        self.consumed: dict[str, int] = {}  # events read per file
        self.done: dict[str, int] = {}  # events per file whose steps are all returned
        self.skip: dict[str, int] = {}  # events to pass over after a restore
        self.asm = StepAssembler(self.keymap)
        self._pending_from: str | None = None  # file whose event started the held-back step

    def _files(self) -> list[str]:
        if self.single:
            return [self.path]
        folder = self.path
        out = []
        for f in fs.walk_files(folder, max_depth=1):
            if is_event_file(f) and fs.dirname(f).rstrip("/") == folder.rstrip("/"):
                out.append(f)
        return sorted(out, key=fs.basename)

    def poll(self, final: bool = False) -> list[StepRecord]:
        out: list[StepRecord] = []
        got = False
        files = self._files()
        for i, f in enumerate(files):
            loader = self.loaders.get(f)
            if loader is None:
                if fs.stat(f) is None or fs.stat(f).size < 12:
                    continue
                check_event_header(f)
                loader = self.loaders[f] = self._loader_mod.EventFileLoader(f)
                self.consumed.setdefault(f, 0)
            for event in loader.Load():
                self.consumed[f] += 1
                if self.skip.get(f, 0) > 0:
                    self.skip[f] -= 1
                    continue
                got = True
                row = self._scalars(event)
                if not row:
                    continue
                if self.asm.add(int(event.step), row, out):
                    self._mark_done(files[: i + 1], f, self.consumed[f] - 1)
                self._pending_from = f
        if (not got or final) and self.asm.flush(out):
            self._mark_done(files, None, 0)
        return out

    def _mark_done(self, files: list[str], current: str | None, index: int) -> None:
        for f in files:
            self.done[f] = index if f == current else self.consumed.get(f, 0)

    def _scalars(self, event: Any) -> dict[str, float]:
        row: dict[str, float] = {}
        if not event.HasField("summary"):
            return row
        for v in event.summary.value:
            if self.keymap.field(v.tag) is None:
                continue
            if v.HasField("simple_value"):
                row[v.tag] = float(v.simple_value)
            elif v.HasField("tensor"):
                arr = self._tensor_util.make_ndarray(v.tensor)
                if arr.size == 1:
                    row[v.tag] = float(arr.reshape(-1)[0])
        return row

    def position(self) -> dict[str, Any]:
        return {"done": {fs.basename(f): n for f, n in self.done.items()}, "last_step": self.asm.last_emitted}

    def restore(self, pos: dict[str, Any]) -> None:
        done = pos.get("done") or {}
        for f in self._files():
            n = int(done.get(fs.basename(f), 0))
            if n:
                self.skip[f] = n
                self.done[f] = n
        self.asm.last_emitted = pos.get("last_step")

    def close(self) -> None:
        self.loaders.clear()  # the loaders' readers close their files when collected
