"""Inline SVG charts written as text (pure Python, no plotting library): stacked panels that share
a step axis, on log or linear scales, with marked steps; and small multiples.

Non-finite values are drawn as crosses at the top of their panel (a NaN has no height); values
<= 0 have no place on a log scale and are left out. `thin` keeps every point near the marked
steps and the lowest and highest of each bucket elsewhere, so a spike far from the incident
stays visible while a 100,000-step run stays small.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

__all__ = ["Series", "Panel", "Mark", "thin", "stacked_chart", "small_chart", "MARK_COLORS"]

Point = tuple[float, float]

MARK_COLORS = {
    "warning": "#d97706",
    "critical": "#dc2626",
    "nonfinite": "#7c3aed",
    "rollback": "#2563eb",
    "resolved": "#16a34a",
}
MARK_WORDS = {
    "warning": "warning",
    "critical": "critical",
    "nonfinite": "first NaN/Inf",
    "rollback": "rolled back",
    "resolved": "resolved",
}
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif"


@dataclass
class Series:
    label: str
    color: str
    points: list[Point]
    dots: bool = False  # sampled series (mechanisms): a dot per value


@dataclass
class Panel:
    title: str
    series: list[Series]
    log: bool = True
    note: str = ""  # e.g. "decades to the dtype's max"


@dataclass(frozen=True)
class Mark:
    step: float
    kind: str  # a MARK_COLORS key
    label: str = ""


@dataclass
class _Axis:
    lo: float
    hi: float
    ticks: list[float] = field(default_factory=list)
    log: bool = False


def thin(points: Sequence[Point], keep: Sequence[tuple[float, float]], budget: int) -> list[Point]:
    """`points` (in x order) with every point inside a `keep` interval, and elsewhere the lowest
    and highest y of each of `budget` buckets over the x range (and every non-finite y)."""
    if len(points) <= budget * 2:
        return list(points)
    x0, x1 = points[0][0], points[-1][0]
    width = (x1 - x0) / budget or 1.0
    out: list[Point] = []
    bucket: dict[int, list[Point]] = {}
    order: list[int] = []

    def flush() -> None:
        for b in order:
            pts = bucket[b]
            lo = min(pts, key=lambda p: p[1])
            hi = max(pts, key=lambda p: p[1])
            out.extend(sorted({lo, hi}))
        bucket.clear()
        order.clear()

    spans = _merged(keep)
    at = 0  # the first span that may still hold a point (points come in x order)
    for p in points:
        x, y = p
        while at < len(spans) and spans[at][1] < x:
            at += 1
        if not math.isfinite(y) or (at < len(spans) and spans[at][0] <= x):
            flush()
            out.append(p)
            continue
        b = int((x - x0) / width)
        if b not in bucket:
            bucket[b] = []
            order.append(b)
        bucket[b].append(p)
    flush()
    return out


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals `spans`, sorted and overlapping ones merged."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _nice_step(span: float, n: int) -> float:
    raw = span / max(n, 1)
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _linear_axis(values: list[float], n: int = 4) -> _Axis:
    """Ticks at a round step over the values' range; a range wider than the largest double
    (values swinging between -1e308 and 1e308) is measured in halves, never overflowing."""
    lo, hi = min(values), max(values)
    if hi / 2 - lo / 2 < 0.5e-12 * max(1.0, abs(hi)):
        lo, hi = lo - 1, hi + 1
    step = min(_nice_step(hi / 2 - lo / 2, n) * 2, 1e308)
    lo, hi = _round_to(lo, step, math.floor), _round_to(hi, step, math.ceil)
    count = int(round(hi / step - lo / step))
    return _Axis(lo, hi, [lo + i * step for i in range(count + 1)], False)


def _round_to(v: float, step: float, how: Callable[[float], int]) -> float:
    """`v` rounded to a multiple of `step` (floor or ceil), kept within the doubles."""
    return max(-1.7e308, min(1.7e308, how(v / step) * step))


def _log_axis(values: list[float], n: int = 4) -> _Axis:
    logs = [math.log10(v) for v in values]
    lo, hi = math.floor(min(logs)), math.ceil(max(logs))
    if hi - lo < 1:
        hi = lo + 1
    every = max(1, math.ceil((hi - lo) / n))
    hi = lo + every * math.ceil((hi - lo) / every)
    return _Axis(lo, hi, [float(k) for k in range(int(lo), int(hi) + 1, every)], True)


def tick_text(v: float, log: bool) -> str:
    """A short tick label: 0.01 .. 1000 written out, else 1e5 / 1e-5 (log) or %g (linear)."""
    if log:
        k = int(round(v))
        return f"{10.0**k:g}" if -2 <= k <= 3 else f"1e{k}"
    if v == 0:
        return "0"
    a = abs(v)
    return f"{v:.0f}" if 1 <= a < 1e5 and float(v).is_integer() else f"{v:.3g}"


def _step_ticks(x0: float, x1: float, n: int) -> list[float]:
    step = max(1.0, _nice_step(x1 - x0, n))
    first = math.ceil(x0 / step) * step
    return [first + i * step for i in range(int((x1 - first) / step) + 1)]


def _path(points: list[tuple[float, float]]) -> str:
    return "M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in points)


def _panel_svg(
    p: Panel,
    x0: float,
    x1: float,
    left: float,
    top: float,
    w: float,
    h: float,
    marks: Sequence[Mark],
    legend: bool = True,
) -> list[str]:
    """One panel's SVG elements: frame, y ticks, mark lines, the series, non-finite crosses."""
    finite = [y for s in p.series for _, y in s.points if math.isfinite(y) and (y > 0 or not p.log)]

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0 or 1) * w

    out = [f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fff" stroke="#d1d5db"/>']
    ticks, sy = _y_axis_svg(p.log, finite, left, top, w, h)
    out += ticks
    for m in marks:
        mx = sx(m.step)
        if left <= mx <= left + w:
            out.append(
                f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{top}" y2="{top + h}" stroke="{MARK_COLORS.get(m.kind, "#888")}" '
                'stroke-width="1.5" stroke-dasharray="4 3"/>'
            )
    for s in p.series:
        out += _series_svg(s, x0, x1, sx, sy, p.log, top)
    # the title and legend inside the panel, top-left, on a white plate so curves do not hide it
    if legend:
        out += _legend_svg(p, bool(finite), left, top, w, h)
    return out


def _y_axis_svg(
    log: bool, finite: list[float], left: float, top: float, w: float, h: float
) -> tuple[list[str], Callable[[float], float] | None]:
    """(the y grid lines and tick labels, value -> y pixel) for a panel's finite values; no lines
    and no scale when there are none."""
    if not finite:
        return [], None
    out: list[str] = []
    ax = _log_axis(finite) if log else _linear_axis(finite)
    half = (ax.hi / 2 - ax.lo / 2) or 1.0  # half the span: finite whatever the values
    to_y = (lambda v: math.log10(v)) if log else (lambda v: v)

    def sy(v: float) -> float:
        return top + h - (to_y(v) / 2 - ax.lo / 2) / half * h

    for t in ax.ticks:
        ty = top + h - (t / 2 - ax.lo / 2) / half * h
        out.append(f'<line x1="{left}" x2="{left + w}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="#eef0f3"/>')
        out.append(
            f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end" class="t">{escape(tick_text(t, ax.log))}</text>'
        )
    return out, sy


def _series_svg(
    s: Series,
    x0: float,
    x1: float,
    sx: Callable[[float], float],
    sy: Callable[[float], float] | None,
    log: bool,
    top: float,
) -> list[str]:
    """One series within [x0, x1]: its finite runs as lines (or dots), its non-finite values as
    crosses at the top of the panel (`sy` None: the panel has no finite value to scale by)."""
    out: list[str] = []
    segs: list[list[tuple[float, float]]] = [[]]
    crosses = []
    for x, y in s.points:
        if not (x0 <= x <= x1):
            continue
        if not math.isfinite(y):
            crosses.append(sx(x))
            segs.append([])
        elif sy is not None and (y > 0 or not log):
            segs[-1].append((sx(x), sy(y)))
    for seg in segs:
        if len(seg) > 1:
            out.append(
                f'<path d="{_path(seg)}" fill="none" stroke="{s.color}" stroke-width="1.6" stroke-linejoin="round"/>'
            )
        if s.dots or len(seg) == 1:
            out.extend(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2" fill="{s.color}"/>' for cx, cy in seg)
    for cx in crosses[:200]:
        cy = top + 7
        out.append(
            f'<path d="M{cx - 4:.1f},{cy - 4:.1f}l8,8m0,-8l-8,8" stroke="{MARK_COLORS["nonfinite"]}" stroke-width="2"/>'
        )
    return out


def _legend_svg(p: Panel, any_finite: bool, left: float, top: float, w: float, h: float) -> list[str]:
    """The panel's title, its series' names (when more than one), and "not recorded" when it has
    no value at all."""
    label = escape(p.title) + (f' <tspan class="n">{escape(p.note)}</tspan>' if p.note else "")
    out = [
        f'<text x="{left + 8}" y="{top + 15}" class="pt" paint-order="stroke" stroke="#fff" stroke-width="4">{label}</text>'
    ]
    if len(p.series) > 1:
        lx = left + w - 8
        for s in reversed(p.series):
            out.append(
                f'<text x="{lx:.1f}" y="{top + 15}" text-anchor="end" class="t" fill="{s.color}" '
                f'paint-order="stroke" stroke="#fff" stroke-width="4">{escape(s.label)}</text>'
            )
            lx -= 8 + 6.5 * len(s.label)
    if not any_finite and not any(not math.isfinite(y) for s in p.series for _, y in s.points):
        out.append(f'<text x="{left + w / 2}" y="{top + h / 2}" text-anchor="middle" class="n">not recorded</text>')
    return out


def stacked_chart(
    panels: Sequence[Panel],
    x0: float,
    x1: float,
    marks: Sequence[Mark] = (),
    lead: tuple[float, float, str] | None = None,
    width: int = 960,
    panel_h: int = 104,
    band: tuple[float, float] | None = None,
    bands: Sequence[tuple[float, float, str]] = (),
) -> str:
    """Panels stacked on one step axis [x0, x1]; `marks` drawn across all of them and labelled
    on top; `lead` = (from, to, text) drawn as a bracket above; `bands` shade step ranges."""
    left, right, gap = 66, 14, 16
    head = (54 if lead else 40) if marks or lead else 10
    w = width - left - right
    height = head + len(panels) * (panel_h + gap) + 24
    x1 = x1 if x1 > x0 else x0 + 1

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" style="{_FONT};max-width:100%;height:auto">',
        "<style>.t{font-size:11px;fill:#4b5563}.pt{font-size:12.5px;font-weight:600;fill:#111827}"
        ".n{font-size:11px;fill:#6b7280;font-weight:400}.m{font-size:12px;font-weight:700}</style>",
    ]
    body_top, body_h = head, len(panels) * (panel_h + gap) - gap
    for i, p in enumerate(panels):
        out.extend(_panel_svg(p, x0, x1, left, head + i * (panel_h + gap), w, panel_h, marks))
    if bands:  # shading on top of the white panels
        for a, b, color in bands:
            a, b = max(a, x0), min(b, x1)
            if b >= a:
                out.append(
                    f'<rect x="{sx(a):.1f}" y="{body_top}" width="{max(2.0, sx(b) - sx(a)):.1f}" '
                    f'height="{body_h}" fill="{color}" opacity="0.12"/>'
                )
    bottom = head + body_h
    for t in _step_ticks(x0, x1, 8):
        tx = sx(t)
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#9ca3af"/>')
        out.append(f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle" class="t">{tick_text(t, False)}</text>')
    out.extend(_mark_labels(marks, sx, left, left + w, lead))
    out.append("</svg>")
    return "\n".join(out)


def _mark_labels(
    marks: Sequence[Mark], sx, xmin: float, xmax: float, lead: tuple[float, float, str] | None
) -> list[str]:
    out = []
    placed: list[tuple[float, float, int]] = []  # (x from, x to, row) of labels drawn
    for m in sorted(marks, key=lambda m: m.step):
        x = sx(m.step)
        if not xmin - 1 <= x <= xmax + 1:
            continue
        text = m.label or f"{MARK_WORDS.get(m.kind, m.kind)} {m.step:g}"
        wtext = 6.8 * len(text)
        anchor_x = min(max(x - wtext / 2, xmin), xmax - wtext)
        row = 0
        while any(not (anchor_x + wtext < a or anchor_x > b) and r == row for a, b, r in placed):
            row += 1
        placed.append((anchor_x - 4, anchor_x + wtext + 4, row))
        y = 14 + 14 * min(row, 1)
        out.append(
            f'<text x="{anchor_x:.1f}" y="{y}" class="m" fill="{MARK_COLORS.get(m.kind, "#333")}">{escape(text)}</text>'
        )
    if lead is not None:
        a, b, text = sx(lead[0]), sx(lead[1]), lead[2]
        if b > a:
            y = 48  # below the two rows of mark labels
            out.append(f'<path d="M{a:.1f},{y - 4}v4H{b:.1f}v-4" fill="none" stroke="#111827" stroke-width="1.2"/>')
            out.append(
                f'<text x="{(a + b) / 2:.1f}" y="{y - 3}" text-anchor="middle" class="m" fill="#111827" '
                f'paint-order="stroke" stroke="#fff" stroke-width="4">{escape(text)}</text>'
            )
    return out


def small_chart(
    title: str,
    subtitle: str,
    main: Series,
    pack: Sequence[Point],
    x0: float,
    x1: float,
    marks: Sequence[Mark] = (),
    width: int = 302,
    height: int = 128,
) -> str:
    """One layer's series (colour) over the pack's median (grey), log scale, marks dashed."""
    left, top, w, h = 40, 30, width - 48, height - 48
    panel = Panel("", [Series("pack", "#9ca3af", list(pack)), main], log=True)
    body = _panel_svg(panel, x0, x1 if x1 > x0 else x0 + 1, left, top, w, h, marks, legend=False)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" style="{_FONT}">',
        "<style>.t{font-size:10px;fill:#4b5563}.n{font-size:10px;fill:#6b7280}</style>",
        f'<text x="4" y="13" style="font-size:12.5px;font-weight:700" fill="{main.color}">{escape(title)}</text>',
        f'<text x="4" y="26" class="n">{escape(subtitle)}</text>',
        *body,
    ]
    for t in (x0, x1):
        out.append(
            f'<text x="{left + (t - x0) / ((x1 - x0) or 1) * w:.1f}" y="{top + h + 13}" text-anchor="middle" '
            f'class="t">{tick_text(t, False)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)
