"""Plain data that crosses every boundary: the kinds and severities, step records, findings and alerts.

Nothing here imports torch: detectors, replay and sinks all speak these types. The words for an
alert's value live in `_alert_text`; incident events and the step report in `_events`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from .json import json_float
from .record_dict import record_fields

__all__ = [
    "Severity",
    "AlertKind",
    "INSTABILITY_KINDS",
    "Health",
    "HEALTH_LEGEND",
    "SCALAR_FIELDS",
    "MECHANISM_FIELDS",
    "MECHANISM_LAYER_FIELDS",
    "StepRecord",
    "record_draft",
    "publish",
    "Finding",
    "Alert",
    "IncidentState",
]


class Severity(str, enum.Enum):
    """How bad an alert is; ordered info < warning < critical."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]

    def __str__(self) -> str:  # so f-strings print "warning", not "Severity.WARNING"
        return self.value


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


class AlertKind(str, enum.Enum):
    """What went wrong."""

    NONFINITE = "nonfinite"
    EXPLOSION = "explosion"
    RUNAWAY = "runaway"
    LOSS_SPIKE = "loss_spike"
    DIVERGENCE = "divergence"
    EXTREME = "extreme"
    STALL = "stall"
    OSCILLATION = "oscillation"
    VANISHING = "vanishing"
    # mechanisms that come before a transformer's loss spike (nummon/_engine/detectors/attention.py, ...)
    ATTENTION_LOGITS = "attention_logits"
    ATTENTION_COLLAPSE = "attention_collapse"
    OUTPUT_LOGITS = "output_logits"
    ADAM_SECOND_MOMENT = "adam_second_moment"
    # data-parallel replicas that should be bit-identical and are not (nummon/_forensics/replicas.py)
    REPLICA_MISMATCH = "replica_mismatch"

    def __str__(self) -> str:
        return self.value


#: Kinds that mean the run is numerically unstable (as opposed to not learning).
INSTABILITY_KINDS = frozenset(
    {
        AlertKind.NONFINITE,
        AlertKind.EXPLOSION,
        AlertKind.RUNAWAY,
        AlertKind.LOSS_SPIKE,
        AlertKind.DIVERGENCE,
        AlertKind.EXTREME,
        AlertKind.ATTENTION_LOGITS,
        AlertKind.ATTENTION_COLLAPSE,
        AlertKind.OUTPUT_LOGITS,
        AlertKind.ADAM_SECOND_MOMENT,
    }
)


class Health(str, enum.Enum):
    """The numerical state of one record, worst first: nonfinite > extreme > incident > healthy."""

    HEALTHY = "healthy"
    EXTREME = "extreme"  # finite, but close to the dtype's limit (few decades of headroom left)
    NONFINITE = "nonfinite"
    INCIDENT = "incident"  # finite and within the dtype's range, but a warning or critical condition is open

    @property
    def code(self) -> float:
        """A number for scalar dashboards: healthy 0, incident 0.5, extreme 1, nonfinite 2."""
        return _HEALTH_CODE[self]

    def __str__(self) -> str:
        return self.value


_HEALTH_CODE = {Health.HEALTHY: 0.0, Health.INCIDENT: 0.5, Health.EXTREME: 1.0, Health.NONFINITE: 2.0}
#: What the plotted health numbers mean.
HEALTH_LEGEND = (
    "health: 0 = healthy, 0.5 = incident (finite, but a warning or critical condition is open), "
    "1 = extreme (finite, few decades left before the dtype overflows), 2 = non-finite (NaN/Inf)"
)


#: Scalar fields of a step record, in the order sinks and tables show them.
SCALAR_FIELDS = (
    "loss",
    "grad_norm",
    "grad_max",
    "param_norm",
    "optim_state_norm",
    "activation_max",
    "update_ratio",
    "lr",
    "headroom",
)

#: Scalar fields of the sampled mechanism probes (nummon/_stats/mechanisms.py): measured every
#: `mechanisms.every` steps (every step while an incident is open), None in between.
MECHANISM_FIELDS = (
    "attention_logit_max",
    "attention_entropy",
    "output_logsumexp_mean",
    "output_logsumexp_max",
    "output_logit_max",
    "adam_ratio_rms",
    "adam_small_grad_fraction",
    "adam_ratio_bound",
    "update_ratio_max",
    "sample_loss_ratio",
)
#: Per-layer mechanism fields: {module or parameter name: value}.
MECHANISM_LAYER_FIELDS = (
    "layer_attention_logit_max",
    "layer_attention_entropy",
    "layer_adam_ratio_rms",
    "layer_update_ratio",
    "layer_output_rms",
)


#: Every per-layer field of a record ({layer or parameter name: value}).
_LAYER_FIELDS = ("layer_grad_norms", "layer_activation_max") + MECHANISM_LAYER_FIELDS


class ReadOnlyDict(dict):
    """A dict that refuses every change: a frozen StepRecord's per-layer values, which sinks read
    on their own threads. Still a dict (JSON, isinstance, copies, pickling)."""

    __slots__ = ()

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise TypeError("a frozen StepRecord's per-layer values are read-only (copy them with dict(...))")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> Any:  # pickle / deepcopy rebuild from a plain dict, not item by item
        return (ReadOnlyDict, (dict(self),))

    def __copy__(self) -> ReadOnlyDict:
        return self

    def __deepcopy__(self, memo: Any) -> ReadOnlyDict:
        return self  # immutable, and its values are floats


_EMPTY = ReadOnlyDict()


@dataclass
class StepRecord:
    """Host-side statistics of one optimizer step, as plain floats.

    ``None`` means "not measured at this step" (sampling cadence, a trace without the column); a
    NaN or Inf value is a real non-finite measurement. A record is frozen (read-only) once the
    health engine has seen it, before any sink gets it: derive a changed one with
    `dataclasses.replace`.
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None  # L2 norm over all gradients
    grad_max: float | None = None  # max |g| over all gradients
    param_norm: float | None = None  # L2 norm over all parameters
    optim_state_norm: float | None = None  # L2 norm of momentum / Adam exp_avg
    activation_max: float | None = None  # max |output| over watched modules
    update_ratio: float | None = None  # estimated ||update|| / ||param||
    lr: float | None = None
    headroom: float | None = None  # decades between the largest magnitude and its dtype's max
    headroom_dtype: str | None = None
    nonfinite_count: int | None = None  # non-finite elements of the tensor nonfinite_location names (None: gone)
    layer_grad_norms: dict[str, float] = field(default_factory=dict)
    layer_activation_max: dict[str, float] = field(default_factory=dict)
    nonfinite_location: str | None = None  # e.g. "output of `fc2` (forward)"
    nonfinite_parts: tuple[str, ...] = ()  # which families went non-finite: loss, grad, param, ...
    rank: int | None = None  # rank where the non-finite value (or maximum) came from
    fingerprint: str | None = None  # batch fingerprint, when the loop passes the batch
    input_nonfinite: int | None = None  # non-finite values in the input batch
    scaler_skipped: bool | None = None  # True: the AMP GradScaler skipped this step (scaled grads overflowed)
    clip_ratio: float | None = None  # gradient norm after clipping / before (grad_norm is the unclipped one)
    # sampled mechanism probes (MECHANISM_FIELDS); None: not sampled at this step
    attention_logit_max: float | None = None  # max pre-softmax attention logit over layers (after scaling)
    attention_entropy: float | None = None  # lowest layer's mean attention entropy / ln(keys attended), 0..1
    output_logsumexp_mean: float | None = None  # mean log Z of the logits that go into cross-entropy
    output_logsumexp_max: float | None = None  # max log Z over positions
    output_logit_max: float | None = None  # max output logit
    adam_ratio_rms: float | None = (
        None  # worst tensor's RMS of g / sqrt(v_hat) (<= 1/sqrt(1 - beta2); ~1 when v tracks g²)
    )
    adam_small_grad_fraction: float | None = None  # fraction of gradient elements with |g| < Adam's eps
    adam_ratio_bound: float | None = (
        None  # sqrt((1 - beta2^t) / (1 - beta2)), the bound of adam_ratio_rms at Adam step t (the largest over param groups)
    )
    update_ratio_max: float | None = None  # largest ||Adam update|| / ||param|| over tensors
    sample_loss_ratio: float | None = None  # max / mean of the per-sample losses (post_step(per_sample_loss=...))
    sample_loss_top: tuple[int, ...] = ()  # indices in the batch of the largest per-sample losses, worst first
    layer_attention_logit_max: dict[str, float] = field(default_factory=dict)
    layer_attention_entropy: dict[str, float] = field(default_factory=dict)
    layer_adam_ratio_rms: dict[str, float] = field(default_factory=dict)
    layer_update_ratio: dict[str, float] = field(default_factory=dict)
    layer_output_rms: dict[str, float] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: a StepRecord is read-only once the engine has seen it "
                "(use dataclasses.replace)"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> StepRecord:
        """Make this record read-only, its per-layer dicts included (the engine does, before
        sinks on other threads hold it); returns it."""
        d = self.__dict__
        if d.get("_frozen"):
            return self
        for name in _LAYER_FIELDS:  # a C-level copy of each non-empty one: nobody else holds them then
            v = d[name]
            if v and type(v) is not ReadOnlyDict:
                d[name] = ReadOnlyDict(v)
            elif not v and type(v) is not ReadOnlyDict:
                d[name] = _EMPTY
        d["_frozen"] = True
        return self

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def scalars(self) -> dict[str, float]:
        """The measured scalar fields as a flat dict (absent ones left out)."""
        return {k: float(v) for k in SCALAR_FIELDS if (v := getattr(self, k)) is not None}

    def measures(self, metric: str) -> bool:
        """Whether this record carries a value for a finding's `metric` (a scalar field name or
        "layer_grad_norm"); metrics that are not record fields count as measured."""
        if metric in SCALAR_FIELDS:
            return getattr(self, metric) is not None
        if metric == "layer_grad_norm":
            return bool(self.layer_grad_norms)
        if metric in MECHANISM_FIELDS:  # sampled: absent between samples, which clears nothing
            return getattr(self, metric) is not None
        return True

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "record", default_step: int = 0) -> StepRecord:
        """The record `to_dict` wrote (unknown keys ignored); TraceError naming `where` on a bad value."""
        return cls(**record_fields(obj, where, default_step, SCALAR_FIELDS + MECHANISM_FIELDS, _LAYER_FIELDS))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step}
        for f in dataclasses.fields(self):
            if f.name == "step":
                continue
            v = getattr(self, f.name)
            if v is None or v == {} or v == ():
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    def is_finite(self) -> bool:
        """True when every measured value is finite."""
        if self.nonfinite_parts or self.input_nonfinite:
            return False
        isfinite = math.isfinite
        for k in SCALAR_FIELDS:
            v = getattr(self, k)
            if v is not None and not isfinite(v):
                return False
        return all(map(isfinite, self.layer_grad_norms.values())) and all(
            map(isfinite, self.layer_activation_max.values())
        )


class _Draft(StepRecord):
    """A StepRecord while one builder fills it in: assignments are the C-level ones, not a
    Python call of the guard each (a decoded step sets ~50 fields). `record_draft` makes one,
    `publish` turns it into a plain StepRecord; nobody else ever holds one."""

    __slots__ = ()
    __setattr__ = object.__setattr__  # type: ignore[assignment]  # the C one: no Python frame per assignment


def record_draft(step: int) -> StepRecord:
    """A new record (every field at its default) to fill in without the guard; `publish` it when done."""
    return _Draft(step)


def publish(rec: StepRecord) -> StepRecord:
    """The draft as a plain StepRecord (the same object: the guard applies from here on)."""
    if type(rec) is _Draft:
        object.__setattr__(rec, "__class__", StepRecord)
    return rec


@dataclass(frozen=True)
class Finding:
    """A condition a detector sees as active at one step (before deduplication)."""

    kind: AlertKind
    severity: Severity
    metric: str
    value: float | None
    threshold: float | None
    message: str
    location: str | None = None
    details: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind.value, self.metric, self.location or "")


@dataclass(frozen=True)
class Alert:
    """One routed alert: what, where, how bad, and what to try."""

    step: int
    kind: AlertKind
    severity: Severity
    message: str
    metric: str
    value: float | None = None
    threshold: float | None = None
    location: str | None = None
    hint: str | None = None
    rank: int | None = None
    cleared: bool = False  # an info alert that says a condition is over
    details: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    flight_record: str | None = None  # path of the flight-recorder dump, for critical alerts

    @property
    def key(self) -> tuple[str, str, str]:
        """The condition this alert is about: (kind, metric, location), as `Finding.key`."""
        return (self.kind.value, self.metric, self.location or "")

    @property
    def title(self) -> str:
        """A short title (< 64 characters) for alerting backends."""
        word = _TITLES.get(self.kind, self.kind.value)
        return f"nummon: {word}" + (" cleared" if self.cleared else "")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step,
            "kind": self.kind.value,
            "severity": self.severity.value,
            "message": self.message,
            "metric": self.metric,
            "value": json_float(self.value),
            "threshold": json_float(self.threshold),
            "location": self.location,
            "hint": self.hint,
        }
        if self.rank is not None:
            d["rank"] = self.rank
        if self.cleared:
            d["cleared"] = True
        if self.flight_record:
            d["flight_record"] = self.flight_record
        if self.details:
            d["details"] = {k: json_float(v) if isinstance(v, float) else v for k, v in self.details.items()}
        return d

    def __str__(self) -> str:
        where = f" [{self.location}]" if self.location else ""
        return f"step {self.step} {self.severity.value.upper()} {self.kind.value}{where}: {self.message}"


_TITLES = {
    AlertKind.NONFINITE: "non-finite values",
    AlertKind.EXPLOSION: "gradient explosion",
    AlertKind.RUNAWAY: "runaway growth",
    AlertKind.LOSS_SPIKE: "loss spike",
    AlertKind.DIVERGENCE: "loss divergence",
    AlertKind.EXTREME: "dtype headroom low",
    AlertKind.STALL: "training stalled",
    AlertKind.OSCILLATION: "loss oscillation",
    AlertKind.VANISHING: "vanishing gradients",
    AlertKind.ATTENTION_LOGITS: "attention-logit growth",
    AlertKind.ATTENTION_COLLAPSE: "attention collapsed",
    AlertKind.OUTPUT_LOGITS: "output-logit divergence",
    AlertKind.ADAM_SECOND_MOMENT: "Adam second moment off",
    AlertKind.REPLICA_MISMATCH: "replicas differ across ranks",
}


class IncidentState(str, enum.Enum):
    """Where the run's incident stands, mildest first."""

    NONE = "none"  # no incident yet
    OPEN = "open"  # a warning: something is going wrong
    CRITICAL = "critical"  # a critical alert: the run needs action now
    NONFINITE = "nonfinite"  # non-finite values: the run is lost unless a scaler skipped the step
    RESOLVED = "resolved"  # quiet for the policy's quiet period after an incident

    @property
    def active(self) -> bool:
        return self in (IncidentState.OPEN, IncidentState.CRITICAL, IncidentState.NONFINITE)

    @property
    def rank(self) -> int:
        return {IncidentState.OPEN: 1, IncidentState.CRITICAL: 2, IncidentState.NONFINITE: 3}.get(self, 0)

    def __str__(self) -> str:
        return self.value
