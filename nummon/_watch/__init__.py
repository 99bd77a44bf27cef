"""`nummon watch`: follow training logs written by other tools (TensorBoard, Hugging Face
trainer_state.json, Lightning metrics.csv, W&B offline runs, nummon JSONL) and notify incidents.

May import: `_core`, `_policy`, `_engine`, `_logs`, `_report`.
"""

from __future__ import annotations

from .._logs.follow import Follower, NotALogError
from .._logs.keymap import DEFAULT_KEYS, KeyMap
from .._logs.readers import FORMATS, detect_format, make_follower, read_records

__all__ = [
    "DEFAULT_KEYS",
    "FORMATS",
    "Follower",
    "KeyMap",
    "NotALogError",
    "detect_format",
    "make_follower",
    "read_records",
]
