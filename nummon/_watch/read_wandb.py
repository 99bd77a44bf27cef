"""W&B offline run files (`run-<id>.wandb`): a LevelDB-log framing (32 KiB blocks of CRC'd
chunks) of protobuf `Record`s, decoded with the classes the wandb package ships. Followed by
byte offset; a record whose chunks are not all written yet is read again next poll."""
from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from .._types import StepRecord
from . import fs
from .base import Follower, NotALogError

__all__ = ["WandbFollower", "is_wandb_file", "WANDB_MAGIC"]

WANDB_MAGIC = b":W&B"
_BLOCK = 32 * 1024
_HEADER = 7  # magic (4) + version (2) + reserved (1); also the size of a chunk header
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def is_wandb_file(path: str) -> bool:
    name = fs.basename(path)
    return name.startswith("run-") and name.endswith(".wandb")


def _pb():
    from .._lazy import require

    require("wandb", "wandb")
    from wandb.proto import wandb_internal_pb2

    return wandb_internal_pb2


class WandbFollower(Follower):
    format = "wandb"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self._pb = _pb()
        self.offset = 0  # at a record boundary (after the file header once read)
        self.count = 0

    def poll(self, final: bool = False) -> list[StepRecord]:
        st = fs.stat(self.path)
        if st is None or st.size <= self.offset:
            return []
        data = fs.read_bytes(self.path, self.offset)
        base = self.offset
        pos = 0
        if base == 0:
            if len(data) < _HEADER:
                return []
            magic, version = struct.unpack("<4sH", data[:6])
            if magic != WANDB_MAGIC:
                raise NotALogError(f"{self.path}: not a W&B run file (bad magic)")
            pos = _HEADER
            self.offset = _HEADER
        out: list[StepRecord] = []
        buf = b""
        while True:
            left = _BLOCK - (base + pos) % _BLOCK
            if left < _HEADER:  # block trailer: zero padding
                if pos + left > len(data):
                    break
                pos += left
                continue
            if pos + _HEADER > len(data):
                break
            crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
            if length == 0 and kind == 0:  # zero-filled rest of a block
                if pos + left > len(data):
                    break
                pos += left
                continue
            end = pos + _HEADER + length
            if end > len(data):
                break  # chunk still being written
            chunk = data[pos + _HEADER : end]
            if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
                self._unparsable(self.path, f"bad chunk checksum at byte {base + pos}")
                break  # maybe a torn write: read again next poll
            pos = end
            if kind == _FULL:
                payload = chunk
            elif kind == _FIRST:
                buf = chunk
                continue
            elif kind == _MIDDLE:
                buf += chunk
                continue
            elif kind == _LAST:
                payload, buf = buf + chunk, b""
            else:
                raise NotALogError(f"{self.path}: not a W&B run file (chunk type {kind})")
            self.offset = base + pos  # a whole record consumed
            rec = self._record(payload)
            if rec is not None:
                out.append(rec)
        return out

    def _record(self, payload: bytes) -> StepRecord | None:
        r = self._pb.Record()
        try:
            r.ParseFromString(payload)
        except Exception:  # protobuf's DecodeError: a record of a newer schema; skip it
            return None
        if r.WhichOneof("record_type") != "history":
            return None
        row: dict[str, Any] = {}
        step = None
        for item in r.history.item:
            key = item.key or "/".join(item.nested_key)
            if key == "_step":
                step = json.loads(item.value_json)
            elif self.keymap.field(key) is not None:
                row[key] = json.loads(item.value_json)  # W&B writes NaN/Infinity literals
        if step is None and r.history.HasField("step"):
            step = r.history.step.num
        if step is None:
            step = self.count
        self.count += 1
        return self.keymap.record(int(step), row)

    def position(self) -> dict[str, Any]:
        return {"offset": self.offset, "count": self.count}

    def restore(self, pos: dict[str, Any]) -> None:
        self.offset = int(pos.get("offset", 0))
        self.count = int(pos.get("count", 0))
