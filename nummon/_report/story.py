"""The facts of each incident, from the run's incident events, alerts and records (pure data):
its warning / critical / first non-finite steps, what happened in sentences, the first
non-finite tensor and its cause, the countdown said vs what was left, what to do, and the
layers that left the pack."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from .._core.maths import median
from .._core.text import fmt_num, plural
from .._core.types import StepRecord
from .load import RunData

__all__ = ["IncidentView", "Countdown", "LayerTrack", "incidents_of", "worst_first", "LAYER_FAMILIES"]

_RANK = {"none": 0, "resolved": 0, "open": 1, "critical": 2, "nonfinite": 3}

#: per-layer record fields, with the words the report uses for them
LAYER_FAMILIES = {
    "layer_grad_norms": "grad norm",
    "layer_activation_max": "max activation",
    "layer_output_rms": "output RMS",
    "layer_attention_logit_max": "attention logit",
    "layer_adam_ratio_rms": "Adam ratio",
    "layer_update_ratio": "update ratio",
}
PACK_FACTOR = 4.0  # a layer left the pack when it grew this many times more than the median layer
_PRE_STEPS = 32  # records before the warning that set each layer's level


@dataclass(frozen=True)
class Countdown:
    """One runaway alert's forecast against what happened: `said` steps to overflow at `step`;
    `left` steps until the first non-finite value (None when the log never got there)."""

    step: int
    metric: str
    said: float
    left: int | None
    bound: bool = False  # `said` is an upper bound (the growth rate was rising)
    span: tuple[float, float] | None = None  # the range said (if it keeps speeding up, at today's rate)
    followed: int = 0  # finite steps the log went on after `step` (when `left` is None)

    @property
    def verdict(self) -> str:
        """The forecast against what happened: a hit (the figure, within the range or the bound
        said), early (more steps were left: the safe side), late (fewer), missed (no overflow
        followed within the figure said), or not judged (said at the first non-finite step itself,
        or the log ends before the figure said)."""
        low, high = self.span if self.span is not None else (self.said, self.said)
        if self.left is None:
            if self.followed > high:
                return f"missed: no overflow in the {plural(self.followed, 'step')} that followed"
            return f"not judged: the log ends {plural(self.followed, 'step')} later"
        if self.left <= 0:
            return "not judged: said at the first NaN/Inf step itself"
        if self.span is not None and low <= self.left <= high:
            return "hit: within the range said"
        if self.span is None and self.bound and self.left <= self.said:
            return "hit: within the bound said"
        if self.span is None and not self.bound and self.left == round(self.said):
            return "hit"
        return "early (safe side): more were left" if self.left > high else "late: fewer were left"


@dataclass(frozen=True)
class LayerTrack:
    """One layer's series of one per-layer metric, and how far it grew against the pack."""

    family: str  # a LAYER_FAMILIES key
    layer: str
    points: list[tuple[int, float]]
    growth: float  # peak / level before the incident
    pack_growth: float  # the median layer's growth
    left_pack: bool
    pack: list[tuple[int, float]] = field(default_factory=list)  # the median over the family's layers, per step


@dataclass
class IncidentView:
    """One incident: its steps, its events and alerts, and the facts the page tells."""

    number: int
    opened: int  # first warning step
    end: int  # last step that belongs to it (resolution, the next incident, or the log's end)
    critical: int | None = None
    nonfinite: int | None = None  # the first non-finite step
    resolved: int | None = None
    worst: str = "open"
    events: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)  # raised (not cleared) alerts, in order
    nonfinite_alert: dict[str, Any] | None = None
    nonfinite_location: str | None = None
    countdowns: list[Countdown] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    layers: list[LayerTrack] = field(default_factory=list)
    sentences: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    full: bool = False  # its countdowns, hints, layers and sentences are filled in (a page tells it in full)

    @property
    def lead(self) -> int | None:
        """Steps from the first warning to the first non-finite value."""
        return None if self.nonfinite is None else self.nonfinite - self.opened

    @property
    def marks(self) -> list[tuple[int, str]]:
        """(step, kind) of each marked moment: warning, critical, nonfinite, rollback, resolved."""
        out = [(self.opened, "warning")]
        out += [
            (int(e["step"]), "rollback")
            for e in self.events
            if str(e.get("action") or "").startswith("recovered: rolled back") and isinstance(e.get("step"), int)
        ]
        if self.critical is not None:
            out.append((self.critical, "critical"))
        if self.nonfinite is not None:
            out.append((self.nonfinite, "nonfinite"))
        if self.resolved is not None:
            out.append((self.resolved, "resolved"))
        return out

    def cause(self) -> dict[str, Any]:
        """The forensic cause of the first non-finite value (operator, stage, line, ...), when known."""
        d = (self.nonfinite_alert or {}).get("details") or {}
        cause = d.get("cause")
        return cause if isinstance(cause, dict) else {}

    def why(self) -> str | None:
        d = (self.nonfinite_alert or {}).get("details") or {}
        why = d.get("why") if isinstance(d.get("why"), str) else None
        return why or next((e.get("explanation") for e in self.events if e.get("explanation")), None)


def incidents_of(run: RunData, full: int | None = None) -> list[IncidentView]:
    """Every incident of the run, oldest first, with its steps, alerts and first non-finite value;
    the rest of the facts (countdowns, hints, layers, sentences) for the `full` worst ones (None:
    all; `worst_first` order), the ones a page tells in full. Linear in the records and alerts
    (each is visited a bounded number of times, whatever the number of incidents)."""
    last_step = run.records[-1].step if run.records else 0
    views = _group(run.incidents, last_step)
    steps = [r.step for r in run.records]
    nonfinite_steps = [r.step for r in run.records if not r.is_finite()]
    loud = sorted(
        (a for a in run.alerts if not a.get("cleared") and a.get("severity") in ("warning", "critical")), key=_step
    )
    loud_steps = [_step(a) for a in loud]
    for v in views:
        v.alerts = loud[bisect.bisect_left(loud_steps, v.opened) : bisect.bisect_right(loud_steps, v.end)]
        _fill_nonfinite(v, run, nonfinite_steps, steps)
        v.actions = [e["action"] for e in v.events if e.get("action")]
    for v in worst_first(views)[:full]:
        v.full = True
        v.countdowns = _countdowns(v, nonfinite_steps, last_step)
        v.hints = _hints(v)
        v.layers = _layers(v, run, steps)
        v.sentences = _sentences(v, last_step)
    return views


def worst_first(incidents: list[IncidentView]) -> list[IncidentView]:
    """Lost incidents first, then critical ones, then warnings; in step order within each."""
    rank = {"nonfinite": 0, "critical": 1}
    return sorted(incidents, key=lambda v: (rank.get(v.worst, 2), v.opened))


def _step(d: dict[str, Any]) -> int:
    s = d.get("step")
    return int(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else -1


def _group(events: list[dict[str, Any]], last_step: int) -> list[IncidentView]:
    """Incident events grouped by incident (a number reused after a restart starts a new one)."""
    views: list[IncidentView] = []
    for e in events:
        state = str(e.get("state", "open"))
        cur = views[-1] if views else None
        saved_number = e.get("number")
        number = saved_number if isinstance(saved_number, int) else len(views) + 1
        if cur is None or cur.number != number or cur.resolved is not None:
            saved_opened = e.get("opened_step")
            opened = saved_opened if isinstance(saved_opened, int) else _step(e)
            cur = IncidentView(number=number, opened=opened, end=last_step)
            views.append(cur)
        cur.events.append(e)
        s = _step(e)
        if state == "resolved":
            cur.resolved = s
            cur.end = s
        elif _RANK.get(state, 0) > _RANK.get(cur.worst, 0):
            cur.worst = state
        if state in ("critical", "nonfinite") and cur.critical is None:
            cur.critical = s
        if state == "nonfinite" and cur.nonfinite is None:
            cur.nonfinite = s
    for a, b in zip(views, views[1:]):  # an incident open until the next one: it ends there
        if a.resolved is None:
            a.end = max(a.opened, b.opened - 1)
    return views


def _fill_nonfinite(v: IncidentView, run: RunData, nonfinite_steps: list[int], steps: list[int]) -> None:
    """The first non-finite step (from the records when no event says it) and its alert."""
    i = bisect.bisect_left(nonfinite_steps, v.opened)
    first = nonfinite_steps[i] if i < len(nonfinite_steps) and nonfinite_steps[i] <= v.end else None
    if first is not None and (v.nonfinite is None or first < v.nonfinite):
        v.nonfinite = first
        v.worst = "nonfinite"
    v.nonfinite_alert = next(
        (a for a in v.alerts if a.get("kind") == "nonfinite" and a.get("severity") == "critical"), None
    )
    if v.nonfinite_alert is None:  # a live run's flight record may hold it
        v.nonfinite_alert = next(
            (
                fr["alert"]
                for fr in run.flight_records
                if isinstance(fr.get("alert"), dict)
                and fr["alert"].get("kind") == "nonfinite"
                and v.opened <= _step(fr["alert"]) <= v.end
            ),
            None,
        )
    loc = (v.nonfinite_alert or {}).get("location")
    if not loc and v.nonfinite is not None:
        i = bisect.bisect_left(steps, v.nonfinite)
        loc = run.records[i].nonfinite_location if i < len(steps) and steps[i] == v.nonfinite else None
    v.nonfinite_location = loc


def _countdowns(v: IncidentView, nonfinite_steps: list[int], last_step: int) -> list[Countdown]:
    """The incident's forecasts, each once per (metric, step); `left` within the incident, else
    the finite steps that followed (up to the run's next non-finite step or the log's end)."""
    out, seen = [], set()
    for a in v.alerts:
        d = a.get("details") or {}
        said = d.get("steps_to_overflow")
        if not isinstance(said, (int, float)) or not math.isfinite(said) or (a.get("metric"), _step(a)) in seen:
            continue
        seen.add((a.get("metric"), _step(a)))
        left = None if v.nonfinite is None else v.nonfinite - _step(a)
        rng = d.get("steps_to_overflow_range")
        span = (float(rng[0]), float(rng[1])) if isinstance(rng, list) and len(rng) == 2 else None
        later = bisect.bisect_right(nonfinite_steps, _step(a))
        followed = (nonfinite_steps[later] - 1 if later < len(nonfinite_steps) else last_step) - _step(a)
        out.append(
            Countdown(
                _step(a), str(a.get("metric")), float(said), left, bool(d.get("overflow_bound")), span, max(0, followed)
            )
        )
    return out


def _hints(v: IncidentView) -> list[str]:
    """What to do, most important first: the cause's remedy, the incident's hint, then the
    other alerts' hints, worst alert first; each hint once."""
    out: list[str] = []
    remedy = v.cause().get("remedy")
    candidates = [remedy] + [e.get("hint") for e in reversed(v.events)]
    ranked = sorted(v.alerts, key=lambda a: (-(a.get("severity") == "critical"), _step(a)))
    candidates += [a.get("hint") for a in ranked]
    for h in candidates:
        if isinstance(h, str) and h and h not in out:
            out.append(h)
    return out[:5]


def _layers(v: IncidentView, run: RunData, steps: list[int]) -> list[LayerTrack]:
    """Per-layer tracks around the incident; the layers that left the pack first (at most 8);
    when none did, the four that grew most (the page says so)."""
    lo = v.opened
    hi = v.nonfinite if v.nonfinite is not None else v.end
    recs = _layer_records(run, steps, lo - _PRE_STEPS * 4, hi)
    tracks: list[LayerTrack] = []
    for family in LAYER_FAMILIES:
        series: dict[str, list[tuple[int, float]]] = {}
        for r in recs:
            for name, val in (getattr(r, family, None) or {}).items():
                series.setdefault(name, []).append((r.step, val))
        growths = {}
        for name, pts in series.items():
            before = [abs(y) for s, y in pts if s < lo and math.isfinite(y)][-_PRE_STEPS:]
            during = [abs(y) for s, y in pts if lo <= s <= hi and math.isfinite(y)]
            if not before or not during:
                continue
            base = median(before)
            growths[name] = max(during) / base if base > 0 else math.inf
        if len(growths) < 2:
            continue
        pack = median([g for g in growths.values() if math.isfinite(g)] or [1.0])
        pack_line = _pack_line(recs, family)
        for name, g in growths.items():
            left_pack = g >= PACK_FACTOR * max(pack, 1.0)
            tracks.append(LayerTrack(family, name, series[name], g, pack, left_pack, pack_line))
    left = sorted((t for t in tracks if t.left_pack), key=lambda t: -t.growth / max(t.pack_growth, 1e-30))
    if left:
        return left[:8]
    return sorted(tracks, key=lambda t: -t.growth)[:4]


def _pack_line(recs: list[StepRecord], family: str) -> list[tuple[int, float]]:
    out = []
    for r in recs:
        vals = [abs(v) for v in (getattr(r, family, None) or {}).values() if math.isfinite(v)]
        if vals:
            out.append((r.step, median(vals)))
    return out


def _layer_records(run: RunData, steps: list[int], lo: int, hi: int) -> list[StepRecord]:
    """Records in [lo, hi] with per-layer values: the event log's, else the flight records'."""
    window = run.records[bisect.bisect_left(steps, lo) : bisect.bisect_right(steps, hi)]
    recs = [r for r in window if _has_layers(r)]
    if recs or not run.flight_records:
        return recs
    from .load import _flight_steps

    return [r for r in _flight_steps(run.flight_records) if lo <= r.step <= hi and _has_layers(r)]


def _has_layers(r: StepRecord) -> bool:
    return any(getattr(r, f, None) for f in LAYER_FAMILIES)


def _sentences(v: IncidentView, last_step: int) -> list[str]:
    """What happened, in a few sentences from the incident's events and alerts."""
    out = []
    first = v.alerts[0] if v.alerts else None
    opened = f"Incident {v.number} opened at step {v.opened}"
    if first is not None:
        same = [a for a in v.alerts if _step(a) == _step(first)]
        kinds = _names(sorted({str(a.get("kind")) for a in same}))
        out.append(f"{opened} with {kinds}: {first.get('message')}.")
    else:
        out.append(f"{opened}.")
    if v.critical is not None and v.critical != v.nonfinite:
        crit = next((a for a in v.alerts if a.get("severity") == "critical" and _step(a) == v.critical), None)
        what = f": {crit.get('message')}" if crit else ""
        out.append(f"It became critical at step {v.critical}, {v.critical - v.opened} steps later{what}.")
    if v.nonfinite is not None:
        where = f" in {v.nonfinite_location}" if v.nonfinite_location else ""
        lead = v.lead or 0
        out.append(
            f"The first non-finite value appeared at step {v.nonfinite}{where}: "
            f"{lead} step{'s' if lead != 1 else ''} after the first warning."
        )
    rerun = _rerun_sentence(v)
    if rerun:
        out.append(rerun)
    for act in v.actions:
        out.append(f"nummon acted: {act}.")
    if v.resolved is not None:
        out.append(f"It was resolved at step {v.resolved}: no open condition and no new alert for a while.")
    elif v.nonfinite is None:
        out.append(f"It was still open when the log ends at step {last_step}.")
    if v.countdowns:
        c = min(v.countdowns, key=lambda c: c.step)
        figure = f"~{fmt_num(c.span[0])}-{fmt_num(c.span[1])}" if c.span is not None else f"~{fmt_num(c.said)}"
        said = f"{figure} {'step' if c.span is None and c.said == 1 else 'steps'} to overflow on {c.metric} at step {c.step}"
        if c.left is not None:
            out.append(f"The first countdown said {said}; {c.left} {'was' if c.left == 1 else 'were'} left.")
        elif c.verdict.startswith("missed"):
            out.append(
                f"The first countdown said {said}; no overflow came in the {plural(c.followed, 'step')} that followed."
            )
        else:
            out.append(f"The first countdown said {said}.")
    return out


def _rerun_sentence(v: IncidentView) -> str | None:
    """The re-run's verdict on the incident's first judged step: hardware or algorithm."""
    for a in v.alerts:
        d = a.get("details") or {}
        verdict = d.get("verdict")
        if verdict == "reproducible":
            batch = d.get("batch_fingerprint")
            named = f" (batch {batch})" if batch else ""
            return (
                f"Re-run at step {_step(a)} on the same batch{named} and weights, it failed again: reproducible, "
                "the data or the optimisation, not the hardware."
            )
        if verdict == "not_reproducible":
            suspect = d.get("suspect") or {}
            where = ", ".join(f"{k} {suspect[k]}" for k in ("rank", "host", "device") if suspect.get(k) is not None)
            return (
                f"Re-run at step {_step(a)} on the same batch and weights, it did not fail again: not reproducible, "
                f"a transient fault{f' on {where}' if where else ''} (hardware, memory or a nondeterministic kernel)."
            )
    return None


def _names(kinds: list[str]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
