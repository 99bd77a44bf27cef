"""Hugging Face Trainer `trainer_state.json` (`log_history`), one lineage per output folder: the
folder's own file and those in its `checkpoint-*/` folders, each rewritten whole at every save.
The newest file is the run's state; rows at or below the last step seen are skipped, and a
newest file whose steps end below it is a new run written into the same folder (read from its
start). A file that is not valid JSON yet (caught mid-write) is read again when it changes; bare
NaN/Infinity literals are read as floats; a row whose step is not an integer is skipped."""

from __future__ import annotations

import json
import re
from typing import Any

from .._core.types import StepRecord
from . import fs
from .follow import Follower, NotALogError, as_step

__all__ = ["HfStateFollower", "STATE_NAME", "lineage_root", "MAX_STATE_BYTES"]

STATE_NAME = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
MAX_STATE_BYTES = fs.MAX_READ  # a trainer_state.json is read whole, in one bounded read


def lineage_root(state_file: str) -> str:
    """The output folder a trainer_state.json belongs to (the parent of `checkpoint-N/`)."""
    folder = fs.dirname(state_file)
    return fs.dirname(folder) if _CHECKPOINT.match(fs.basename(folder)) else folder


class HfStateFollower(Follower):
    format = "hf"

    def __init__(self, path: str, keymap=None) -> None:
        super().__init__(path, keymap)
        self.single = fs.basename(path) == STATE_NAME or not fs.is_dir(path)
        self.last_step: int | None = None
        self._seen: dict[str, Any] = {}  # file -> Stat at its last successful read
        self._bad: dict[str, Any] = {}  # file -> Stat of its last unparsable read

    def _files(self) -> list[str]:
        if self.single:
            return [self.path]
        out = []
        for f in fs.walk_files(self.path, max_depth=2):
            if fs.basename(f) != STATE_NAME:
                continue
            parent = fs.dirname(f)
            if parent.rstrip("/") == self.path.rstrip("/").rstrip("\\") or _CHECKPOINT.match(fs.basename(parent)):
                out.append(f)
        return out

    def poll(self, final: bool = False) -> list[StepRecord]:
        best: tuple[tuple, list[dict], str] | None = None
        for f in self._files():
            st = fs.stat(f)
            if st is None or st == self._seen.get(f):
                continue
            rows = self._read(f, st, final)
            if rows is None:
                continue  # mid-rewrite: read again when it changes
            self._seen[f] = st
            top = max((r["step"] for r in rows), default=-1)
            key = (st.mtime or 0.0, top)
            if best is None or key > best[0]:
                best = (key, rows, f)
        if best is None:
            return []
        (_, top), rows, f = best
        if self.last_step is not None and top < self.last_step:
            self.note(
                f"{f}: its steps end at {top}, below step {self.last_step} read before: a new run in the same "
                f"output folder; reading it from its start"
            )
            self.last_step = None
        by_step: dict[int, dict] = {}
        for r in rows:
            s = r["step"]
            if self.last_step is None or s > self.last_step:
                by_step.setdefault(s, {}).update(r)
        out: list[StepRecord] = []
        for s in sorted(by_step):
            row = {k: v for k, v in by_step[s].items() if k != "step"}
            rec = self.record(s, row)
            if rec is not None:
                out.append(rec)
            self.last_step = s
        return out

    def _read(self, path: str, st: fs.Stat, final: bool) -> list[dict] | None:
        if st.size > MAX_STATE_BYTES:
            self.note(
                f"{path}: {st.size >> 20} MiB, larger than the {MAX_STATE_BYTES >> 20} MiB a trainer_state.json "
                f"is read to; skipped",
                once=f"big:{path}",
            )
            return None
        try:
            obj = json.loads(fs.read_bytes(path, 0, MAX_STATE_BYTES).decode("utf-8"))  # reads NaN/Infinity literals
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            why = f"invalid JSON: {getattr(e, 'msg', e)}" + (f" at byte {e.pos}" if hasattr(e, "pos") else "")
            if final:
                raise NotALogError(f"{path}: not a {self.format} log ({why})") from None
            if self._bad.get(path) == st:  # the same bytes twice: say so once, read it when it changes
                self.note(
                    f"{path}: not a complete trainer_state.json ({why}); read again when it changes",
                    once=f"bad:{path}:{st}",
                )
            self._bad[path] = st
            return None
        except OSError:
            return None  # removed between listing and reading (save_total_limit)
        if not isinstance(obj, dict) or not isinstance(obj.get("log_history"), list):
            raise NotALogError(f"{path}: not a Hugging Face trainer_state.json (no log_history list)")
        rows = []
        bad = 0
        for r in obj["log_history"]:
            if not isinstance(r, dict):
                continue
            step = as_step(r.get("step"))
            if step is None:
                bad += 1
                continue
            rows.append({**r, "step": step})
        if bad:
            self.note(
                f"{path}: {bad} log_history row{'s' if bad != 1 else ''} skipped, step not an integer",
                once=f"step:{path}",
            )
        return rows

    def position(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def restore(self, pos: dict[str, Any]) -> None:
        last = pos.get("last_step")
        self.last_step = None if last is None else int(last)
