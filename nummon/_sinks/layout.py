"""Chart layout shared by the TensorBoard and W&B sinks: which value goes under which tag.

Plain data in, tag -> value dicts out (no torch). The groups (the part of a tag before its first
`/`, which both TensorBoard and W&B turn into a section):

- `nummon/`: the run-level charts only, at most 12 whatever the model's size (`MAIN_CHARTS`).
- `nummon_log10/`: log10|x| of the growth metrics, so a runaway is a straight line.
- `nummon_health/`: one 0/1 series per health state.
- `nummon_layers_grad_norm/<param>`, `nummon_layers_activation_max/<module>`: per-layer series.
- `nummon_top_grad_norm/<param>`, `nummon_top_activation_max/<module>`: the k layers with the
  largest value so far ("top offenders"), so a big model's culprit is found without scrolling.
- `nummon_more/`: any other run-level scalar a record carries.
- `nummon_mechanisms/`: the sampled mechanism probes (attention logit max and entropy, output
  log Z, Adam's RMS(g/sqrt(v)), ...), a point every `mechanisms.every` steps; per layer under
  `nummon_layers_attention_logit_max/<module>` and `nummon_layers_attention_entropy/<module>`.
- `nummon_hist_<kind>/<name>` and `nummon_hist_<kind>_log10abs/<name>`: histograms (kind:
  params, grads, activations).
- `nummon_state_range/min`, `/max` (TensorBoard only): constants 0 and 3 drawn with the health and
  incident-state charts of the custom-scalars layout, so "ignore outliers" (on by default) never
  clips the rare states 2 and 3 away.
- `nummon_1_incidents/<seq>_<state>` (listed first: they tell the story), `nummon_2_alerts/<seq>_<kind>`:
  one text entry each (no entry for a cleared alert: the incident's "resolved" event says it).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from .._core.types import MECHANISM_FIELDS, Health, IncidentState, StepRecord

__all__ = [
    "MAIN_GROUP",
    "MAIN_CHARTS",
    "LOG10_GROUP",
    "LOG10_FIELDS",
    "HEALTH_GROUP",
    "MORE_GROUP",
    "LAYER_METRICS",
    "MECHANISM_GROUP",
    "MECHANISM_LAYER_METRICS",
    "TOP_K",
    "DEFAULT_HISTOGRAM_EVERY",
    "INCIDENT_LEGEND",
    "VIEWS_LEGEND",
    "ALERTS_GROUP",
    "INCIDENTS_GROUP",
    "incident_code",
    "step_scalars",
    "TopOffenders",
    "histogram_tags",
    "alert_tag",
    "incident_tag",
    "custom_scalars_layout",
    "metric_sections",
    "STATE_RANGE_GROUP",
    "state_range_scalars",
    "layer_groups",
    "HIST_LINEAR_MAX_ABS",
    "linear_histogram_readable",
]

MAIN_GROUP = "nummon"
#: The run-level charts, in display order: never more than 12, whatever the model.
MAIN_CHARTS = (
    "loss",
    "grad_norm",
    "clip_ratio",
    "grad_max",
    "param_norm",
    "optim_state_norm",
    "update_ratio",
    "activation_max",
    "lr",
    "headroom",
    "health",
    "incident_state",
)
LOG10_GROUP = "nummon_log10"
#: Growth metrics that get a log10|x| companion (a runaway is a straight line on it).
LOG10_FIELDS = ("loss", "grad_norm", "activation_max")
HEALTH_GROUP = "nummon_health"
STATE_RANGE_GROUP = "nummon_state_range"
#: A linear histogram is written only while its values stay within this magnitude: beyond it the
#: axis labels run together into a string of digits and every value sits in one bar; the
#: log10|x| histogram (always written) shows such values in decades.
HIST_LINEAR_MAX_ABS = 1e6
_MAX_LAYER_GROUPS = 16  # charts per per-layer metric in the "layers by group" category
MORE_GROUP = "nummon_more"
MECHANISM_GROUP = "nummon_mechanisms"
# a constant of the optimizer (kept in the record so that replay judges the ratio alike), not a chart
_NOT_CHARTED = frozenset({"adam_ratio_bound"})
#: Per-layer mechanism metric -> the StepRecord field (own groups; not in the top-offender charts).
MECHANISM_LAYER_METRICS = {
    "attention_logit_max": "layer_attention_logit_max",
    "attention_entropy": "layer_attention_entropy",
}
#: Per-layer metric -> the StepRecord field holding {layer name: value}.
LAYER_METRICS = {"grad_norm": "layer_grad_norms", "activation_max": "layer_activation_max"}
TOP_K = 5
#: Histograms every this many steps when neither the policy nor the sink sets a cadence. One
#: histogram pass (weights, gradients, activations, log10|x|, written by the TensorBoard sink)
#: costs about 1.3 bare steps of the demo CNN on CPU (benchmarks/histogram_overhead.py; the
#: every-100 row of benchmarks/RESULTS.md agrees). The every-step statistics already take ~1.045x
#: of the 1.05x budget, so N >= ~270; every 500 steps adds ~0.27% and gives ~100 histograms per
#: 50k-step run. Step 0 always gets one.
DEFAULT_HISTOGRAM_EVERY = 500
#: Text groups, in the order TensorBoard's Text tab lists them (alphabetical): incidents first
INCIDENTS_GROUP = "nummon_1_incidents"
ALERTS_GROUP = "nummon_2_alerts"

INCIDENT_LEGEND = "incident_state: 0 = no incident (or resolved), 1 = open (warning), 2 = critical, 3 = non-finite"
VIEWS_LEGEND = (
    "Groups: `nummon` run-level charts (at most 12); `nummon_log10` log10|x| of loss, grad norm and "
    "max |activation| (a runaway is a straight line); `nummon_health` one 0/1 series per health state; "
    "`nummon_layers_*` per-layer series (multiline charts in the Custom Scalars tab); `nummon_top_*` the "
    f"{TOP_K} layers with the largest value so far; histograms under `nummon_hist_*` (linear, only at steps "
    f"whose values stay within {HIST_LINEAR_MAX_ABS:g} in magnitude) and "
    "`nummon_hist_*_log10abs` (decades of |x|: the distance to the dtype's overflow). "
    "The Custom Scalars tab draws the health and incident-state charts with their whole range 0-3 "
    '(`nummon_state_range`) so "ignore outliers" keeps the rare states, and one chart per layer group '
    "with each layer named."
)


def incident_code(state: IncidentState) -> int:
    """The number an incident state is plotted as (see INCIDENT_LEGEND): its rank."""
    return state.rank


def _log10_abs(v: float) -> float | None:
    """log10|v|; None for 0 (no point rather than -inf); NaN/Inf pass through as NaN/Inf."""
    if v == 0:
        return None
    if not math.isfinite(v):
        return v if math.isnan(v) else math.inf
    return math.log10(abs(v))


def step_scalars(
    record: StepRecord, health: Health | None, incident_state: IncidentState | None = None
) -> dict[str, float]:
    """Every per-step scalar of one record under its tag (run-level, log10, health, per layer)."""
    values = record.scalars()
    clip = record.clip_ratio
    if clip is not None:
        values.setdefault("clip_ratio", float(clip))
    out: dict[str, float] = {}
    for name, v in values.items():
        group = MAIN_GROUP if name in MAIN_CHARTS else MORE_GROUP
        out[f"{group}/{name}"] = v
    if health is not None:
        out[f"{MAIN_GROUP}/health"] = float(health.code)
        for h in Health:
            out[f"{HEALTH_GROUP}/{h.value}"] = 1.0 if h is health else 0.0
    if incident_state is not None:
        out[f"{MAIN_GROUP}/incident_state"] = float(incident_code(incident_state))
    for name in LOG10_FIELDS:
        if name in values and (lg := _log10_abs(values[name])) is not None:
            out[f"{LOG10_GROUP}/{name}"] = lg
    for metric, field_name in LAYER_METRICS.items():
        for layer, v in getattr(record, field_name).items():
            out[f"nummon_layers_{metric}/{layer}"] = v
    for name in MECHANISM_FIELDS:  # sampled: only on the steps that measured them
        measured = getattr(record, name, None)
        if measured is not None and name not in _NOT_CHARTED:
            out[f"{MECHANISM_GROUP}/{name}"] = float(measured)
    for metric, field_name in MECHANISM_LAYER_METRICS.items():
        for layer, v in getattr(record, field_name, {}).items():
            out[f"nummon_layers_{metric}/{layer}"] = v
    return out


class TopOffenders:
    """The k layers with the largest value so far, per per-layer metric (NaN/Inf rank first).

    `update(record)` returns `nummon_top_<metric>/<layer>: value now` for those layers; a layer
    that drops out of the top k stops being drawn, so the chart stays at about k lines.
    """

    def __init__(self, k: int = TOP_K) -> None:
        self.k = k
        self.peaks: dict[str, dict[str, float]] = {m: {} for m in LAYER_METRICS}

    def update(self, record: StepRecord) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric, field_name in LAYER_METRICS.items():
            layers = getattr(record, field_name)
            if not layers:
                continue
            peaks = self.peaks[metric]
            for layer, v in layers.items():
                v = math.inf if math.isnan(v) else abs(v)
                if v > peaks.get(layer, -1.0):
                    peaks[layer] = v
            for layer in heapq.nlargest(self.k, peaks, key=peaks.__getitem__):
                if layer in layers:
                    out[f"nummon_top_{metric}/{layer}"] = layers[layer]
        return out


def histogram_tags(name: str) -> tuple[str, str]:
    """(linear tag, log10|x| tag) of a histogram named `params/<p>`, `grads/<p>` or `activations/<m>`."""
    kind, _, rest = name.partition("/")
    if not rest:
        kind, rest = "other", name
    return f"nummon_hist_{kind}/{rest}", f"nummon_hist_{kind}_log10abs/{rest}"


def alert_tag(seq: int, kind: Any) -> str:
    """A tag of its own for the seq-th alert (TensorBoard shows one text per tag and step)."""
    return f"{ALERTS_GROUP}/{seq:04d}_{getattr(kind, 'value', kind)}"


def incident_tag(seq: int, state: IncidentState) -> str:
    """A tag of its own for the seq-th incident event."""
    return f"{INCIDENTS_GROUP}/{seq:04d}_{state.value}"


def state_range_scalars() -> dict[str, float]:
    """Constant companions of the state charts: the lowest and highest value a state takes."""
    return {f"{STATE_RANGE_GROUP}/min": 0.0, f"{STATE_RANGE_GROUP}/max": 3.0}


def linear_histogram_readable(h: dict[str, Any]) -> bool:
    """Whether a histogram's linear view is worth drawing (its values within HIST_LINEAR_MAX_ABS)."""
    lo, hi = float(h["min"]), float(h["max"])
    return math.isfinite(lo) and math.isfinite(hi) and max(abs(lo), abs(hi)) <= HIST_LINEAR_MAX_ABS


def _group_of(name: str, depth: int) -> str:
    """The first `depth` parts of a dotted layer name, a numeric index counted with its parent
    ("blocks.3.attn.q" -> "blocks.3" at depth 1)."""
    parts = name.split(".")
    out: list[str] = []
    for p in parts[:-1] if len(parts) > 1 else parts:
        if len(out) >= depth and not p.isdigit():
            break
        out.append(p)
    return ".".join(out) or name


def layer_groups(names: list[str], limit: int = _MAX_LAYER_GROUPS) -> list[str]:
    """The layer groups (module prefixes) of `names`, at most `limit`, coarsest that fits."""
    fitting: list[str] = []
    for depth in (1, 2, 3):  # coarsest first; finer while a model sits in one container ("model.")
        groups = sorted({_group_of(n, depth) for n in names})
        if len(groups) > limit:
            break
        fitting = groups
        if len(groups) >= 4:
            break
    return fitting or sorted({n.split(".", 1)[0] for n in names})[:limit]  # 40 blocks: one "blocks" chart


def _escape(text: str) -> str:
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


def custom_scalars_layout(
    k: int = TOP_K, layers: dict[str, list[str]] | None = None
) -> dict[str, dict[str, list[Any]]]:
    """TensorBoard custom-scalars layout (`SummaryWriter.add_custom_scalars`): one multiline chart
    per per-layer metric, the top offenders, the log10 companions and the health states (with
    their whole range, `state_range_scalars`). With `layers` ({metric: layer names}), one chart
    per layer group as well, titled by the group, each line a named layer. Tags are regular
    expressions."""
    out = {
        "nummon: per layer": {
            "grad norm per parameter": ["Multiline", [r"^nummon_layers_grad_norm/"]],
            "max |activation| per module": ["Multiline", [r"^nummon_layers_activation_max/"]],
        },
        "nummon: top offenders": {
            f"grad norm: the {k} largest parameters so far": ["Multiline", [r"^nummon_top_grad_norm/"]],
            f"max |activation|: the {k} largest modules so far": ["Multiline", [r"^nummon_top_activation_max/"]],
        },
        "nummon: growth (log10)": {
            "log10 |loss|, grad norm, max |activation|": ["Multiline", [rf"^{LOG10_GROUP}/"]],
            "headroom (decades to the dtype's max)": ["Multiline", [rf"^{MAIN_GROUP}/headroom$"]],
        },
        "nummon: mechanisms (sampled)": {
            "max attention logit per module": ["Multiline", [r"^nummon_layers_attention_logit_max/"]],
            "attention entropy / ln keys per module": ["Multiline", [r"^nummon_layers_attention_entropy/"]],
            "output log Z (mean, max) and max output logit": ["Multiline", [rf"^{MECHANISM_GROUP}/output_"]],
            "Adam RMS(g/sqrt(v)) and max update/param": [
                "Multiline",
                [rf"^{MECHANISM_GROUP}/(adam_|update_ratio_max)"],
            ],
        },
        "nummon: health": {
            "health (1 = in this state)": ["Multiline", [rf"^{HEALTH_GROUP}/"]],
            "incident state (0 none, 1 open, 2 critical, 3 non-finite)": [
                "Multiline",
                [rf"^{MAIN_GROUP}/incident_state$", rf"^{STATE_RANGE_GROUP}/"],
            ],
            "health code (0 healthy, 0.5 incident, 1 extreme, 2 non-finite)": [
                "Multiline",
                [rf"^{MAIN_GROUP}/health$", rf"^{STATE_RANGE_GROUP}/"],
            ],
        },
    }
    words = {"grad_norm": "grad norm", "activation_max": "max |activation|"}
    charts: dict[str, list[Any]] = {}
    for metric, names in (layers or {}).items():
        for g in layer_groups(sorted(names)):
            tag = rf"^nummon_layers_{metric}/{_escape(g)}(\.|$)"
            charts[f"{words.get(metric, metric)}: {g}"] = ["Multiline", [tag]]
    if charts:
        out["nummon: layers by group"] = charts
    return out


def metric_sections() -> list[str]:
    """Glob patterns of every scalar group, for W&B's `define_metric` (one section each)."""
    return [
        f"{MAIN_GROUP}/*",
        f"{LOG10_GROUP}/*",
        f"{HEALTH_GROUP}/*",
        f"{MORE_GROUP}/*",
        f"{MECHANISM_GROUP}/*",
        *(f"nummon_layers_{m}/*" for m in MECHANISM_LAYER_METRICS),
        *(f"nummon_layers_{m}/*" for m in LAYER_METRICS),
        *(f"nummon_top_{m}/*" for m in LAYER_METRICS),
    ]
