"""Pick the reader a path needs (by name, then by content) and read whole logs for `replay`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from .._core.types import StepRecord
from . import fs
from .follow import Follower, NotALogError
from .keymap import KeyMap
from .read_csv import CsvFollower
from .read_hf import STATE_NAME, HfStateFollower
from .read_jsonl import JsonlFollower
from .read_mlflow import MlflowFollower, is_mlflow_source
from .read_tb import TensorBoardFollower, is_event_file
from .read_wandb import WANDB_MAGIC, WandbFollower, is_wandb_file, wandb_run_files

__all__ = ["FORMATS", "detect_format", "make_follower", "read_records"]

FORMATS: dict[str, type[Follower]] = {
    "jsonl": JsonlFollower,
    "tensorboard": TensorBoardFollower,
    "hf": HfStateFollower,
    "csv": CsvFollower,
    "wandb": WandbFollower,
    "mlflow": MlflowFollower,
}


def detect_format(path: str) -> str:
    """The format of one file or run folder: by name first, then by its first bytes."""
    if is_mlflow_source(path):
        return "mlflow"
    name = fs.basename(path)
    if fs.is_dir(path):
        files = list(fs.walk_files(path, max_depth=2))
        top = [fs.basename(f) for f in files if fs.dirname(f).rstrip("/") == path.rstrip("/").rstrip(os.sep)]
        if any(is_event_file(f) for f in top):
            return "tensorboard"
        if STATE_NAME in top or any(
            fs.basename(f) == STATE_NAME and fs.basename(fs.dirname(f)).startswith("checkpoint-") for f in files
        ):
            return "hf"
        if "metrics.csv" in top:
            return "csv"
        if any(is_wandb_file(f) for f in top) or wandb_run_files(path):
            return "wandb"
        raise NotALogError(f"{path}: a folder with no log nummon reads (use the folder as a watch root, or --format)")
    if _exists(path) and fs.stat(path) is None:
        raise NotALogError(f"{path}: not a regular file (a FIFO or device is never read)")
    if is_event_file(path):
        return "tensorboard"
    if name == STATE_NAME:
        return "hf"
    if is_wandb_file(path) or name.endswith(".wandb"):
        return "wandb"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    st = fs.stat(path)
    if st is None:
        raise NotALogError(
            f"{path}: not found"
            if not _exists(path)
            else f"{path}: not a regular file (a FIFO or device is never read)"
        )
    try:
        head = fs.read_bytes(path, 0, fs.HEAD_BYTES)
    except OSError as e:  # EIO (a failing disk, /proc/self/mem), a permission taken away
        raise NotALogError(f"{path}: cannot be read ({e.strerror or e})") from None
    if head.startswith(WANDB_MAGIC):
        return "wandb"
    text = head.lstrip()
    if text.startswith(b"{") and b'"log_history"' in head:
        return "hf"
    if text.startswith(b"{"):
        return "jsonl"
    if b"," in head.split(b"\n", 1)[0] and b"step" in head.split(b"\n", 1)[0]:
        return "csv"
    raise NotALogError(
        f"{path}: not a log nummon reads (JSONL, TensorBoard, trainer_state.json, metrics.csv, W&B run file)"
    )


def make_follower(path: str, format: str | None = None, keymap: KeyMap | None = None) -> Follower:
    """A follower for one file or run folder (`format` forces one of FORMATS)."""
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise NotALogError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")
    return FORMATS[fmt](path, keymap)


def _exists(path: str) -> bool:
    return fs.is_url(path) or is_mlflow_source(path) or os.path.lexists(path)


def read_records(
    path: str, format: str | None = None, keymap: KeyMap | None = None, warn: Callable[[str], None] | None = None
) -> Iterator[StepRecord]:
    """Every step record of a finished log (any format), in file order, streaming in bounded
    reads; raises NotALogError (a NummonError naming the path) when the path is not a log.
    Warnings (corruption skipped with its byte offset, a torn tail) go to `warn`."""
    path = str(path)
    if not _exists(path):
        raise NotALogError(f"{path}: not found")
    follower = make_follower(path, format, keymap)
    try:
        empty = 0
        while empty < 2:  # a whole-file format that fails to parse raises NotALogError
            try:
                got = follower.poll(final=True)
            except OSError as e:  # EIO while reading: one line naming the file, never a traceback
                raise NotALogError(f"{path}: cannot be read ({e.strerror or e})") from None
            if warn is not None:
                for line in follower.notes:
                    warn(line)
            follower.notes.clear()
            empty = 0 if (got or follower.more) else empty + 1
            yield from got
    finally:
        follower.close()
