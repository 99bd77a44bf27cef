"""Read a W&B offline run file (`run-<id>.wandb`) back: LevelDB-log framing of protobuf Records."""

import struct
import zlib
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    magic, version, _ = struct.unpack("<4sHB", data[:7])
    assert magic == b":W&B" and version == 0xBEE1, "not a W&B run file"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block tail: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad crc at {pos}"
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            buf = chunk
        elif kind == MIDDLE:
            buf += chunk
        elif kind == LAST:
            yield buf + chunk
            buf = b""


def read_records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for payload in _payloads(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        out.append(rec)
    return out


def history_rows(records):
    import json

    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {}
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def alerts(records):
    return [r.alert for r in records if r.WhichOneof("record_type") == "alert"]


def find_run_file(root):
    files = sorted(Path(root).rglob("run-*.wandb"))
    assert files, f"no .wandb run file under {root}"
    return files[-1]


def nummon_alert_titles_and_steps(records):
    """(W&B alert titles, steps of the rows holding nummon's loss) of a run shared with a
    framework's logger, whose rows carry the training step as `nummon/step`."""
    titles = [a.title for a in alerts(records)]
    steps = [row.get("nummon/step", row.get("_step")) for row in history_rows(records) if "nummon/loss" in row]
    return titles, steps
