"""The words for an alert's numbers: its value with name and unit, the threshold it crossed, and
the length limits of alert titles and texts. Pure string work over plain data."""

from __future__ import annotations

import math
from typing import Any

from .text import fmt_num
from .types import AlertKind

__all__ = ["TITLE_MAX", "SUMMARY_MAX", "sci", "value_text", "threshold_text"]

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
