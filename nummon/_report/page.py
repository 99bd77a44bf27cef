"""The report page: one self-contained HTML document (inline CSS and SVG, no script, nothing
fetched), built from a run's data and its incidents."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from .._core.text import fmt_num, plural, printable
from .._core.types import StepRecord
from .load import RunData
from .story import LAYER_FAMILIES, IncidentView, incidents_of, worst_first
from .svg import MARK_COLORS, Mark, Panel, Series, small_chart, stacked_chart, thin

__all__ = ["render", "SIGNALS"]

# (record field, panel title, colour, log scale, note): the timeline's panels, in order
SIGNALS: tuple[tuple[str, str, str, bool, str], ...] = (
    ("loss", "loss", "#2563eb", True, ""),
    ("grad_norm", "grad norm", "#0891b2", True, "pre-clip, all parameters"),
    ("activation_max", "max activation", "#ea580c", True, "max |output| over watched modules"),
    ("headroom", "float headroom", "#059669", False, "decades left below the dtype's max"),
    ("attention_logit_max", "attention logit", "#db2777", True, "max pre-softmax logit"),
    ("output_logsumexp_mean", "output log Z", "#9333ea", False, "mean log-sum-exp of the logits"),
    ("adam_ratio_rms", "Adam ratio", "#65a30d", True, "RMS of g / sqrt(v)"),
)
_SAMPLED = {"attention_logit_max", "output_logsumexp_mean", "adam_ratio_rms"}
_FULL_INCIDENTS = 8  # incidents drawn in full; later ones are listed
_LISTED = 500  # incidents listed after those (the rest are counted)
_KEPT_MARKS = 64  # incidents (worst first) whose steps the whole run's chart draws densely
_BUDGET = 400  # buckets per series far from the incident (each keeps its lowest and highest value)
_LAYER_COLORS = ("#dc2626", "#7c3aed", "#ea580c", "#0891b2", "#db2777", "#2563eb", "#65a30d", "#92400e")

_CSS = """
*{box-sizing:border-box}body{margin:0;background:#f3f4f6;color:#111827;
font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif}
main{max-width:1000px;margin:0 auto;padding:18px 20px 40px}
h1{font-size:20px;margin:0 0 2px}h2{font-size:17px;margin:0 0 10px}h3{font-size:14px;margin:14px 0 6px;
text-transform:uppercase;letter-spacing:.04em;color:#374151}
.src{color:#6b7280;font-size:12.5px;word-break:break-all}
.verdict{border-radius:8px;padding:12px 16px;margin:12px 0 16px;font-size:16px;font-weight:600;color:#fff}
.v-nonfinite{background:#6d28d9}.v-critical{background:#b91c1c}.v-open{background:#b45309}.v-ok{background:#15803d}
.v-resolved{background:#15803d}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:14px 16px;margin:0 0 16px}
.facts{display:flex;gap:10px;flex-wrap:wrap;margin:0 0 8px}
.fact{border:1px solid #e5e7eb;border-left:5px solid #9ca3af;border-radius:6px;padding:4px 10px;min-width:120px}
.fact b{display:block;font-size:18px}.fact span{font-size:12px;color:#6b7280}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.box{background:#f9fafb;border:1px solid #e5e7eb;border-radius:6px;padding:8px 12px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,monospace;background:#eef0f3;padding:0 3px;border-radius:3px;
word-break:break-word}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#6b7280;font-weight:600}dt{color:#6b7280;font-size:12px}dd{margin:0 0 6px}
.grid{display:flex;flex-wrap:wrap;gap:6px}.grid svg{background:#fff;border:1px solid #e5e7eb;border-radius:6px}
ol{margin:4px 0;padding-left:20px}li{margin:2px 0}details{margin-top:10px}summary{cursor:pointer;color:#374151}
.muted{color:#6b7280}footer{color:#6b7280;font-size:12px;margin-top:8px}
@media(max-width:760px){.cols{grid-template-columns:1fr}}
"""


def render(run: RunData, version: str = "") -> str:
    """The report of `run` as one HTML document."""
    incidents = incidents_of(run, _FULL_INCIDENTS)
    title = _verdict(run, incidents)
    parts = [
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title[1])}</title><style>{_CSS}</style></head><body><main>",
        f'<h1>nummon incident report</h1><div class="src">{escape(printable(run.source))} · {_span_text(run)}'
        f"{' · ' + escape(run.format) if run.format else ''}</div>",
        f'<div class="verdict v-{title[0]}">{escape(title[1])}</div>',
    ]
    ranked = worst_first(incidents)
    for v in ranked[:_FULL_INCIDENTS]:
        parts.append(_incident_section(v, run))
    if len(incidents) > _FULL_INCIDENTS:
        parts.append(_more_incidents(ranked[_FULL_INCIDENTS:]))
    parts.append(_overview(run, incidents))
    parts.append(
        f"<footer>Made by <code>nummon report</code>{' ' + escape(version) if version else ''}: "
        "one page, no script, nothing fetched; it opens offline and can be attached to a ticket. "
        "Curves are drawn on log scales where a quantity spans decades; far from an incident each "
        "stretch of steps keeps its lowest and highest value, near it every step is drawn.</footer>"
    )
    parts.append("</main></body></html>\n")
    return "\n".join(parts)


def _span_text(run: RunData) -> str:
    if not run.records:
        return "no step records"
    a, b = run.records[0].step, run.records[-1].step
    return f"{run.n_records:,} records, steps {a}–{b}"


def _verdict(run: RunData, incidents: list[IncidentView]) -> tuple[str, str]:
    """(css class, one sentence) saying how the run stands, worst incident first."""
    if not run.records:
        return "open", "No step records: nothing to report."
    if not incidents:
        return "ok", (
            f"Healthy: no warning in {run.n_records:,} records (steps {run.records[0].step}–{run.records[-1].step})."
        )
    lost = next((v for v in incidents if v.nonfinite is not None), None)
    if lost is not None:
        where = f" in {lost.nonfinite_location}" if lost.nonfinite_location else ""
        return "nonfinite", (
            f"Run lost at step {lost.nonfinite}: first non-finite value{where}, "
            f"{lost.lead} steps after the first warning (step {lost.opened})."
        )
    worst = max(incidents, key=lambda v: ("open", "critical").index(v.worst) if v.worst in ("open", "critical") else 0)
    n = len(incidents)
    state = "still open" if worst.resolved is None else f"resolved at step {worst.resolved}"
    word = "critical" if worst.worst == "critical" else "warning"
    cls = "critical" if worst.worst == "critical" else ("resolved" if worst.resolved is not None else "open")
    return cls, (
        f"{n} incident{'s' if n > 1 else ''}, no non-finite value; the worst reached {word} at step "
        f"{worst.critical if worst.critical is not None else worst.opened} ({state})."
    )


def _series(records: Sequence[StepRecord], field: str) -> list[tuple[float, float]]:
    out = []
    for r in records:
        v = getattr(r, field, None)
        if v is not None:
            out.append((float(r.step), float(v)))
        elif not r.is_finite() and field in ("loss", "grad_norm", "activation_max") and field in _nonfinite_parts(r):
            out.append((float(r.step), math.nan))
    return out


def _nonfinite_parts(r: StepRecord) -> str:
    return "loss grad_norm activation_max" if not r.nonfinite_parts else " ".join(r.nonfinite_parts)


def _panels(records: Sequence[StepRecord], keep: list[tuple[float, float]]) -> list[Panel]:
    panels = []
    for field, title, color, log, note in SIGNALS:
        pts = _series(records, field)
        if not pts:
            continue
        finite = [y for _, y in pts if math.isfinite(y)]
        if log and any(y <= 0 for y in finite):
            log = False  # a loss that goes negative: a linear scale shows it
        elif not log and field != "headroom" and finite and min(finite) > 0 and max(finite) > 1e3 * min(finite):
            log = True  # log Z blown up to 1e33: only a log scale shows where it started
        dtype = next((r.headroom_dtype for r in records if r.headroom_dtype), None)
        if field == "headroom" and dtype:
            note = f"decades left below {dtype}'s max"
        panels.append(
            Panel(
                title,
                [Series(title, color, thin(pts, keep, _BUDGET), dots=field in _SAMPLED and len(pts) < 300)],
                log=log,
                note=note,
            )
        )
    return panels


def _window(v: IncidentView, run: RunData) -> tuple[float, float]:
    first, last = run.records[0].step, run.records[-1].step
    stop = v.nonfinite if v.nonfinite is not None else (v.resolved if v.resolved is not None else v.end)
    pad = max(12, (stop - v.opened) // 2)
    return max(first, v.opened - pad), min(last, stop + max(4, pad // 3))


def _incident_section(v: IncidentView, run: RunData) -> str:
    x0, x1 = _window(v, run)
    recs = [r for r in run.records if x0 <= r.step <= x1]
    keep = [(m - 60.0, m + 60.0) for m, _ in v.marks]
    marks = [Mark(s, k) for s, k in v.marks]
    lead = (v.opened, v.nonfinite, f"lead: {v.lead} steps") if v.nonfinite is not None and (v.lead or 0) > 0 else None
    chart = (
        stacked_chart(_panels(recs, keep), x0, x1, marks, lead)
        if recs
        else "<p class=muted>No records in this window.</p>"
    )
    state = {"nonfinite": "lost (non-finite)", "critical": "critical", "open": "warning"}.get(v.worst, v.worst)
    end = v.nonfinite if v.nonfinite is not None else (v.resolved if v.resolved is not None else v.end)
    out = [
        f"<section><h2>Incident {v.number} · steps {v.opened}–{end} · {escape(state)}"
        f"{' · resolved' if v.resolved is not None else ''}</h2>",
        _facts(v),
        chart,
        "<div class=cols><div>",
        "<h3>What happened</h3>",
        "".join(f'<p style="margin:4px 0">{escape(s)}</p>' for s in v.sentences),
        "</div><div>",
        _first_nonfinite(v),
        "</div></div>",
    ]
    if v.countdowns:
        out.append(_countdown_table(v))
    if v.hints:
        out.append("<h3>What to do</h3><ol>" + "".join(f"<li>{escape(h)}</li>" for h in v.hints) + "</ol>")
    out.append(_layers(v, x0, x1))
    out.append(_alert_list(v))
    out.append("</section>")
    return "\n".join(out)


def _facts(v: IncidentView) -> str:
    items = [("warning", "first warning", v.opened)]
    if v.critical is not None:
        items.append(("critical", "critical", v.critical))
    if v.nonfinite is not None:
        items.append(("nonfinite", "first NaN/Inf", v.nonfinite))
    if v.resolved is not None:
        items.append(("resolved", "resolved", v.resolved))
    cells = [
        f'<div class=fact style="border-left-color:{MARK_COLORS[k]}"><span>{w}</span><b>step {s}</b></div>'
        for k, w, s in items
    ]
    if v.lead is not None:
        cells.append(
            f'<div class=fact style="border-left-color:#111827"><span>lead (warning → NaN)</span>'
            f"<b>{v.lead} steps</b></div>"
        )
    return "<div class=facts>" + "".join(cells) + "</div>"


def _first_nonfinite(v: IncidentView) -> str:
    if v.nonfinite is None:
        return "<h3>First non-finite tensor</h3><p class=muted>None: no value became NaN or Inf in this incident.</p>"
    rows: list[tuple[str, str]] = [("tensor", f"<code>{escape(v.nonfinite_location or 'not recorded')}</code>")]
    c = v.cause()
    if c:
        op = " ".join(str(c[k]) for k in ("cause", "op") if c.get(k))
        if c.get("stage"):
            op += f" during the {c['stage']}"
        rows.append(("cause", escape(op)))
        if c.get("location"):
            rows.append(
                (
                    "line",
                    f"<code>{escape(str(c['location']))}</code>"
                    + (f" in <code>{escape(str(c['module']))}</code>" if c.get("module") else ""),
                )
            )
        if c.get("source"):
            rows.append(("source", f"<code>{escape(str(c['source']))}</code>"))
        if c.get("input_ranges"):
            rows.append(("why", escape(str(c["input_ranges"]))))
    elif v.why():
        rows.append(("why", escape(v.why() or "")))
    d = (v.nonfinite_alert or {}).get("details") or {}
    if d.get("parts"):
        rows.append(("went non-finite", escape(", ".join(map(str, d["parts"])))))
    if d.get("batch_fingerprint"):
        rows.append(("batch", f"<code>{escape(str(d['batch_fingerprint']))}</code>"))
    if d.get("worst_samples"):
        rows.append(("worst samples", escape(", ".join(map(str, d["worst_samples"][:8])))))
    flight_record = (v.nonfinite_alert or {}).get("flight_record")
    if flight_record:
        rows.append(("flight record", f"<code>{escape(str(flight_record))}</code>"))
    body = "".join(f"<dt>{k}</dt><dd>{val}</dd>" for k, val in rows)
    return f"<h3>First non-finite tensor · step {v.nonfinite}</h3><dl class=box>{body}</dl>"


def _countdown_table(v: IncidentView) -> str:
    rows = []
    for c in v.countdowns[:10]:
        said = f"{'≤' if c.bound else '~'}{fmt_num(c.said)} {'step' if c.said == 1 else 'steps'}"
        if c.span is not None:
            said = f"~{fmt_num(c.span[0])}–{fmt_num(c.span[1])} steps"
        left = "—" if c.left is None else plural(c.left, "step")
        rows.append(
            f"<tr><td>step {c.step}</td><td><code>{escape(c.metric)}</code></td><td>{said}</td>"
            f"<td>{left}</td><td class=muted>{escape(c.verdict)}</td></tr>"
        )
    more = len(v.countdowns) - 10
    more_text = f"<p class=muted>… and {plural(more, 'more forecast')}.</p>" if more > 0 else ""
    head = "<tr><th>said at</th><th>metric</th><th>steps to overflow said</th><th>steps left to the first NaN/Inf</th><th></th></tr>"
    return f"<h3>Countdown: said vs left</h3><table>{head}{''.join(rows)}</table>{more_text}"


def _layers(v: IncidentView, x0: float, x1: float) -> str:
    if not v.layers:
        return ""
    left = any(t.left_pack for t in v.layers)
    head = (
        "Layers that left the pack" if left else "No layer left the pack: they grew together (the four that grew most)"
    )
    marks = [Mark(s, k) for s, k in v.marks]
    charts = []
    for i, t in enumerate(v.layers):
        pts = [(float(s), y) for s, y in t.points if x0 <= s <= x1]
        color = _LAYER_COLORS[i % len(_LAYER_COLORS)] if t.left_pack else "#2563eb"
        sub = f"{LAYER_FAMILIES[t.family]}: grew ×{fmt_num(t.growth)}, median layer ×{fmt_num(t.pack_growth)}"
        charts.append(
            small_chart(
                t.layer,
                sub,
                Series(t.layer, color, pts),
                [(float(s), y) for s, y in t.pack if x0 <= s <= x1],
                x0,
                x1,
                marks,
            )
        )
    key = '<p class=muted style="margin:0 0 6px">Colour: the layer; grey: the median layer of the same metric.</p>'
    return f"<h3>{escape(head)}</h3>{key}<div class=grid>{''.join(charts)}</div>"


def _alert_list(v: IncidentView) -> str:
    if not v.alerts:
        return ""
    rows = "".join(
        f'<tr><td>{escape(str(a.get("step")))}</td><td style="color:{MARK_COLORS["critical"] if a.get("severity") == "critical" else MARK_COLORS["warning"]}">'
        f"{escape(str(a.get('severity')))}</td><td>{escape(str(a.get('kind')))}</td>"
        f"<td>{escape(str(a.get('message'))[:300])}</td></tr>"
        for a in v.alerts[:200]
    )
    return f"<details><summary>All {len(v.alerts)} alerts of this incident</summary><table>{rows}</table></details>"


def _more_incidents(rest: list[IncidentView]) -> str:
    rows = "".join(
        f"<tr><td>{v.number}</td><td>{v.opened}</td><td>{escape(v.worst)}</td>"
        f"<td>{'' if v.nonfinite is None else v.nonfinite}</td>"
        f"<td>{'' if v.resolved is None else v.resolved}</td></tr>"
        for v in rest[:_LISTED]
    )
    unlisted = f"<p class=muted>… and {plural(len(rest) - _LISTED, 'more incident')}, not listed.</p>"
    return (
        f"<section><h2>{plural(len(rest), 'more incident')}</h2><table><tr><th>incident</th><th>opened</th><th>worst</th>"
        f"<th>first NaN/Inf</th><th>resolved</th></tr>{rows}</table>"
        f"{unlisted if len(rest) > _LISTED else ''}</section>"
    )


def _bands(incidents: list[IncidentView], pixel: float) -> list[tuple[float, float, str]]:
    """The incidents' shaded step ranges, one colour each for warning and critical; ranges of a
    colour closer than a pixel are one band (a page stays small whatever the incidents)."""
    out: dict[str, list[list[float]]] = {}
    for v in sorted(incidents, key=lambda v: v.opened):
        color = MARK_COLORS["critical" if v.worst in ("critical", "nonfinite") else "warning"]
        end = v.nonfinite if v.nonfinite is not None else (v.resolved or v.end)
        runs = out.setdefault(color, [])
        if runs and v.opened <= runs[-1][1] + pixel:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([v.opened, end])
    return [(a, b, color) for color, runs in out.items() for a, b in runs]


def _overview(run: RunData, incidents: list[IncidentView]) -> str:
    if not run.records:
        return ""
    x0, x1 = run.records[0].step, run.records[-1].step
    keep = [(m - 60.0, m + 60.0) for v in worst_first(incidents)[:_KEPT_MARKS] for m, _ in v.marks]
    bands = _bands(incidents, (x1 - x0) / 960)
    chart = stacked_chart(_panels(run.records, keep), x0, x1, [], None, bands=bands, panel_h=90)
    head = "The whole run" if incidents else "The run's curves"
    note = " (incidents shaded)" if incidents else ""
    return f"<section><h2>{head}{note}</h2>{chart}</section>"
