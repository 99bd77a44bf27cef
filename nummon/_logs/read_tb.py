"""TensorBoard event directories: the TFRecord framing (length, masked CRC32C of the length,
data, masked CRC32C of the data) read here in bounded chunks, each record decoded with the
tensorboard package's own protobuf classes. Every record is checked by its CRCs: a corrupt
record is skipped and named with its byte offset, and reading resynchronises at the next record
whose header checks out; a torn last record is read again next poll (and named at the end of a
finished log)."""

from __future__ import annotations

import struct
from typing import Any

from .._core.errors import NummonError
from .._core.types import StepRecord
from . import fs
from .follow import FileMark, Follower, NotALogError, StepAssembler

__all__ = ["TensorBoardFollower", "is_event_file", "EVENT_PREFIX", "check_event_header"]

EVENT_PREFIX = "events.out.tfevents."
_HEAD = 12  # uint64 length + uint32 masked CRC of it
_MAX_RECORD = 256 * 1024 * 1024  # a longer "length" is corruption, never an allocation


def is_event_file(path: str) -> bool:
    return EVENT_PREFIX in fs.basename(path)


def _require(module: str, extra: str):
    from .._core.lazy import require

    try:
        return require(module, extra)
    except ImportError as e:  # a missing extra is one line (exit 2), never a traceback
        raise NummonError(str(e)) from None


def _tb():
    _require("tensorboard", "tensorboard")
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    return event_pb2, tensor_util, _masked_crc32c()


def _masked_crc32c():
    """TFRecord's masked CRC32C: the C implementation when google-crc32c is installed, else the
    pure-Python one tensorboard ships (the same one its own loader uses)."""
    try:
        import google_crc32c

        def masked(b: bytes) -> int:
            crc = google_crc32c.value(b)
            return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

        return masked
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c


def check_event_header(path: str) -> None:
    """Raise NotALogError when the first record header fails its CRC (the file is not an event log)."""
    masked = _tb()[2]
    head = fs.read_bytes(path, 0, _HEAD)
    if len(head) == _HEAD and struct.unpack("<I", head[8:])[0] != masked(head[:8]):
        raise NotALogError(f"{path}: not a TensorBoard event file (bad record header)")


class _File:
    def __init__(self) -> None:
        self.offset = 0  # consumed, at a record boundary
        self.done = 0  # every record before it is in a returned step
        self.records = 0
        self.mark = FileMark()
        self.suspect: int | None = None  # a corrupt-looking record seen once (confirmed next poll)


class TensorBoardFollower(Follower):
    """One event directory (or one event file): its event files in name (= creation) order. A
    second run written into the same directory is a new file whose steps start over: the watched
    run sees its steps go back and restarts its detectors."""

    format = "tensorboard"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self._pb, self._tensor_util, self._crc = _tb()
        # a file forced as TensorBoard is read (and its header checked) whatever its name: only a
        # folder is searched for event files, so a JSONL log forced here is refused, never empty
        self.single = not fs.is_dir(path)
        self.files: dict[str, _File] = {}
        self.asm = StepAssembler(self)

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
        self.more = False
        out: list[StepRecord] = []
        got = False
        budget = self.poll_bytes
        files = self._files()
        for i, f in enumerate(files):
            st = fs.stat(f)
            if st is None:
                continue
            state = self.files.get(f)
            if state is None:
                if st.size < _HEAD:
                    continue
                check_event_header(f)
                state = self.files[f] = _File()
            why = state.mark.check(f, st)
            if why:
                self.note(f"{f}: {why}; reading it again from the start")
                self.files[f] = state = _File()
            while budget > 0 and state.offset < st.size:
                n, more = self._read(f, state, st, files[: i + 1], out, final, min(budget, self.poll_bytes))
                got = got or n > 0
                budget -= max(n, 1)
                if not more:
                    break
            if budget <= 0:
                self.more = True
                break
        if (not got or final) and not self.more and self.asm.flush(out):
            for s in self.files.values():
                s.done = s.offset
        return out

    def _read(
        self, f: str, state: _File, st: fs.Stat, upto: list[str], out: list[StepRecord], final: bool, size: int
    ) -> tuple[int, bool]:
        """Records of one chunk of `f`; (bytes consumed, whether the chunk ended on a full buffer)."""
        base = orig = state.offset
        data = fs.read_bytes(f, base, size)
        pos = 0
        while pos + _HEAD <= len(data):
            head = data[pos : pos + _HEAD]
            length = struct.unpack("<Q", head[:8])[0]
            if struct.unpack("<I", head[8:])[0] != self._crc(head[:8]) or length > _MAX_RECORD:
                if not final and state.suspect != base + pos:
                    state.suspect = base + pos  # confirm on the next poll before skipping anything
                    break
                nxt = self._resync(data, pos + 1)
                skip_to = nxt if nxt is not None else len(data) - _HEAD + 1
                self.note(
                    f"{f}: corrupt record header at byte {base + pos}; skipped {skip_to - pos} bytes to "
                    f"{'the next record' if nxt is not None else 'further on'} at byte {base + skip_to}"
                )
                pos = skip_to
                state.suspect = None
                continue
            end = pos + _HEAD + length + 4
            if end > len(data):
                if _HEAD + length + 4 > size and len(data) == size:  # one record bigger than the chunk
                    data = fs.read_bytes(f, base + pos, _HEAD + length + 4)
                    base, pos = base + pos, 0
                    end = _HEAD + length + 4
                    if end > len(data):
                        break
                else:
                    break
            payload = data[pos + _HEAD : end - 4]
            start = base + pos
            pos = end
            if struct.unpack("<I", data[end - 4 : end])[0] != self._crc(payload):
                if not final and state.suspect != start:
                    state.suspect = start
                    pos = start - base
                    break
                state.suspect = None
                self.note(f"{f}: corrupt record at byte {start} (data CRC mismatch); skipped")
                continue
            state.suspect = None
            state.records += 1
            self._event(f, payload, start, upto, out)
        state.offset = base + pos
        consumed = state.offset - orig
        if final and pos < len(data) and base + len(data) >= st.size:
            self.note(
                f"{f}: last record torn at byte {state.offset} ({st.size - state.offset} bytes; a killed "
                f"writer or a cut copy?); ignored",
                once=f"torn:{f}",
            )
        if consumed:
            state.mark.take(f, state.offset, st)
        return consumed, len(data) == size and consumed > 0

    def _resync(self, data: bytes, start: int) -> int | None:
        """The offset (in `data`) of the next record header whose CRC checks out."""
        for p in range(start, len(data) - _HEAD + 1):
            head = data[p : p + _HEAD]
            if (
                struct.unpack("<I", head[8:])[0] == self._crc(head[:8])
                and struct.unpack("<Q", head[:8])[0] <= _MAX_RECORD
            ):
                return p
        return None

    def _event(self, f: str, payload: bytes, start: int, upto: list[str], out: list[StepRecord]) -> None:
        try:
            event = self._pb.Event.FromString(payload)
        except Exception:  # protobuf's DecodeError: a record of a newer schema, or garbage
            self.note(f"{f}: record at byte {start} is not a TensorBoard event; skipped", once=f"pb:{f}")
            return
        row = self._scalars(event)
        if not row:
            return
        if self.asm.add(int(event.step), row, out):
            for g in upto:
                s = self.files.get(g)
                if s is not None:
                    s.done = start if g == f else s.offset

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
                try:
                    arr = self._tensor_util.make_ndarray(v.tensor)
                    if arr.size == 1:
                        row[v.tag] = float(arr.reshape(-1)[0])
                except Exception:  # a tensor proto that does not decode: not a scalar we read
                    continue
        return row

    def position(self) -> dict[str, Any]:
        files = {}
        for f, s in self.files.items():
            mark = FileMark()
            if fs.stat(f) is not None:
                mark.take(f, s.done)
            files[fs.basename(f)] = {"offset": s.done, "mark": mark.to_dict()}
        return {"files": files, "last_step": self.asm.last_emitted}

    def restore(self, pos: dict[str, Any]) -> None:
        saved = pos.get("files") or {}
        for f in self._files():
            d = saved.get(fs.basename(f))
            if isinstance(d, dict):
                s = self.files[f] = _File()
                s.offset = s.done = int(d.get("offset", 0))
                s.mark.load(d.get("mark"), s.offset)
        self.asm.last_emitted = pos.get("last_step")

    def close(self) -> None:
        self.files.clear()
