"""Hugging Face Trainer `trainer_state.json` (`log_history`), one lineage per output folder: the
folder's own file and those in its `checkpoint-*/` folders, each rewritten whole at every save.
Rows at or below the last step seen are skipped; bare NaN/Infinity literals are read as floats."""
from __future__ import annotations

import json
import re
from typing import Any

from .._types import StepRecord
from . import fs
from .base import Follower, NotALogError

__all__ = ["HfStateFollower", "STATE_NAME", "lineage_root"]

STATE_NAME = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
        best: tuple[int, list[dict]] | None = None
        for f in self._files():
            st = fs.stat(f)
            if st is None or st == self._seen.get(f):
                continue
            rows = self._read(f)
            if rows is None:
                continue  # mid-rewrite: read again next poll
            self._seen[f] = st
            top = max((r["step"] for r in rows), default=-1)
            if best is None or top > best[0]:
                best = (top, rows)
        if best is None:
            return []
        by_step: dict[int, dict] = {}
        for r in best[1]:
            s = r["step"]
            if self.last_step is None or s > self.last_step:
                by_step.setdefault(s, {}).update(r)
        out: list[StepRecord] = []
        for s in sorted(by_step):
            row = {k: v for k, v in by_step[s].items() if k != "step"}
            rec = self.keymap.record(s, row)
            if rec is not None:
                out.append(rec)
            self.last_step = s
        return out

    def _read(self, path: str) -> list[dict] | None:
        try:
            obj = json.loads(fs.read_bytes(path).decode("utf-8"))  # json reads NaN/Infinity literals
        except (ValueError, UnicodeDecodeError) as e:
            self._unparsable(path, f"invalid JSON: {getattr(e, 'msg', e)}")
            return None
        except OSError:
            return None  # removed between listing and reading (save_total_limit)
        if not isinstance(obj, dict) or not isinstance(obj.get("log_history"), list):
            raise NotALogError(f"{path}: not a Hugging Face trainer_state.json (no log_history list)")
        rows = []
        for r in obj["log_history"]:
            if isinstance(r, dict) and isinstance(r.get("step"), (int, float)) and not isinstance(r.get("step"), bool):
                rows.append({**r, "step": int(r["step"])})
        return rows

    def position(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def restore(self, pos: dict[str, Any]) -> None:
        self.last_step = pos.get("last_step")
