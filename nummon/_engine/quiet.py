"""The fast path for quiet records: after each full evaluation every detector declares the region
of the next records in which it provably stays silent, and records inside it skip the detectors.

The region (`QuietRegion`) is a band per magnitude (`lo <= value <= hi`, the band made around
the magnitude's recent level, the median of its last few values, and narrowed by each
detector), the last step and the number of records it holds for, the dtype the headroom was
judged in, and windows of a value that must keep moving (the frozen-loss rule's: each record
must leave its last few values spread). A record inside it is finite, carries none
of the sampled mechanism statistics (their detectors judge every sample) and has each magnitude
it carries inside its band: every detector would return no finding for it, whatever records
inside the region came before it. Such records are kept in a short buffer and booked into the
detectors' state in bulk (`absorb`) before the next full evaluation, so every decision is the
one the full path makes.

Each detector's `quiet(plan)` narrows the plan (or returns False: no fast path now) and its
`absorb(records)` books records it was promised to stay silent on. The proofs are in each
detector's `quiet`; `tests/engine/test_quiet_path.py` checks them step for step against the full
path on generated families of runs and on real logs.

A record the region speaks of whose values rose out of it toward trouble (a magnitude above a
bound a detector set, or `RISE_RATIO` x its level or more; a
non-finite value), and a run whose detectors have not yet made a region, are the engine's sign
to look closer: the Monitor then measures the activations at the next step too
(`StepOutcome.look_closer`). A value just above its level's band is minibatch noise as often as
not: it is judged in full, and the activations wait for their cadence.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core.types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS, StepRecord

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BAND_FIELDS",
    "BAND_RATIO",
    "RISE_RATIO",
    "STEADY_RATIO",
    "LEVEL_VALUES",
    "MAX_RECORDS",
    "QuietPath",
    "QuietPlan",
    "QuietRegion",
    "mechanism_free",
]

#: the magnitudes a quiet record may carry, each inside its band
BAND_FIELDS = ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max")
#: the band proposed around a magnitude's level: [level / BAND_RATIO, level * BAND_RATIO], before
#: each detector narrows it. A 3-layer MLP fed 32 batches in turn moves its loss and gradient
#: norm 0.6-1.6x around their level from batch to batch: at 1.2 16% of its ordinary records left
#: the band and were judged in full, at 1.4 8%. (Kept under RISE_RATIO: a value above the band
#: and under RISE_RATIO x its level is noise, judged in full; above it, a rise.)
BAND_RATIO = 1.4
#: a value this many times its level (or above a bound a detector set) rose toward trouble
RISE_RATIO = 1.44
#: a sampled mechanism value within this ratio of its level holds still (`steady`)
STEADY_RATIO = 1.44
#: a magnitude's level: the median of its last this many values (records judged or booked).
#: Minibatch noise moves each value around the level: a band around the last value alone let
#: the next records out whenever that one was high or low (on a 3-layer MLP fed 32 batches in
#: turn, 15% of its records left such a band, mostly by noise)
LEVEL_VALUES = 5
#: how far under a detector's own threshold a band's top stays (relative)
MARGIN = 1e-9
#: records booked in one bulk update at most (the windows stay fresh: a full evaluation at least
#: this often). Above the 19 quiet records between two mechanism samples of a calm run (every 20
#: steps by default), so that a region made at a sampled step can last to the next one
MAX_RECORDS = 24

#: the sampled mechanism values that must hold still for the probes to sample more sparsely
#: (`QuietPath.steady`): all but the Adam bound, which grows with the step count by itself, and
#: the per-sample loss ratio, a batch's own
STEADY_FIELDS = tuple(f for f in MECHANISM_FIELDS if f not in ("adam_ratio_bound", "sample_loss_ratio"))
#: values this close to 0 (in their own units) hold still whatever their ratio; a detector may
#: declare higher floors (`steady_floors`: the Adam detector's, half its absolute warning levels)
STEADY_FLOOR = 1e-3

#: what only a sampled step or a failing one carries: such a record is always evaluated in full
_FULL_ONLY = ("nonfinite_count", *MECHANISM_FIELDS)


_full_only = operator.itemgetter(*_FULL_ONLY)
_steady_values = operator.itemgetter(*STEADY_FIELDS)
_mechanism_layers = operator.itemgetter(*MECHANISM_LAYER_FIELDS)


def mechanism_free(rec: StepRecord) -> bool:
    """Whether `rec` carries none of the statistics only a sampled or failing step has (the
    sampled mechanism probes, a GradScaler's skip, a non-finite input)."""
    d = rec.__dict__  # (item getters and C-level counts: no Python call per field)
    return (
        not (rec.scaler_skipped or rec.input_nonfinite)
        and _full_only(d).count(None) == len(_FULL_ONLY)
        and not any(_mechanism_layers(d))
    )


class QuietPlan:
    """The region being built after a full evaluation at `step`: detectors narrow it."""

    def __init__(self, step: int, level: dict[str, float], dtype: str | None) -> None:
        self.step = step
        self.until_step = math.inf  # the last step the region holds for
        self.records = MAX_RECORDS  # records it holds for
        self.dtype = dtype
        # per magnitude: [lo, hi]; a magnitude with no recent value must be absent (None)
        self.bands: dict[str, list[float] | None] = {
            f: ([level[f] / BAND_RATIO, level[f] * BAND_RATIO] if f in level else None) for f in BAND_FIELDS
        }
        self.bands["headroom"] = [-math.inf, math.inf]  # a record's own headroom (decades), when it has one
        self.level = level
        self.moves: list[tuple[str, int, float, tuple[float, ...]]] = []  # `moving`'s windows

    def lo(self, field: str) -> float | None:
        """The band's lower end for `field` (None: the field must be absent)."""
        band = self.bands[field]
        return None if band is None else band[0]

    def cap(self, field: str, hi: float) -> None:
        """Values of `field` must stay below `hi` (with a relative margin of `MARGIN`: the
        detectors compare in log space, where rounding differs)."""
        band = self.bands[field]
        if band is not None:
            band[1] = min(band[1], hi * (1.0 - MARGIN) if hi > 0 else -math.inf)
            if band[1] < band[0]:
                self.bands[field] = None

    def floor(self, field: str, lo: float) -> None:
        """Values of `field` must be at least `lo` (the headroom's floor; a band's lower end a
        detector raises)."""
        band = self.bands[field]
        if band is not None:
            band[0] = max(band[0], lo)
            if band[1] < band[0]:
                self.bands[field] = None

    def absent(self, field: str) -> None:
        """A record carrying `field` is evaluated in full."""
        self.bands[field] = None

    def moving(self, field: str, n: int, spread: float, tail: list[float]) -> None:
        """Each record must leave the last `n` values of `field` (`tail`, the values before the
        region, then the region's own) spread by more than `spread` (max - min, in `field`'s
        units), once they are `n`."""
        self.moves.append((field, n, spread, tuple(tail)))

    def cap_records(self, n: int) -> None:
        self.records = min(self.records, n)

    def cap_step(self, step: int | float) -> None:
        self.until_step = min(self.until_step, step)

    def region(self) -> QuietRegion | None:
        """The finished region, or None when it holds for no record."""
        if self.records < 1 or self.until_step <= self.step:
            return None
        checks = tuple((f, b[0], b[1]) for f, b in self.bands.items() if b is not None)
        absent = tuple(f for f, b in self.bands.items() if b is None)
        if "loss" in absent:  # a quiet record carries its loss (a record without one is judged in full)
            return None
        # above what a value rises toward trouble (`QuietRegion.rising`): the band's top where a
        # detector narrowed it under the level's band (a bound of its own is near), else RISE_RATIO x
        # the level
        rise = tuple(
            (f, b[1] if b[1] < self.level[f] * BAND_RATIO * (1.0 - MARGIN) else self.level[f] * RISE_RATIO)
            for f, b in self.bands.items()
            if b is not None and f in self.level
        )
        floor = self.bands["headroom"]
        return QuietRegion(
            self.step,
            self.until_step,
            self.records,
            self.dtype,
            checks,
            absent,
            rise,
            floor[0] if floor else -math.inf,
            tuple(self.moves),
        )


@dataclass(frozen=True)
class QuietRegion:
    """Where the next records are provably quiet (see the module docstring)."""

    after: int  # the step of the full evaluation it was made at
    until_step: float
    records: int
    dtype: str | None
    checks: tuple[tuple[str, float, float], ...]  # (field, lo, hi)
    absent: tuple[str, ...]  # fields a quiet record must not carry
    rise: tuple[tuple[str, float], ...] = ()  # (magnitude, above what it rises toward trouble)
    floor: float = -math.inf  # the record's own headroom below this: it rises toward trouble
    moving: tuple[tuple[str, int, float, tuple[float, ...]], ...] = ()  # `QuietPlan.moving`'s windows

    def fits(self, rec: StepRecord, booked: int) -> bool:
        """Whether the region speaks of `rec`: within its steps and records, in its dtype, with
        no sampled statistic and no magnitude it has no band for."""
        if booked >= self.records or not self.after < rec.step <= self.until_step or rec.headroom_dtype != self.dtype:
            return False
        d = rec.__dict__
        for f in self.absent:
            if d[f] is not None:
                return False
        return mechanism_free(rec)

    def inside(self, rec: StepRecord) -> bool:
        """Whether `rec`'s values lie inside the region: finite, each magnitude in its band."""
        d = rec.__dict__
        for f, lo, hi in self.checks:
            v = d[f]
            if v is not None and not lo <= v <= hi:  # (NaN fails both)
                return False
        return rec.is_finite()

    def moves(self, rec: StepRecord, taken: list[StepRecord]) -> bool:
        """Whether each window of `moving` that ends at `rec` (after the region's `taken` records)
        is spread enough, or not full yet."""
        for f, n, spread, tail in self.moving:
            last = [*tail, *(t.__dict__[f] for t in taken[-n:]), rec.__dict__[f]][-n:]
            if len(last) == n and not max(last) - min(last) > spread:
                return False
        return True

    def rising(self, rec: StepRecord) -> bool:
        """Whether `rec` left the region upward toward trouble: a magnitude above its `rise`, a
        headroom below its floor, or a non-finite value (a value falling out of its band is no
        warning sign, nor is one just above its level's band)."""
        d = rec.__dict__
        for f, top in self.rise:
            v = d[f]
            if v is not None and v > top:
                return True
        headroom = d["headroom"]
        return (headroom is not None and headroom < self.floor) or not rec.is_finite()


def steady(
    recent: dict[str, deque[float]], now: dict[str, float | None], floors: dict[str, float] | None = None
) -> bool:
    """Whether every value of `now` lies within STEADY_RATIO of its level, the median of its last
    LEVEL_VALUES samples in `recent` (or both within its floor of 0, `floors` or STEADY_FLOOR:
    a level around 0 has no ratio); `recent` then takes `now`'s values. A value never sampled
    before, or non-finite, is not steady. (Around the level, not the last sample: a minibatch's
    output logits move 1.6x from one sample to the next on a steady tiny transformer.)"""
    held = True
    for f, v in now.items():
        if v is None:
            continue
        if not math.isfinite(v):  # (kept out of the level: a median over NaN is no level)
            held = False
            continue
        kept = recent.setdefault(f, deque(maxlen=LEVEL_VALUES))
        level = statistics.median(kept) if kept else None
        if level is None:
            held = False
        else:
            near_zero = max(abs(v), abs(level)) < (floors or {}).get(f, STEADY_FLOOR)
            held = held and (near_zero or abs(v - level) <= (STEADY_RATIO - 1.0) * min(abs(v), abs(level)))
        kept.append(v)
    return held


def recent_values(records: Sequence[StepRecord], recent: dict[str, deque[float]]) -> None:
    """Add `records`' finite positive magnitudes to `recent` (magnitude -> its last values), in order."""
    for rec in records:
        d = rec.__dict__
        for f in BAND_FIELDS:
            v = d[f]
            if v is not None and math.isfinite(v) and v > 0:
                recent[f].append(float(v))


def levels(recent: dict[str, deque[float]]) -> dict[str, float]:
    """Each magnitude's level: the median of its recent values (the upper one of an even count)."""
    return {f: sorted(vs)[len(vs) // 2] for f, vs in recent.items() if vs}


class QuietPath:
    """The engine's fast path: the region made at the last full evaluation, the quiet records it
    took since, and each magnitude's last values (the next region's bands are made around their
    median).

    `detectors`: the engine's; `shared`: the shared value they read that books itself per record
    (the loss trend, which books the starting level; None when no detector reads either)."""

    def __init__(self, detectors: Sequence[Any], shared: Any, skip: bool = True) -> None:
        self.detectors = detectors
        self.shared = shared
        self.on = all(hasattr(d, "quiet") for d in detectors)  # regions are made
        self.skip = skip  # ... and records inside one skip the detectors (False: every record judged in full)
        self.region: QuietRegion | None = None
        self.taken = 0  # records the region admitted since it was made
        self.taken_records: list[StepRecord] = []  # ... kept while it has windows that must move
        self.admitted = False  # the last record lay in the region (skipped, or judged in full when not `skip`)
        self.formed = False  # a region has been made (the detectors have warmed up)
        self.crossed = False  # the last record the region spoke of left it upward (`QuietRegion.rising`)
        # every mechanism value of the last sample lay near its level (`steady`)
        self.steady = False
        self.sampled: dict[str, deque[float]] = {}  # the last samples' mechanism values
        # per mechanism value, its floor of 0 (`steady`), as a detector declares it
        self.floors: dict[str, float] = {f: v for d in detectors for f, v in getattr(d, "steady_floors", {}).items()}
        self.booked: list[StepRecord] = []  # quiet records not yet booked into the detectors
        self.recent: dict[str, deque[float]] = {f: deque(maxlen=LEVEL_VALUES) for f in BAND_FIELDS}

    def takes(self, rec: StepRecord, judge: bool = False) -> bool:
        """Whether `rec` lies in the region (then it is kept, to be booked before the next full
        evaluation); notes whether a value of it left the region (`crossed`). `judge`: the
        record must be judged in full whatever its values (it brings replica mismatches)."""
        region = self.region
        self.crossed = self.admitted = False
        if judge or region is None or not region.fits(rec, self.taken):
            return False
        if not region.inside(rec):
            self.crossed = region.rising(rec)
            return False
        if region.moving and not region.moves(rec, self.taken_records):  # (a value held still: judged)
            return False
        self.admitted = True
        self.taken += 1
        if region.moving:
            self.taken_records.append(rec)
        if self.skip:
            self.booked.append(rec)
        return self.skip

    def judged(self, rec: StepRecord) -> None:
        """`rec` is being evaluated in full: its values are the latest (a sample's mechanism values too)."""
        recent_values((rec,), self.recent)
        values = _steady_values(rec.__dict__)
        if values.count(None) < len(values):
            self.steady = steady(self.sampled, dict(zip(STEADY_FIELDS, values)), self.floors)

    def plan(self, rec: StepRecord, quiet_now: bool) -> None:
        """The region after `rec`, judged in full: none unless the run is quiet now (`quiet_now`:
        healthy, no condition open, no incident) and every detector can give one. (A record the
        region admitted keeps it: judged in full only because `skip` is off, as for a test.)"""
        if self.admitted:
            return
        self.region, self.taken, self.taken_records = None, 0, []
        if not (self.on and quiet_now):
            return
        plan = QuietPlan(rec.step, levels(self.recent), rec.headroom_dtype)
        for d in self.detectors:
            if not d.quiet(plan):
                return
        self.region = plan.region()
        self.formed = self.formed or self.region is not None

    def take_booked(self) -> list[StepRecord]:
        """The quiet records to book, in order, with the shared value booked for each already;
        the caller books them into the detectors and the engine's own state."""
        records, self.booked = self.booked, []
        if records:
            if self.shared is not None:
                for rec in records:
                    self.shared.observe(rec)
            for d in self.detectors:
                d.absorb(records)
            recent_values(records, self.recent)
        return records
