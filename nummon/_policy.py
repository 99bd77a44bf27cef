"""Threshold policies: every threshold and window of every detector, validated strictly.

A policy is a pydantic model with ``extra="forbid"`` everywhere, so a typo is an error rather
than a silently ignored setting. Presets live as YAML in ``configs/`` (installed as
``nummon.configs``) and load by name.
"""
from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._errors import NummonError
from ._types import SCALAR_FIELDS

__all__ = [
    "FloatDtype",
    "Policy",
    "PolicyError",
    "PolicyLike",
    "MAX_POLICY_BYTES",
    "MAX_WINDOW",
    "NonfinitePolicy",
    "SpikePolicy",
    "RunawayPolicy",
    "HeadroomPolicy",
    "DivergencePolicy",
    "TrendPolicy",
    "StallPolicy",
    "OscillationPolicy",
    "VanishingPolicy",
    "AlertPolicy",
    "SamplingPolicy",
    "RecorderPolicy",
    "SinkPolicy",
    "load_policy",
    "policy_from_mapping",
    "policy_yaml",
    "preset_names",
    "validate_policy_file",
    "validation_messages",
]

#: Floating-point formats whose limits the headroom detector knows.
FloatDtype = Literal["float32", "bfloat16", "float16", "float64"]

#: Upper bound of every window, history and patience (steps or records): larger values are
#: typos that would only fail later (a deque of 1e30 entries), never a real setting.
MAX_WINDOW = 1_000_000

#: Policy files above this size are refused before parsing (a real policy is a few hundred bytes).
MAX_POLICY_BYTES = 1_000_000

#: Decades of headroom: float64 spans about 616 decades, so more than that is a typo.
Decades = Annotated[float, Field(ge=0, le=700)]

#: Keys that moved to another section, so an old policy file gets a pointer, not just "unknown key".
_MOVED = {
    ("stall", "window"): "trend.min_span",
    ("oscillation", "window"): "trend.min_span",
    ("divergence", "baseline_steps"): "trend.baseline_records",
}


class PolicyError(NummonError):
    """A policy could not be loaded or is invalid; the message is one line per problem."""


class _Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite threshold silently switches a detector off
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class NonfinitePolicy(_Section):
    enabled: bool = Field(True, description="critical alert on any NaN/Inf in loss, gradients, parameters, optimizer state or activations")


class SpikePolicy(_Section):
    """Sudden jumps against the run's own recent history (loss_spike, explosion)."""

    enabled: bool = True
    window: int = Field(50, ge=2, le=MAX_WINDOW, description="steps of finite history kept for the robust baseline (median of log10 values)")
    min_history: int = Field(1, ge=1, le=MAX_WINDOW, description="finite samples needed before a jump can be judged (steps)")
    loss_factor: float = Field(8.0, gt=1, description="loss_spike when the loss exceeds this multiple of its recent median (ratio)")
    grad_factor: float = Field(10.0, gt=1, description="explosion when grad norm, optimizer-state norm or max activation exceeds this multiple of its recent median (ratio)")
    robust_z: float = Field(3.0, gt=0, description="and exceeds the median by at least this many robust standard deviations of log10 values (sigma = 1.4826 * MAD)")
    short_history: int = Field(8, ge=1, le=MAX_WINDOW, description="below this many samples the baseline is uncertain and the factors are multiplied by short_history_multiplier (steps)")
    short_history_multiplier: float = Field(2.0, ge=1, description="factor multiplier while the history is short (ratio)")


class RunawayPolicy(_Section):
    """Sustained geometric growth over consecutive records."""

    enabled: bool = True
    min_growth: float = Field(1.5, gt=1, description="a step counts as growth when the value grows by at least this factor per step (ratio)")
    warning_steps: int = Field(2, ge=1, le=MAX_WINDOW, description="consecutive growth steps for a warning (steps)")
    critical_steps: int = Field(3, ge=1, le=MAX_WINDOW, description="consecutive growth steps for a critical alert (steps)")
    warning_total_factor: float = Field(10.0, gt=1, description="total growth over the streak needed for a warning (ratio)")
    critical_total_factor: float = Field(100.0, gt=1, description="total growth over the streak needed for a critical alert (ratio)")
    metrics: tuple[str, ...] = Field(
        ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max"),
        description=f"statistics watched for runaway growth (any of: {', '.join(SCALAR_FIELDS)})",
    )
    history: int = Field(50, ge=2, le=MAX_WINDOW, description="earlier finite values kept to judge whether a value stands above the metric's recent level (records)")
    short_history: int = Field(8, ge=1, le=MAX_WINDOW, description="below this many earlier values the total factors are raised to the power short_history_multiplier: growth from tiny initial values is normal (records)")
    short_history_multiplier: float = Field(2.0, ge=1, le=10, description="exponent applied to the total factors while the history is short")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [m for m in v if m not in SCALAR_FIELDS]
        if unknown:
            raise ValueError(f"unknown metric {', '.join(map(repr, unknown))} (valid: {', '.join(SCALAR_FIELDS)})")
        return v

    @model_validator(mode="after")
    def _order(self) -> "RunawayPolicy":
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
    def _order(self) -> "HeadroomPolicy":
        for dt, crit in self.critical_decades.items():
            warn = self.warning_decades.get(dt)
            if warn is not None and crit >= warn:
                raise ValueError(f"critical_decades[{dt}] ({crit}) must be < warning_decades[{dt}] ({warn})")
        return self


class DivergencePolicy(_Section):
    """Loss far above its starting level, held for a while."""

    enabled: bool = True
    warning_factor: float = Field(10.0, gt=1, description="warning when the loss stays above this multiple of the starting level (ratio)")
    critical_factor: float = Field(1e4, gt=1, description="critical when it stays above this multiple (ratio)")
    patience: int = Field(5, ge=1, le=MAX_WINDOW, description="the median of the last this many finite losses, and the current loss, must stand above the factor (records)")
    rebound_factor: float = Field(3.0, gt=1, description="warning when the median of the last `patience` losses stands at least this multiple above the best (lowest) smoothed loss so far: a run that had learned and lost it, however low it started (ratio)")
    rebound_smoothing: int = Field(3, ge=1, le=MAX_WINDOW, description="the best loss so far is the lowest median of this many consecutive finite losses, so one lucky batch does not set it (records)")
    rebound_min_level: float = Field(0.25, ge=0, description="a rebound counts only while the held loss is at least this fraction of the starting level: noise around a loss near zero is not divergence (fraction)")

    @model_validator(mode="after")
    def _order(self) -> "DivergencePolicy":
        if self.critical_factor <= self.warning_factor:
            raise ValueError("critical_factor must be > warning_factor")
        return self


class TrendPolicy(_Section):
    """The loss's starting level and trend window, shared by divergence, stall and oscillation.

    The window grows with the run: its span is the largest of ``min_span``, ``span_fraction`` of
    the steps so far, and ``min_records`` records at the run's logging cadence.
    """

    baseline_records: int = Field(10, ge=1, le=MAX_WINDOW, description="the starting level is the lowest running median of the first this many finite losses, so a run that blows up early is still judged against where it started (records)")
    min_span: int = Field(100, ge=10, le=MAX_WINDOW, description="shortest trend window: the median of its second half is compared against its first (steps)")
    min_records: int = Field(10, ge=4, le=MAX_WINDOW, description="finite losses a window must hold before it is judged (records)")
    span_fraction: float = Field(1.0, gt=0, le=1, description="the window grows to this fraction of the steps the run has lasted (fraction)")


class StallPolicy(_Section):
    """No meaningful improvement over the trend window while the loss is still high."""

    enabled: bool = True
    min_improvement: float = Field(0.05, ge=0, lt=1, description="relative improvement of the median loss across the window below which the run counts as not improving; lowered to half the run's own average progress over the same span when the run has always been slower (fraction)")
    high_fraction: float = Field(0.5, gt=0, description="the loss counts as still high above this fraction of its starting level (fraction)")
    max_spread: float = Field(0.2, gt=0, description="above this relative spread (IQR / median) a flat loss is oscillation, not a stall (fraction)")
    frozen_records: int = Field(10, ge=2, le=MAX_WINDOW, description="a loss that has not moved for this many consecutive finite records while still above high_fraction of its starting level is a stall, however short the run (records)")
    frozen_tolerance: float = Field(1e-3, ge=0, lt=1, description="the loss counts as not moving while (max - min) / median of those records stays at or below this; 1e-3 covers losses printed with 4 significant digits (fraction)")
    chance_match: float = Field(0.01, ge=0, lt=0.1, description="without chance_loss: a loss whose last frozen_records records all lie within this relative distance of ln k (k = 2..10 classes) is stuck at chance (fraction)")
    chance_loss: float | None = Field(None, gt=0, description="the loss of a model that predicts nothing (a classifier's chance level: ln(number of classes) for balanced classes); when set, the median of the last chance_records losses within chance_tolerance of it, with no improvement across them, is a stall (loss units; default: unknown)")
    chance_tolerance: float = Field(0.1, gt=0, lt=1, description="relative distance from chance_loss that still counts as at chance (fraction)")
    chance_records: int = Field(6, ge=2, le=MAX_WINDOW, description="finite losses judged against chance_loss; the run must also have logged trend.min_records finite losses (records)")


class OscillationPolicy(_Section):
    """Loss bouncing without a downward trend (minibatch noise of a learning run is not this)."""

    enabled: bool = True
    min_improvement: float = Field(0.1, ge=0, lt=1, description="relative improvement of the median loss across the trend window below which there is no downward trend; lowered like stall.min_improvement for slow runs (fraction)")
    min_spread: float = Field(0.15, gt=0, description="relative spread (IQR / median of the window) at or above which the loss counts as bouncing (fraction)")
    high_fraction: float = Field(0.25, gt=0, description="only while the loss is above this fraction of its starting level: a converged run's relative noise is not oscillation (fraction)")


class VanishingPolicy(_Section):
    """Some layers' gradients ~0 for many steps while others are not."""

    enabled: bool = True
    ratio: float = Field(1e-6, gt=0, lt=1, description="a layer's grad norm below this fraction of the largest layer's counts as vanished (ratio)")
    patience: int = Field(50, ge=1, le=MAX_WINDOW, description="consecutive steps vanished before alerting (steps)")
    max_named: int = Field(3, ge=1, le=100, description="layers named in the one alert that covers every vanished layer of a step (count)")


class AlertPolicy(_Section):
    """Alert lifecycle: deduplication, cooldown, clearing."""

    cooldown_steps: int = Field(20, ge=0, le=MAX_WINDOW, description="the same kind/metric/location is not re-alerted at the same or lower severity within this many steps of its last alert (steps)")
    incident_quiet_steps: int = Field(50, ge=1, le=MAX_WINDOW, description="an incident resolves after this many steps with no open warning or critical condition and no new alert (steps)")
    emit_cleared: bool = Field(True, description="emit an info alert when a warning or critical condition clears")
    stop_on_critical: bool = Field(True, description="report.should_stop becomes true on a critical alert")


class SamplingPolicy(_Section):
    """How often each statistic is computed (the hot path reads gradients every step)."""

    params_every: int = Field(1, ge=1, le=MAX_WINDOW, description="parameter L2 norms every this many steps")
    optimizer_every: int = Field(1, ge=1, le=MAX_WINDOW, description="optimizer-state norm every this many steps")
    activations: bool = Field(True, description="max |activation| of modules with parameters via forward hooks")
    activations_exclude: tuple[str, ...] = Field((), description="module names (fnmatch patterns) the activation hooks skip, e.g. a language model's vocabulary head, whose logits can be most of the bytes the hooks read")
    histogram_every: int = Field(0, ge=0, le=MAX_WINDOW, description="histograms for sinks every this many steps (0: never)")
    lag_one_step: bool = Field(True, description="on CUDA, read the statistics of step t at step t+1 with a non-blocking copy so the GPU never waits")


class RecorderPolicy(_Section):
    steps: int = Field(64, ge=1, le=MAX_WINDOW, description="steps of statistics kept by the flight recorder")
    directory: str | None = Field(None, description="where the flight record is written on the first critical alert (default: the Monitor's run_dir, else the first JsonlSink's folder, else nummon-runs/<timestamp>/)")
    write: bool = Field(True, description="write the flight record to a JSON file on the first critical alert")


class SinkPolicy(_Section):
    queue_size: int = Field(1024, ge=1, le=MAX_WINDOW, description="step records buffered per sink thread (alerts are never dropped and not counted here)")
    when_full: Literal["drop", "block"] = Field("drop", description="when a sink's queue is full: drop the step record (counted in Monitor.sink_stats) or block training until there is room, at most block_timeout_s")
    block_timeout_s: float = Field(10.0, gt=0, le=3600, description="in block mode, the longest a step waits for room in a sink's queue; then the record is dropped and the wait logged (seconds)")
    critical_timeout_s: float = Field(5.0, ge=0, le=3600, description="post_step waits at most this long for every sink to write and flush a critical alert (seconds)")
    flush_timeout_s: float = Field(30.0, ge=0, le=3600, description="Monitor.flush() waits at most this long for the sinks (seconds)")
    close_timeout_s: float = Field(30.0, ge=0, le=3600, description="Monitor.close() waits at most this long for the sinks to write, flush and close (seconds)")
    flush_every_steps: int = Field(1, ge=1, le=1_000_000, description="a JSONL log flushes step records to the OS at least every this many steps (alerts: at once)")
    handle_sigterm: bool = Field(True, description="on SIGTERM (when no other handler is installed), close live monitors so their logs are complete, then exit as SIGTERM would")
    rank0_only: bool = Field(True, description="under torch.distributed, only rank 0 feeds the sinks")
    jsonl: str | None = Field(None, description="path of a JSONL event log to add (a JsonlSink)")
    console: bool = Field(False, description="add a ConsoleSink (stdlib logging)")


class RecoveryPolicy(_Section):
    """Opt-in self-repair (issue 17): skip a poisoned update, roll a runaway back to a healthy snapshot.

    Costs when enabled: one host read per optimizer step (the guard's total gradient norm, read
    at `optimizer.step()` time; under torch.distributed one more small all_reduce), and a copy of
    the model and optimizer state in host memory (about 1x the model's bytes for SGD, 3x for SGD
    momentum/Adam), refreshed every `snapshot_every` steps (non-blocking copies on CUDA).
    """

    enabled: bool = Field(False, description="turn recovery on: wrap optimizer.step with a gradient guard and keep rollback snapshots (off: nummon only watches)")
    skip_nonfinite: bool = Field(True, description="skip an update whose gradients hold a NaN/Inf (parameters and optimizer state untouched, gradients zeroed)")
    skip_outliers: bool = Field(True, description="skip an update whose total gradient norm is far above its robust recent range")
    guard_window: int = Field(50, ge=4, description="accepted steps of total gradient norm kept for the guard's baseline (median and MAD of log10 values) (steps)")
    guard_min_history: int = Field(10, ge=2, description="accepted steps needed before an outlier can be judged (steps)")
    guard_factor: float = Field(10.0, gt=1, description="an outlier is at least this multiple of the recent median grad norm (ratio)")
    guard_mad: float = Field(6.0, gt=0, description="and at least this many robust standard deviations (1.4826 * MAD of log10 values) above it")
    skip_window: int = Field(20, ge=1, description="window in which repeated skips are counted (steps)")
    max_skips: int = Field(3, ge=0, description="more skips than this within skip_window is a warning; more than twice this triggers a rollback (skips)")
    rollback: bool = Field(True, description="on a critical trigger, restore the last healthy snapshot and lower the learning rate")
    snapshot_every: int = Field(50, ge=1, description="take a snapshot every this many steps, when the last this-many steps raised no warning (steps)")
    lr_factor: float = Field(0.5, gt=0, le=1, description="after a rollback every param group's learning rate is multiplied by this (ratio)")
    max_rollbacks: int = Field(3, ge=0, description="retry budget: rollbacks allowed in a run; when spent, a critical alert stops the run as without recovery")
    triggers: tuple[Literal["nonfinite", "runaway", "divergence", "extreme"], ...] = Field(
        ("nonfinite", "runaway", "divergence", "extreme"),
        description="critical alert kinds that trigger a rollback (a non-finite step always does unless its update was skipped)",
    )


class Policy(_Section):
    """Every threshold and window nummon uses. Load presets with ``Policy.load("strict")``."""

    name: str = Field("custom", description="a label for reports")
    nonfinite: NonfinitePolicy = NonfinitePolicy()
    spike: SpikePolicy = SpikePolicy()
    runaway: RunawayPolicy = RunawayPolicy()
    headroom: HeadroomPolicy = HeadroomPolicy()
    divergence: DivergencePolicy = DivergencePolicy()
    trend: TrendPolicy = TrendPolicy()
    stall: StallPolicy = StallPolicy()
    oscillation: OscillationPolicy = OscillationPolicy()
    vanishing: VanishingPolicy = VanishingPolicy()
    alerts: AlertPolicy = AlertPolicy()
    sampling: SamplingPolicy = SamplingPolicy()
    recorder: RecorderPolicy = RecorderPolicy()
    sinks: SinkPolicy = SinkPolicy()
    recovery: RecoveryPolicy = RecoveryPolicy()

    @model_validator(mode="after")
    def _windows(self) -> "Policy":
        if self.spike.min_history > self.spike.window:
            raise ValueError("spike.min_history must be <= spike.window")
        return self

    @classmethod
    def load(cls, source: "PolicyLike") -> "Policy":
        """A policy from a preset name, a YAML/TOML/JSON file, a dict, or a Policy."""
        return load_policy(source)


PolicyLike = Union[Policy, str, "os.PathLike[str]", dict, None]


def preset_names() -> list[str]:
    """Names of the presets shipped in ``configs/``."""
    return sorted(p.name[:-5] for p in resources.files("nummon.configs").iterdir() if p.name.endswith(".yaml"))


def _read_mapping(path: Path) -> dict[str, Any]:
    """The mapping in a policy file; every failure is one line naming the file and the problem."""
    try:
        size = path.stat().st_size
        if size > MAX_POLICY_BYTES:
            raise PolicyError(f"policy file {path} is {size:,} bytes; a policy is at most {MAX_POLICY_BYTES:,}")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"policy file not found: {path}") from None
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"policy file {path} is not UTF-8 text (byte {e.start})") from None
    return _parse_mapping(text, path.suffix.lower(), str(path))


def _parse_mapping(text: str, suffix: str, origin: str) -> dict[str, Any]:
    """Parse policy text by suffix (.json, .toml, else YAML) into a mapping."""
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except RecursionError:
        raise PolicyError(f"cannot parse policy {origin}: nested too deeply") from None
    except Exception as e:  # parser errors differ per format; one line with a position is what the user needs
        raise PolicyError(f"cannot parse policy {origin}: {_parse_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy {origin} must hold a mapping, got {type(data).__name__}")
    return data


def _parse_problem(e: Exception) -> str:
    """One line: the parser's problem and, where it knows it, the line and column (1-based)."""
    mark = getattr(e, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        problem = getattr(e, "problem", None) or getattr(e, "context", None) or type(e).__name__
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}, column {e.colno}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _loc_part(p: Any) -> str:
    """A field path element as the user typed it; odd keys (spaces, newlines) quoted."""
    text = str(p)
    return text if isinstance(p, int) or text.replace("_", "a").isalnum() else repr(text)


def validation_messages(err: ValidationError) -> list[str]:
    """One line per problem, each with its field path."""
    out = []
    for e in err.errors():
        loc = ".".join(_loc_part(p) for p in e["loc"]) or "(policy)"
        msg = e["msg"].replace("\n", " ")
        if e["type"] == "extra_forbidden":
            moved = _MOVED.get(tuple(str(p) for p in e["loc"]))
            msg = f"unknown key (moved to {moved})" if moved else "unknown key"
        out.append(f"{loc}: {msg}")
    return out


def policy_from_mapping(data: dict[str, Any], origin: str = "policy") -> Policy:
    """Validate a mapping into a Policy; every problem in one line."""
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        msgs = validation_messages(e)
        raise PolicyError(f"invalid {origin}: " + "; ".join(msgs)) from None
    except RecursionError:
        raise PolicyError(f"invalid {origin}: nested too deeply") from None


def load_policy(source: PolicyLike = None) -> Policy:
    """Resolve a preset name, a file path, a mapping or a Policy into a validated Policy."""
    if source is None:
        source = "default"
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return policy_from_mapping(source)
    if isinstance(source, (str, os.PathLike)):
        data, origin = _source_mapping(source)
        return policy_from_mapping(data, origin)
    raise PolicyError(f"policy must be a preset name, a path, a mapping or nummon.Policy, got {type(source).__name__}")


def _source_mapping(source: "str | os.PathLike[str]") -> tuple[dict[str, Any], str]:
    """(mapping, origin) of a preset name or a policy file path."""
    text = os.fspath(source)
    if "\0" in text:
        raise PolicyError("policy path contains a NUL byte")
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".toml", ".json") or os.sep in text or path.exists():
        return _read_mapping(path), f"policy {path}"
    names = preset_names()
    if text not in names:
        raise PolicyError(f"unknown policy preset {text!r} (presets: {', '.join(names)}; or give a .yaml/.toml/.json path)")
    preset = resources.files("nummon.configs").joinpath(f"{text}.yaml").read_text("utf-8")
    return _parse_mapping(preset, ".yaml", f"preset {text!r}"), f"preset {text!r}"


def policy_yaml(policy: Policy, with_descriptions: bool = True) -> str:
    """The effective policy as YAML, each field preceded by its description as a comment."""
    lines: list[str] = []

    def emit(model: BaseModel, indent: int) -> None:
        pad = "  " * indent
        for name, info in type(model).model_fields.items():
            value = getattr(model, name)
            if with_descriptions and info.description:
                lines.append(f"{pad}# {info.description}")
            if isinstance(value, BaseModel):
                lines.append(f"{pad}{name}:")
                emit(value, indent + 1)
            else:
                import yaml

                dumped = yaml.safe_dump({name: list(value) if isinstance(value, tuple) else value}, default_flow_style=True, sort_keys=False).strip()
                if dumped.startswith("{") and dumped.endswith("}"):
                    dumped = dumped[1:-1]
                lines.append(f"{pad}{dumped}")

    emit(policy, 0)
    return "\n".join(lines) + "\n"


def validate_policy_file(path: "str | os.PathLike[str]") -> list[str]:
    """Every validation error of a policy file or preset name, each with its field path (empty:
    valid). A file that cannot be read or parsed raises PolicyError (one line)."""
    data, _ = _source_mapping(path)
    try:
        Policy.model_validate(data)
    except ValidationError as e:
        return validation_messages(e)
    except RecursionError:
        return ["(policy): nested too deeply"]
    return []
