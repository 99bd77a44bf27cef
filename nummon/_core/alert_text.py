"""Alerts and records in words, for sinks and the command line: an alert's value with name and
unit, the threshold it crossed, the alert as a whole, the length limits of titles and texts, and
a small table of step records. Pure string work over plain data (the rules every text shares are
`text.py`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .text import fmt_num
from .types import Alert, AlertKind

__all__ = [
    "SUMMARY_MAX",
    "TABLE_COLUMNS",
    "TITLE_MAX",
    "alert_text",
    "records_table",
    "sci",
    "threshold_text",
    "value_text",
]

TITLE_MAX = 63  # W&B alert titles must stay under 64 characters
SUMMARY_MAX = 999  # and texts under 1000


def sci(v: float) -> str:
    """A number for people: 6.0e34, 1.6e6 for large or tiny magnitudes, 4 significant digits otherwise."""
    if isinstance(v, float) and math.isfinite(v) and v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        mantissa, exponent = f"{v:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return sci(float(v))
    return fmt_num(v)


#: what the value of each (kind, metric) measures, where it is not the metric itself ({v}: the value)
_VALUE_NAMES = {
    (AlertKind.OSCILLATION, "loss"): "loss relative spread {v}",
    (AlertKind.ATTENTION_LOGITS, "attention_logit_max"): "max attention logit {v}",
    (AlertKind.ATTENTION_COLLAPSE, "attention_entropy"): "attention entropy {v} of its maximum",
    (AlertKind.OUTPUT_LOGITS, "output_logsumexp_mean"): "mean log-sum-exp of the output logits {v}",
    (AlertKind.ADAM_SECOND_MOMENT, "adam_ratio_rms"): "RMS(g/sqrt(v)) {v}",
    (AlertKind.ADAM_SECOND_MOMENT, "update_ratio_max"): "Adam update {v} of its tensor's norm",
    (AlertKind.VANISHING, "layer_grad_norm"): "smallest layer gradient norm {v}",
    (AlertKind.REPLICA_MISMATCH, "replica_fingerprint"): "{v} rank(s) out of step with the others",
}


def value_text(
    kind: AlertKind,
    metric: str,
    value: float | None,
    details: dict[str, Any] | None = None,
    location: str | None = None,
) -> str | None:
    """The value of an alert with its name and unit ("loss 6.0e34 (3.7 decades of float32
    headroom left)", "1.6e6 non-finite elements in output of `fc1`"); None when it has none."""
    d = details or {}
    if kind is AlertKind.EXTREME and value is not None:
        left = f"{value:.1f} decades of {d.get('dtype', 'float32')} headroom left"
        mag = d.get("magnitude")
        return f"{metric} {sci(mag)} ({left})" if isinstance(mag, (int, float)) else left
    if kind is AlertKind.NONFINITE:
        if d.get("rule") == "log_skip_level_shift" and value is not None:
            return f"loss {value:.3g}x its level before the non-finite {', '.join(d.get('parts') or ['gradients'])}"
        if metric == "input" and value is not None:
            return f"{sci(int(value))} non-finite values in the input batch"
        if metric == "scaled_gradients":
            return "scaled gradients overflowed: the GradScaler skipped the step"
        n = d.get("elements")
        where = location or metric
        if isinstance(n, int) and n > 0:
            return f"{sci(n)} non-finite element{'' if n == 1 else 's'} in {where}"
        return f"non-finite {', '.join(d.get('parts') or [where])}"
    if metric == "recovery" and d.get("recovery") == "rollback" and isinstance(d.get("to_step"), int):
        to = int(d["to_step"])  # the step whose state was restored: -1, the state before any step
        return "rolled back to the start (before step 0)" if to < 0 else f"rolled back to step {to}"
    if value is None:
        return None
    if (kind, metric) == (AlertKind.ADAM_SECOND_MOMENT, "adam_small_grad_fraction"):
        return f"{value:.0%} of gradient elements below Adam's eps"
    text = _VALUE_NAMES.get((kind, metric), metric + " {v}").format(v=sci(value))
    ratio, base = d.get("ratio"), d.get("baseline")
    if (
        kind in (AlertKind.LOSS_SPIKE, AlertKind.EXPLOSION)
        and isinstance(ratio, (int, float))
        and isinstance(base, (int, float))
    ):
        text += f" ({ratio:.3g}x its recent median {sci(base)})"
    return text


#: kinds whose threshold is in the unit of their value
_THRESHOLD_IN_VALUE_UNITS = frozenset(
    {
        AlertKind.EXTREME,
        AlertKind.LOSS_SPIKE,
        AlertKind.EXPLOSION,
        AlertKind.DIVERGENCE,
        AlertKind.OSCILLATION,
        AlertKind.ATTENTION_LOGITS,
        AlertKind.ADAM_SECOND_MOMENT,
    }
)


def threshold_text(
    kind: AlertKind, metric: str, threshold: float | None, details: dict[str, Any] | None = None
) -> str | None:
    """The limit an alert's value crossed, with its name and unit; None where there is none to say
    (a non-finite value has no threshold)."""
    if threshold is None or kind not in _THRESHOLD_IN_VALUE_UNITS:
        return None  # (a non-finite value has no threshold; a stall's is a tolerance, not a loss)
    if kind is AlertKind.EXTREME:
        return f"{threshold:g} decades of {(details or {}).get('dtype', 'float32')} headroom"
    return value_text(kind, metric, threshold)


TABLE_COLUMNS = ("step", "loss", "grad_norm", "activation_max", "optim_state_norm", "health")


# C0/C1 control characters (ANSI escapes start with ESC) and lone surrogates, which a terminal
# would act on or an encoder would refuse


def records_table(
    rows: Iterable[dict[str, Any]], columns: tuple[str, ...] = TABLE_COLUMNS, markdown: bool = False
) -> str:
    """A small fixed-width (or markdown) table of step records."""
    rows = list(rows)
    cells = [
        [fmt_num(r.get(c)) if r.get("step") != "..." else ("..." if c == "step" else "") for c in columns] for r in rows
    ]
    if markdown:
        head = "| " + " | ".join(columns) + " |"
        sep = "|" + "|".join("---" for _ in columns) + "|"
        return "\n".join([head, sep] + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max([len(col)] + [len(c[i]) for c in cells]) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def alert_text(alert: Alert, markdown: bool = False) -> str:
    """The alert body: step, metric, value, threshold, location, hint and, for critical alerts,
    the last steps of the flight recorder as a table."""
    lines = [
        f"{alert.severity.value.upper()} {alert.kind.value} at step {alert.step}: {alert.message}",
    ]
    said = value_text(alert.kind, alert.metric, alert.value, alert.details, alert.location)
    limit = threshold_text(alert.kind, alert.metric, alert.threshold, alert.details)
    if said or limit:
        lines.append("  ".join(x for x in (said and f"value: {said}", limit and f"limit: {limit}") if x))
    if alert.location:
        lines.append(f"location: {alert.location}")
    if alert.rank is not None:
        lines.append(f"rank: {alert.rank}")
    if alert.hint:
        lines.append(f"hint: {alert.hint}")
    recent = alert.details.get("recent") if alert.details else None
    if recent:
        lines.append("")
        lines.append("last steps (flight recorder):")
        table = records_table(recent, markdown=markdown)
        lines.append(table if markdown else "```\n" + table + "\n```")
    if alert.flight_record:
        lines.append(f"flight record: {alert.flight_record}")
    sep = "  \n" if markdown else "\n"
    return sep.join(lines)
