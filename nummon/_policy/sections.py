"""The policy's common ground and the sections of the detectors that read the step records: every
threshold and window, validated strictly (``extra="forbid"``, finite floats, bounded windows).
The mechanism detectors' sections are in ``mechanism_sections``, the runtime sections (alerts,
sampling, sinks, recovery, ...) in ``runtime``; ``policy`` assembles them into ``Policy``
and re-exports every name."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .._core.types import SCALAR_FIELDS

__all__ = [
    "Decades",
    "Factor",
    "Fraction",
    "FractionOrAll",
    "History",
    "Logits",
    "Multiple",
    "Nats",
    "Records",
    "Relative",
    "Samples",
    "Seconds",
    "Steps",
    "StepsOrZero",
    "TrendRecords",
    "DivergencePolicy",
    "FloatDtype",
    "HeadroomPolicy",
    "MAX_WINDOW",
    "NonfinitePolicy",
    "OscillationPolicy",
    "RunawayPolicy",
    "SpikePolicy",
    "StallPolicy",
    "TrendPolicy",
    "VanishingPolicy",
]

#: Floating-point formats whose limits the headroom detector knows.
FloatDtype = Literal["float32", "bfloat16", "float16", "float64"]

#: Upper bound of every window, history and patience (steps or records): larger values are
#: typos that would only fail later (a deque of 1e30 entries), never a real setting.
MAX_WINDOW = 1_000_000

# The units of the policy's fields, each with the bounds every field of that unit shares (a
# field with other bounds spells them out). The unit is also the last parenthesis of a field's
# description, which the generated policy reference shows.

#: Decades of headroom (log10 units): float64 spans about 616 decades, so more than that is a typo.
Decades = Annotated[float, Field(ge=0, le=700)]
#: Training steps: a window, cadence or patience of at least one step (steps).
Steps = Annotated[int, Field(ge=1, le=MAX_WINDOW)]
#: Training steps where 0 means something: a start step, no cooldown, the sinks' own cadence (steps).
StepsOrZero = Annotated[int, Field(ge=0, le=MAX_WINDOW)]
#: A whole multiple of another cadence, 1 (the cadence itself) up to 100 (multiple).
Multiple = Annotated[int, Field(ge=1, le=100)]
#: Logged records (finite values of a metric, in logging order), at least one (records).
Records = Annotated[int, Field(ge=1, le=MAX_WINDOW)]
#: Values kept or compared, at least two: a median, a spread or a change needs two (steps or records).
History = Annotated[int, Field(ge=2, le=MAX_WINDOW)]
#: Finite losses a trend window must hold: two halves of at least two each (records).
TrendRecords = Annotated[int, Field(ge=4, le=MAX_WINDOW)]
#: Mechanism-probe samples (one per sampled step), at least one (samples).
Samples = Annotated[int, Field(ge=1, le=MAX_WINDOW)]
#: A multiple of a reference level that counts as a change: above 1 (ratio).
Factor = Annotated[float, Field(gt=1)]
#: A fraction strictly between 0 and 1 (fraction).
Fraction = Annotated[float, Field(gt=0, lt=1)]
#: A fraction above 0 that may be all of it, 1 (fraction).
FractionOrAll = Annotated[float, Field(gt=0, le=1)]
#: A relative change or spread from 0 up to, not including, 1 (fraction).
Relative = Annotated[float, Field(ge=0, lt=1)]
#: A logit (pre-softmax score) level, positive (logit units).
Logits = Annotated[float, Field(gt=0)]
#: A log-probability distance, positive (nats).
Nats = Annotated[float, Field(gt=0)]
#: A wait, from none to an hour (seconds).
Seconds = Annotated[float, Field(ge=0, le=3600)]


class _Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite threshold silently switches a detector off
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class NonfinitePolicy(_Section):
    enabled: bool = Field(
        True, description="critical alert on any NaN/Inf in loss, gradients, parameters, optimizer state or activations"
    )
    log_skip_warning: Records = Field(
        3,
        description="in a log (replay, watch: no statistics behind a record), a non-finite gradient norm beside a finite loss is what a loss scaler's skipped step looks like (fp16 AMP; the scaler calibrates so at the start of a run): info, a warning once it has lasted this many records in a row (records)",
    )
    log_skip_records: Records = Field(
        10,
        description="and critical once it has lasted this many: the scaler is skipping every step, the run no longer trains (records)",
    )
    clear_records: Records = Field(
        10,
        description="a non-finite condition clears only after this many finite records in a row: NaNs that come back every few records stay one open condition (announced again as recurring once the cooldown is over), while a one-off NaN or a loss scaler's calibration (its next overflow is thousands of steps away) clears (records)",
    )


class SpikePolicy(_Section):
    """Sudden jumps against the run's own recent history (loss_spike, explosion)."""

    enabled: bool = True
    window: History = Field(
        50,
        description="steps of finite history kept for the robust baseline (median of log10 values)",
    )
    min_history: Steps = Field(1, description="finite samples needed before a jump can be judged (steps)")
    loss_factor: Factor = Field(
        8.0, description="loss_spike when the loss exceeds this multiple of its recent median (ratio)"
    )
    grad_factor: Factor = Field(
        10.0,
        description="explosion when grad norm, optimizer-state norm or max activation exceeds this multiple of its recent median (ratio)",
    )
    robust_z: float = Field(
        3.0,
        gt=0,
        description="and exceeds the median by at least this many robust standard deviations of log10 values (sigma = 1.4826 * MAD)",
    )
    short_history: Steps = Field(
        8,
        description="below this many samples the baseline is uncertain and the factors are multiplied by short_history_multiplier (steps)",
    )
    short_history_multiplier: float = Field(
        2.0, ge=1, description="factor multiplier while the history is short (ratio)"
    )


class RunawayPolicy(_Section):
    """Sustained geometric growth over consecutive records."""

    enabled: bool = True
    min_growth: Factor = Field(
        1.5, description="a step counts as growth when the value grows by at least this factor per step (ratio)"
    )
    warning_steps: Steps = Field(2, description="consecutive growth steps for a warning (steps)")
    warning_records: Records = Field(
        2,
        description="and growth records for a warning: with logs every N steps, one jump between two records is a spike (explosion), not a rate to forecast overflow from (records)",
    )
    critical_steps: Steps = Field(3, description="consecutive growth steps for a critical alert (steps)")
    warning_total_factor: Factor = Field(10.0, description="total growth over the streak needed for a warning (ratio)")
    critical_total_factor: Factor = Field(
        100.0, description="total growth over the streak needed for a critical alert (ratio)"
    )
    metrics: tuple[str, ...] = Field(
        ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max"),
        description=f"statistics watched for runaway growth (any of: {', '.join(SCALAR_FIELDS)})",
    )
    history: History = Field(
        50,
        description="earlier finite values kept to judge whether a value stands above the metric's recent level (records)",
    )
    short_history: Records = Field(
        8,
        description="below this many earlier values the total factors are raised to the power short_history_multiplier: growth from tiny initial values is normal (records)",
    )
    short_history_multiplier: float = Field(
        2.0, ge=1, le=10, description="exponent applied to the total factors while the history is short"
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in v if m not in SCALAR_FIELDS]
        if unknown:
            raise ValueError(f"unknown metric {', '.join(map(repr, unknown))} (valid: {', '.join(SCALAR_FIELDS)})")
        return v

    @model_validator(mode="after")
    def _order(self) -> RunawayPolicy:
        if self.critical_steps < self.warning_steps:
            raise ValueError("critical_steps must be >= warning_steps")
        if self.critical_total_factor < self.warning_total_factor:
            raise ValueError("critical_total_factor must be >= warning_total_factor")
        return self


class HeadroomPolicy(_Section):
    """Decades left between the largest magnitude and the dtype's largest finite value."""

    enabled: bool = True
    warning_decades: dict[FloatDtype, Decades] = Field(
        {"float32": 10.0, "bfloat16": 10.0, "float16": 1.0, "float64": 100.0},
        description="extreme (warning) below this many decades of headroom, per dtype (log10 units)",
    )
    critical_decades: dict[FloatDtype, Decades] = Field(
        {"float32": 4.0, "bfloat16": 4.0, "float16": 0.3, "float64": 20.0},
        description="extreme (critical) below this many decades of headroom, per dtype (log10 units)",
    )
    default_dtype: FloatDtype = Field(
        "float32", description="dtype assumed for records that do not say (replayed traces)"
    )

    @model_validator(mode="after")
    def _order(self) -> HeadroomPolicy:
        for dt, crit in self.critical_decades.items():
            warn = self.warning_decades.get(dt)
            if warn is not None and crit >= warn:
                raise ValueError(f"critical_decades[{dt}] ({crit}) must be < warning_decades[{dt}] ({warn})")
        return self


class DivergencePolicy(_Section):
    """Loss far above its starting level, held for a while."""

    enabled: bool = True
    warning_factor: Factor = Field(
        5.0, description="warning when the loss stays above this multiple of the starting level (ratio)"
    )
    critical_factor: Factor = Field(1e4, description="critical when it stays above this multiple (ratio)")
    patience: Records = Field(
        5,
        description="the median of the last this many finite losses, and the current loss, must stand above the factor (records)",
    )
    rebound_factor: Factor = Field(
        2.0,
        description="warning when the median of the last `patience` losses stands at least this multiple above the best (lowest) smoothed loss reached before them: a run that had learned and lost it, however low it started (ratio)",
    )
    noise_multiple: float = Field(
        2.5,
        ge=0,
        description="a warning (either rule) also needs the rise, in log space, to be at least this many times the loss's noise (the median |change of ln loss| from one record to the next, over the last `noise_records`) times sqrt(2 ln n), n the smoothed medians the best is the lowest of (1 for the starting level): the lowest of many noisy records is no level a run can be held to (multiple)",
    )
    noise_records: History = Field(
        50, description="record-to-record changes the loss's noise is measured over (records)"
    )
    rebound_smoothing: Records = Field(
        3,
        description="the best loss so far is the lowest median of this many consecutive finite losses, so one lucky batch does not set it (records)",
    )
    rebound_min_level: float = Field(
        0.25,
        ge=0,
        description="a rebound counts only while the held loss is at least this fraction of the starting level: noise around a loss near zero is not divergence (fraction)",
    )

    @model_validator(mode="after")
    def _order(self) -> DivergencePolicy:
        if self.critical_factor <= self.warning_factor:
            raise ValueError("critical_factor must be > warning_factor")
        return self


class TrendPolicy(_Section):
    """The loss's starting level and trend window, shared by divergence, stall and oscillation.

    The window grows with the run: its span is the largest of ``min_span``, ``span_fraction`` of
    the steps so far, and ``min_records`` records at the run's logging cadence.
    """

    baseline_records: Records = Field(
        10,
        description="the starting level is the lowest running median of the first this many finite losses, so a run that blows up early is still judged against where it started (records)",
    )
    min_span: int = Field(
        100,
        ge=10,
        le=MAX_WINDOW,
        description="shortest trend window: the median of its second half is compared against its first (steps)",
    )
    min_records: TrendRecords = Field(10, description="finite losses a window must hold before it is judged (records)")
    span_fraction: FractionOrAll = Field(
        1.0, description="the window grows to this fraction of the steps the run has lasted (fraction)"
    )


class StallPolicy(_Section):
    """No meaningful improvement over the trend window while the loss is still high."""

    enabled: bool = True
    min_improvement: Relative = Field(
        0.05,
        description="relative improvement of the median loss across the window below which the run counts as not improving; lowered to half the run's own average progress over the same span when the run has always been slower, but never below min_improvement_floor x this value (fraction)",
    )
    min_improvement_floor: FractionOrAll = Field(
        0.1,
        description="the lowest min_improvement is lowered to for a slow run, as a fraction of it: a pretrained model's fine-tune improves its loss by ~1% per window and is learning (fraction)",
    )
    min_records: TrendRecords = Field(
        20,
        description="finite losses the trend window must hold before a flat one counts as a stall: ten records of a slow fine-tune cannot tell its progress from noise (records)",
    )
    high_fraction: float = Field(
        0.9,
        gt=0,
        description="a flat trend window is a stall only while the loss is above this fraction of its starting level: a run that has come further down has learned, and its plateau is convergence or a pretrained model's slow fine-tune (fraction)",
    )
    max_spread: float = Field(
        0.05,
        gt=0,
        description="a flat loss is a stall only while its relative spread (IQR / median over the window) stays below this: a model stuck at chance predicts alike for every input and its loss barely varies from batch to batch, one whose loss varies more is responding to its inputs (fraction)",
    )
    frozen_records: History = Field(
        10,
        description="a loss that has not moved for this many consecutive finite records while still above frozen_high_fraction of its starting level is a stall, however short the run (records)",
    )
    frozen_high_fraction: float = Field(
        0.5, gt=0, description="a frozen loss counts as still high above this fraction of its starting level (fraction)"
    )
    frozen_tolerance: Relative = Field(
        1e-3,
        description="the loss counts as not moving while (max - min) / median of those records stays at or below this; 1e-3 covers losses printed with 4 significant digits; a loss printed more coarsely than this (one unit of its last printed digit) cannot show that it moves, and is not called frozen once it has come below high_fraction of its starting level (fraction)",
    )
    chance_match: float = Field(
        0.01,
        ge=0,
        lt=0.1,
        description="a loss that has stayed within this relative distance of ln k (k = 2..10 classes) for at least frozen_records records and trend.min_span steps, while still high, is stuck at chance (fraction)",
    )
    chance_loss: float | None = Field(
        None,
        gt=0,
        description="the loss of a model that predicts nothing (a classifier's chance level: ln(number of classes) for balanced classes); when set, the median of the last chance_records losses within chance_tolerance of it, with no improvement across them, is a stall (loss units; default: unknown)",
    )
    chance_tolerance: Fraction = Field(
        0.1, description="relative distance from chance_loss that still counts as at chance (fraction)"
    )
    chance_records: History = Field(
        6,
        description="finite losses judged against chance_loss; the run must also have logged trend.min_records finite losses (records)",
    )


class OscillationPolicy(_Section):
    """Loss bouncing without a downward trend (minibatch noise of a learning run is not this)."""

    enabled: bool = True
    min_improvement: Relative = Field(
        0.1,
        description="relative improvement of the median loss across the trend window below which there is no downward trend; lowered like stall.min_improvement for slow runs (fraction)",
    )
    min_spread: float = Field(
        0.15,
        gt=0,
        description="relative spread (IQR / median of the window) at or above which the loss counts as bouncing (fraction)",
    )
    high_fraction: float = Field(
        0.25,
        gt=0,
        description="only while the loss is above this fraction of its starting level: a converged run's relative noise is not oscillation (fraction)",
    )


class VanishingPolicy(_Section):
    """Some layers' gradients ~0 for many steps while others are not."""

    enabled: bool = True
    ratio: Fraction = Field(
        1e-6,
        description="a layer's grad norm below this fraction of the largest layer's counts as vanished (ratio)",
    )
    patience: Steps = Field(50, description="consecutive steps vanished before alerting (steps)")
    max_named: int = Field(
        3, ge=1, le=100, description="layers named in the one alert that covers every vanished layer of a step (count)"
    )
