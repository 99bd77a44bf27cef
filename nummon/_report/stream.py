"""What a report keeps of a log read as a stream, in memory bounded whatever the log's length:
full records near incidents (the lead-up from a window of recent records, every step while an
incident is open, a tail after it), every non-finite step, and elsewhere the lowest and highest
value of each drawn signal per bucket of steps (buckets widen as the run grows), which is what a
page draws far from an incident. The step records are never all held: a 100,000-step log of
GPT-2-sized lines is read in the memory of a few thousand."""

from __future__ import annotations

from collections import deque
from typing import Any

from .._core.types import StepRecord

__all__ = ["Collector", "DRAWN"]

# the record fields a page draws as whole-run curves (page.SIGNALS' fields; page imports this layer)
DRAWN = (
    "loss",
    "grad_norm",
    "activation_max",
    "headroom",
    "attention_logit_max",
    "output_logsumexp_mean",
    "adam_ratio_rms",
)
RECENT = 160  # full records before an incident opens (the layers' level is read from them)
TAIL = 64  # full records kept after an incident ends
NEAR_MAX = 1024  # full records kept near incidents; past it, lean ones (drawn signals only)
LEAN_MAX = 2048  # lean records kept near incidents once NEAR_MAX is reached
NONFINITE_MAX = 4096  # non-finite records kept (a page marks at most a few hundred)
BUCKETS = 1024  # buckets of steps far from incidents (each keeps each signal's lowest and highest)
_ACTIVE = frozenset({"open", "critical", "nonfinite"})


class Collector:
    """Feed it every record (`add`) and every incident state (`state`); `records()` is what
    the page draws, in step order (the last record of a step written twice)."""

    def __init__(self) -> None:
        self.count = 0  # distinct steps seen (a step written again by a resumed run counts once)
        self.top: int | None = None  # the highest step seen
        self.recent: deque[StepRecord] = deque(maxlen=RECENT)
        self.near: dict[int, StepRecord] = {}
        self.lean_near = 0
        self.nonfinite: dict[int, StepRecord] = {}
        self.nonfinite_steps = 0  # all of them, kept or not
        self.width = 1  # steps per bucket
        self.buckets: dict[int, dict[str, tuple[float, int, float, int]]] = {}  # signal: (lo, at, hi, at)
        self.active = False
        self.tail = 0

    def state(self, state: str) -> None:
        """An incident event's state: while one is open every record is kept; its lead-up too."""
        active = state in _ACTIVE
        if active and not self.active:
            for r in self.recent:
                self._keep(r)
        if self.active and not active:
            self.tail = TAIL
        self.active = active

    def forget(self) -> None:
        """Drop what was kept near incidents so far (those of detectors whose verdict the log's
        own incident events replace); the recent window and the buckets stay."""
        self.near.clear()
        self.lean_near = 0
        self.active = False
        self.tail = 0

    def mark(self, step: int) -> None:
        """An alert at `step`: its record is kept in full (when it is the latest one read)."""
        if self.recent and self.recent[-1].step == step:
            self._keep(self.recent[-1])

    def add(self, rec: StepRecord, alerted: bool = False) -> None:
        if self.top is None or rec.step > self.top:
            self.count += 1
            self.top = rec.step
        if not rec.is_finite():
            self.nonfinite_steps += 1
            if len(self.nonfinite) < NONFINITE_MAX or rec.step in self.nonfinite:
                self.nonfinite[rec.step] = rec
        if self.active or alerted or self.tail > 0:
            self._keep(rec)
            if not self.active:
                self.tail -= 1
        self.recent.append(rec)
        self._bucket(rec)

    def _keep(self, rec: StepRecord) -> None:
        if len(self.near) < NEAR_MAX or rec.step in self.near:
            self.near[rec.step] = rec
        elif self.lean_near < LEAN_MAX:
            self.near[rec.step] = _lean(rec)
            self.lean_near += 1

    def _bucket(self, rec: StepRecord) -> None:
        b = self.buckets.setdefault(rec.step // self.width, {})
        for f in DRAWN:
            v = getattr(rec, f)
            if v is None or v != v:
                continue
            old = b.get(f)
            if old is None:
                b[f] = (v, rec.step, v, rec.step)
            elif v < old[0] or v > old[2]:
                b[f] = (*((v, rec.step) if v < old[0] else old[:2]), *((v, rec.step) if v > old[2] else old[2:]))
        if len(self.buckets) > BUCKETS:
            self._widen()

    def _widen(self) -> None:
        """Twice as many steps per bucket: neighbours merged, each keeping its extremes."""
        self.width *= 2
        merged: dict[int, dict[str, tuple[float, int, float, int]]] = {}
        for k, b in self.buckets.items():
            into = merged.setdefault(k // 2, {})
            for f, (lo, lo_at, hi, hi_at) in b.items():
                old = into.get(f)
                if old is None:
                    into[f] = (lo, lo_at, hi, hi_at)
                else:
                    into[f] = (*min(old[:2], (lo, lo_at)), *max(old[2:], (hi, hi_at)))
        self.buckets = merged

    def records(self) -> list[StepRecord]:
        """The records a page draws, in step order: full ones near incidents and at the ends,
        non-finite ones, and each bucket's extremes elsewhere (as lean records)."""
        by_step: dict[int, dict[str, float]] = {}
        for b in self.buckets.values():
            for f, (lo, lo_at, hi, hi_at) in b.items():
                by_step.setdefault(lo_at, {})[f] = lo
                by_step.setdefault(hi_at, {})[f] = hi
        out: dict[int, StepRecord] = {s: _record(s, v) for s, v in by_step.items()}
        for r in (*self.near.values(), *self.nonfinite.values(), *self.recent):  # later ones win
            out[r.step] = r
        return [out[s] for s in sorted(out)]


def _lean(rec: StepRecord) -> StepRecord:
    return _record(rec.step, {f: v for f in DRAWN if (v := getattr(rec, f)) is not None})


def _record(step: int, values: dict[str, Any]) -> StepRecord:
    return _new_record({"step": step, **values})


_DEFAULTS = {k: v for k, v in StepRecord(step=0).__dict__.items() if not isinstance(v, dict)}
_DICT_FIELDS = tuple(k for k, v in StepRecord(step=0).__dict__.items() if isinstance(v, dict))


def _new_record(values: dict[str, Any]) -> StepRecord:
    """StepRecord(**values) without its per-field __setattr__ (a third of a 100,000-line log's
    load time); the values are already checked, each record gets dicts of its own."""
    rec = object.__new__(StepRecord)
    d = rec.__dict__
    d.update(_DEFAULTS)
    for k in _DICT_FIELDS:
        d[k] = {}
    d.update(values)
    return rec
