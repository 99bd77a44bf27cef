"""W&B offline run files (`run-<id>.wandb`): a LevelDB-log framing (32 KiB blocks of CRC'd
chunks) of protobuf `Record`s, decoded with the classes the wandb package ships. Followed by
byte offset in bounded reads; a record whose chunks are not all written yet is read again next
poll. A chunk that fails its checksum is named with its byte offset and reading resumes at the
next 32 KiB block, as the framing is built for; a record with a step that is not an integer or
a value that is not JSON is skipped with a warning."""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any

from .._core.types import StepRecord
from . import fs
from .follow import NotALogError, OneFileFollower, as_step
from .read_tb import _require

__all__ = ["WandbFollower", "is_wandb_file", "wandb_run_files", "WANDB_MAGIC"]

WANDB_MAGIC = b":W&B"
_BLOCK = 32 * 1024
_HEADER = 7  # magic (4) + version (2) + reserved (1); also the size of a chunk header
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MAX_SPAN = 64 * 1024 * 1024  # a record spanning more is skipped, never held


def is_wandb_file(path: str) -> bool:
    name = fs.basename(path)
    return name.startswith("run-") and name.endswith(".wandb")


def wandb_run_files(folder: str) -> list[str]:
    """The W&B run files a folder holds, sorted: its own (`offline-run-*/` holds `run-<id>.wandb`),
    one per run folder in it (a `wandb/` folder), or one per run of its `wandb/` folder (the
    folder `wandb.init(dir=...)` was given). The `latest-run` link is not followed (no run twice)."""
    base = folder.rstrip("/").rstrip(os.sep)
    out = []
    for f in fs.walk_files(folder, max_depth=3):
        parts = f[len(base) :].replace(os.sep, "/").strip("/").split("/")
        if is_wandb_file(f) and (len(parts) <= 2 or (len(parts) == 3 and parts[0] == "wandb")):
            out.append(f)
    return sorted(out)


def _run_file(path: str) -> str:
    """The run file to read: `path` itself, or the one run file of a run folder (NotALogError,
    one line, when the folder holds none or several)."""
    if not fs.is_dir(path):
        return path
    files = wandb_run_files(path)
    if not files:
        raise NotALogError(f"{path}: a folder with no W&B run file (run-<id>.wandb) in it; nothing was read")
    if len(files) > 1:
        raise NotALogError(
            f"{path}: a folder of {len(files)} W&B runs; name one run folder or run file (e.g. {files[-1]})"
        )
    return files[0]


def _pb():
    _require("wandb", "wandb")
    from wandb.proto import wandb_internal_pb2

    return wandb_internal_pb2


class WandbFollower(OneFileFollower):
    format = "wandb"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(_run_file(path), keymap)
        self._pb = _pb()
        self.offset = 0  # at a record boundary (after the file header once read)
        self.count = 0
        self._suspect: int | None = None

    def _restart(self) -> None:
        self.offset = self.count = 0

    def poll(self, final: bool = False) -> list[StepRecord]:
        self.more = False
        st = self._stat()
        if st is None or st.size <= self.offset:
            return []
        size = self.poll_bytes
        while True:
            out, span = self._scan(st, final, size)
            if span and size < _MAX_SPAN:  # one record longer than the read: read further
                size *= 4
                continue
            if span:
                self.note(f"{self.path}: byte {self.offset}: a record spanning more than {_MAX_SPAN >> 20} MiB skipped")
                self.offset = (self.offset // _BLOCK + 1) * _BLOCK
            break
        if self.offset:
            self.mark.take(self.path, self.offset, st)
        return out

    def _scan(self, st: fs.Stat, final: bool, size: int) -> tuple[list[StepRecord], bool]:
        base = self.offset
        data = fs.read_bytes(self.path, base, size)
        pos = self._header(data) if base == 0 else 0
        if pos is None:
            return [], False
        out: list[StepRecord] = []
        buf: bytes | None = None
        while True:
            left = _BLOCK - (base + pos) % _BLOCK
            crc = length = kind = 0  # a block trailer (too short for a chunk header): zero padding
            if left >= _HEADER:
                if pos + _HEADER > len(data):
                    break
                crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
            if length == 0 and kind == 0:  # padding, or the zero-filled rest of a block
                if pos + left > len(data):
                    break
                pos += left
                if buf is None:
                    self.offset = base + pos
                continue
            end = pos + _HEADER + length
            if length <= left - _HEADER and end > len(data):
                break  # chunk still being written
            chunk = data[pos + _HEADER : end]
            if (
                length > left - _HEADER
                or kind not in (_FULL, _FIRST, _MIDDLE, _LAST)
                or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc
            ):
                if not self._skip_corrupt(base + pos, left, final):
                    break
                pos += left  # the framing's resynchronisation point: the next block
                buf = None
                self.offset = base + pos
                continue
            pos = end
            if kind == _FULL:
                payload, buf = chunk, None
            elif kind == _FIRST:
                buf = chunk
                continue
            elif buf is None:  # the rest of a record whose start was corrupt
                self.offset = base + pos
                continue
            elif kind == _MIDDLE:
                buf += chunk
                continue
            else:
                payload, buf = buf + chunk, None
            self.offset = base + pos  # a whole record consumed
            rec = self._record(payload, base + pos)
            if rec is not None:
                out.append(rec)
        self.more = len(data) == size and self.offset > base
        span = buf is not None and self.offset == base and len(data) == size
        if final and not self.more and not span and base + len(data) >= st.size:
            self._note_torn_tail(st, data[self.offset - base :])
        return out, span

    def _header(self, data: bytes) -> int | None:
        """The position after the file header, which is checked (None: not all written yet)."""
        if len(data) < _HEADER:
            return None
        magic, _version = struct.unpack("<4sH", data[:6])
        if magic != WANDB_MAGIC:
            raise NotALogError(f"{self.path}: not a W&B run file (bad magic)")
        self.offset = _HEADER
        return _HEADER

    def _skip_corrupt(self, at: int, left: int, final: bool) -> bool:
        """A chunk at byte `at` that fails its checks, `left` bytes before the next block: False
        the first time it is seen (maybe a torn write, confirmed on the next poll), else said and
        skipped (True)."""
        if not final and self._suspect != at:
            self._suspect = at
            return False
        self._suspect = None
        self.note(
            f"{self.path}: corrupt chunk at byte {at} (bad checksum); skipped to the next block at byte {at + left}"
        )
        return True

    def _note_torn_tail(self, st: fs.Stat, rest: bytes) -> None:
        """At the end of a finished log: bytes after the last whole record that are not padding."""
        if self.offset < st.size and rest.strip(b"\x00"):
            self.note(
                f"{self.path}: last record torn at byte {self.offset} ({st.size - self.offset} bytes; a killed "
                f"writer or a cut copy?); ignored",
                once="torn",
            )

    def _record(self, payload: bytes, at: int) -> StepRecord | None:
        r = self._pb.Record()
        try:
            r.ParseFromString(payload)
        except Exception:  # protobuf's DecodeError: a record of a newer schema; skip it
            return None
        if r.WhichOneof("record_type") != "history":
            return None
        row: dict[str, Any] = {}
        step: Any = None
        for item in r.history.item:
            key = item.key or "/".join(item.nested_key)
            if key != "_step" and self.keymap.field(key) is None:
                continue
            try:
                value = json.loads(item.value_json)  # W&B writes NaN/Infinity literals
            except (ValueError, RecursionError):
                self.note(f"{self.path}: record before byte {at}: {key!r} is not JSON; value skipped", once="json")
                continue
            if key == "_step":
                step = value
            else:
                row[key] = value
        if step is None and r.history.HasField("step"):
            step = r.history.step.num
        if step is None:
            step = self.count
        self.count += 1
        n = as_step(step)
        if n is None:
            self.note(
                f"{self.path}: record before byte {at} skipped, its _step {str(step)[:40]!r} is not an integer",
                once="step",
            )
            return None
        return self.record(n, row)

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset, "count": self.count, "mark": self.mark.to_dict()}

    def restore(self, pos: dict[str, Any]) -> None:
        self.offset = int(pos.get("offset", 0))
        self.count = int(pos.get("count", 0))
        self.mark.load(pos.get("mark"), self.offset)
