"""The records a restarted health engine is warmed with: the run's first ones (the divergence
baseline) and the latest ones, kept as they come and saved as strict-JSON dicts."""

from __future__ import annotations

from collections import deque
from typing import Any

from .._core.json import json_safe
from .._core.types import StepRecord

__all__ = ["WarmRecords", "WARM_FIRST", "WARM_RECENT"]

#: Records a restarted engine is warmed with (`HealthEngine.state_dict`): the run's first ones
#: (the divergence baseline) and the latest ones.
WARM_FIRST = 32
WARM_RECENT = 256


class WarmRecords:
    """The first `first_max` records of a run and its `recent_max` latest ones; each is turned
    into its strict-JSON dict once, when first saved, not at every save."""

    def __init__(self, first_max: int = WARM_FIRST, recent_max: int = WARM_RECENT) -> None:
        self.first_max, self.recent_max = first_max, recent_max
        # [record, its strict-JSON dict once made]
        self._first: list[list[Any]] = []
        self._recent: deque[list[Any]] = deque(maxlen=recent_max)

    def keep(self, rec: StepRecord) -> None:
        if len(self._first) < self.first_max:
            self._first.append([rec, None])
        else:
            self._recent.append([rec, None])

    def clear(self) -> None:
        self._first.clear()
        self._recent.clear()

    def saved(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the first records, the latest ones) as strict-JSON dicts."""
        return [_saved(e) for e in self._first], [_saved(e) for e in self._recent]

    def parse(self, first: Any, history: Any, origin: str) -> list[StepRecord]:
        """The records of a saved state (`first`, `history` as `saved()` gave them) that this
        keeper keeps: its first `first_max` and its last `recent_max`, numbered by their place in
        the saved state. NummonError naming `origin` for a bad record; TypeError or ValueError
        when these are not lists of records."""
        saved_first, saved_recent = list(first or []), list(history or [])
        skipped = max(0, len(saved_recent) - self.recent_max)
        out = [StepRecord.from_dict(o, origin, i) for i, o in enumerate(saved_first[: self.first_max])]
        out += [
            StepRecord.from_dict(o, origin, len(saved_first) + skipped + i)
            for i, o in enumerate(saved_recent[skipped:])
        ]
        return out


def _saved(entry: list[Any]) -> dict[str, Any]:
    if entry[1] is None:
        entry[1] = json_safe(entry[0].to_dict())
    saved: dict[str, Any] = entry[1]  # json_safe of a dict is a dict
    return saved
