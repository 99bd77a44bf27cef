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
from typing import Any, Literal, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from ._errors import NummonError
from ._policy_sections import (  # noqa: F401  (re-exported: the detector sections)
    MAX_WINDOW,
    AdamMomentPolicy,
    AttentionPolicy,
    Decades,
    DivergencePolicy,
    FloatDtype,
    HeadroomPolicy,
    MechanismsPolicy,
    NonfinitePolicy,
    OscillationPolicy,
    OutputLogitsPolicy,
    ReportPolicy,
    RunawayPolicy,
    SpikePolicy,
    StallPolicy,
    TrendPolicy,
    VanishingPolicy,
    _Section,
)

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
    "MechanismsPolicy",
    "AttentionPolicy",
    "OutputLogitsPolicy",
    "AdamMomentPolicy",
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

#: Policy files above this size are refused before parsing (a real policy is a few hundred bytes).
MAX_POLICY_BYTES = 1_000_000

#: Keys that moved to another section, so an old policy file gets a pointer, not just "unknown key".
_MOVED: dict[tuple[str, ...], str] = {
    ("stall", "window"): "trend.min_span",
    ("oscillation", "window"): "trend.min_span",
    ("divergence", "baseline_steps"): "trend.baseline_records",
}


class PolicyError(NummonError):
    """A policy could not be loaded or is invalid; the message is one line per problem."""


class AlertPolicy(_Section):
    """Alert lifecycle: deduplication, cooldown, clearing."""

    cooldown_steps: int = Field(
        20,
        ge=0,
        le=MAX_WINDOW,
        description="the same kind/metric/location is not re-alerted at the same or lower severity within this many steps of its last alert (steps)",
    )
    incident_quiet_steps: int = Field(
        50,
        ge=1,
        le=MAX_WINDOW,
        description="an incident resolves after this many steps with no open warning or critical condition and no new alert (steps)",
    )
    emit_cleared: bool = Field(True, description="emit an info alert when a warning or critical condition clears")
    stop_on_critical: bool = Field(True, description="report.should_stop becomes true on a critical alert")


class SamplingPolicy(_Section):
    """How often each statistic is computed (the hot path reads gradients every step)."""

    params_every: int = Field(
        10,
        ge=1,
        le=MAX_WINDOW,
        description="parameter L2 norms and max |g| every this many steps, and every step while an incident is open or after a non-finite value (gradient norms are measured every step; between samples the largest gradient norm bounds max |g|, except for float16/float8 gradients, whose max |g| is measured every step) (steps)",
    )
    optimizer_every: int = Field(
        10,
        ge=1,
        le=MAX_WINDOW,
        description="optimizer-state norm every this many steps, and every step while an incident is open or after a non-finite value (steps)",
    )
    activations: bool = Field(True, description="max |activation| of modules with parameters via forward hooks")
    activations_exclude: tuple[str, ...] = Field(
        (),
        description="module names (fnmatch patterns) the activation hooks skip, e.g. a language model's vocabulary head, whose logits can be most of the bytes the hooks read",
    )
    activations_all_every: int = Field(
        50,
        ge=1,
        le=MAX_WINDOW,
        description="on models with more than 64 watched modules, only the block boundaries are hooked every step; every watched module's output every this many steps (and while an incident is open)",
    )
    histogram_every: int = Field(
        0,
        ge=0,
        le=MAX_WINDOW,
        description="histograms for sinks every this many steps (0: the sinks' own cadence: every 500 steps for TensorBoard and W&B; a sink's histogram_every=0 turns its histograms off)",
    )
    lag_one_step: bool = Field(
        True,
        description="on CUDA, read the statistics of step t at step t+1 with a non-blocking copy so the GPU never waits",
    )

    def params_due(self, step: int) -> bool:
        """Whether `step` measures the parameters and max |g| on the cadence (the Monitor for
        this step, the pre-clip capture for the next backward: one rule for both)."""
        return step % self.params_every == 0

    def optimizer_due(self, step: int) -> bool:
        """Whether `step` measures the optimizer state on the cadence."""
        return step % self.optimizer_every == 0


class RecorderPolicy(_Section):
    steps: int = Field(64, ge=1, le=MAX_WINDOW, description="steps of statistics kept by the flight recorder")
    directory: str | None = Field(
        None,
        description="where the flight record is written on the first critical alert (default: the Monitor's run_dir, else the first JsonlSink's folder, else nummon-runs/<timestamp>/)",
    )
    write: bool = Field(True, description="write the flight record to a JSON file on the first critical alert")


class SinkPolicy(_Section):
    queue_size: int = Field(
        1024,
        ge=1,
        le=MAX_WINDOW,
        description="step records buffered per sink thread (alerts are never dropped and not counted here)",
    )
    when_full: Literal["drop", "block"] = Field(
        "drop",
        description="when a sink's queue is full: drop the step record (counted in Monitor.sink_stats) or block training until there is room, at most block_timeout_s",
    )
    block_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="in block mode, the longest a step waits for room in a sink's queue; then the record is dropped and the wait logged (seconds)",
    )
    critical_timeout_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="post_step waits at most this long for the durable event logs (JSONL) to write and flush a critical alert; the other sinks get it without being waited for (seconds)",
    )
    flush_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="Monitor.flush() waits at most this long for the sinks (seconds)"
    )
    close_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Monitor.close() waits at most this long for the sinks to write, flush and close (seconds)",
    )
    flush_every_steps: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="a JSONL log flushes step records to the OS at least every this many steps (alerts: at once)",
    )
    handle_sigterm: bool = Field(
        True,
        description="on SIGTERM (when no other handler is installed), close live monitors so their logs are complete, then exit as SIGTERM would",
    )
    rank0_only: bool = Field(True, description="under torch.distributed, only rank 0 feeds the sinks")
    jsonl: str | None = Field(None, description="path of a JSONL event log to add (a JsonlSink)")
    console: bool = Field(False, description="add a ConsoleSink (stdlib logging)")


class RecoveryPolicy(_Section):
    """Opt-in self-repair: skip a poisoned update, roll a runaway back to a healthy snapshot.

    Costs when enabled: one host read per optimizer step (the guard's total gradient norm, read
    at `optimizer.step()` time; under torch.distributed one more small all_reduce), and a copy of
    the model and optimizer state in host memory (about 1x the model's bytes for SGD, 3x for SGD
    momentum/Adam), refreshed every `snapshot_every` steps (non-blocking copies on CUDA).
    """

    enabled: bool = Field(
        False,
        description="turn recovery on: wrap optimizer.step with a gradient guard and keep rollback snapshots (off: nummon only watches)",
    )
    skip_nonfinite: bool = Field(
        True,
        description="skip an update whose gradients hold a NaN/Inf (parameters and optimizer state untouched, gradients zeroed)",
    )
    skip_outliers: bool = Field(
        True, description="skip an update whose total gradient norm is far above its robust recent range"
    )
    guard_window: int = Field(
        50,
        ge=4,
        description="accepted steps of total gradient norm kept for the guard's baseline (median and MAD of log10 values) (steps)",
    )
    guard_min_history: int = Field(
        10, ge=2, description="accepted steps needed before an outlier can be judged (steps)"
    )
    guard_factor: float = Field(
        10.0, gt=1, description="an outlier is at least this multiple of the recent median grad norm (ratio)"
    )
    guard_mad: float = Field(
        6.0,
        gt=0,
        description="and at least this many robust standard deviations (1.4826 * MAD of log10 values) above it",
    )
    skip_window: int = Field(20, ge=1, description="window in which repeated skips are counted (steps)")
    max_skips: int = Field(
        3,
        ge=0,
        description="more skips than this within skip_window is a warning; more than twice this triggers a rollback (skips)",
    )
    rollback: bool = Field(
        True, description="on a critical trigger, restore the last healthy snapshot and lower the learning rate"
    )
    snapshot_every: int = Field(
        50,
        ge=1,
        description="take a snapshot every this many steps, when the last this-many steps raised no warning (steps)",
    )
    lr_factor: float = Field(
        0.5, gt=0, le=1, description="after a rollback every param group's learning rate is multiplied by this (ratio)"
    )
    max_rollbacks: int = Field(
        3,
        ge=0,
        description="retry budget: rollbacks allowed in a run; when spent, a critical alert stops the run as without recovery",
    )
    triggers: tuple[
        Literal["nonfinite", "runaway", "divergence", "extreme", "output_logits", "attention_logits"], ...
    ] = Field(
        ("nonfinite", "runaway", "divergence", "extreme", "output_logits", "attention_logits"),
        description="critical alert kinds that trigger a rollback (a non-finite step always does unless its update was skipped); "
        "critical output or attention logits are a divergence on its way, and a lower LR is their documented fix",
    )


class ForensicsPolicy(_Section):
    """Why the first non-finite value appeared (operator, line, cause), on the failing step only."""

    enabled: bool = Field(
        True,
        description="explain a non-finite step by re-running its forward and backward under operator interception, when the loop passes post_step(..., recompute=fn) or a framework callback can recompute; costs nothing on healthy steps",
    )


class ReplicasPolicy(_Section):
    """Data-parallel replica checks: after the gradient all-reduce every rank holds bit-identical
    gradients and parameters; a fingerprint of each rides in nummon's one collective per step."""

    enabled: bool | None = Field(
        None,
        description="compare replicas across ranks; null: when the model is wrapped in DistributedDataParallel (other parallelisms hold different values on purpose)",
    )
    every: int = Field(
        50,
        ge=1,
        le=1_000_000,
        description="compare every this many steps; a divergence persists in the parameters, so it is named within this many steps (steps)",
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
    attention: AttentionPolicy = AttentionPolicy()
    output_logits: OutputLogitsPolicy = OutputLogitsPolicy()
    adam_moment: AdamMomentPolicy = AdamMomentPolicy()
    mechanisms: MechanismsPolicy = MechanismsPolicy()
    alerts: AlertPolicy = AlertPolicy()
    sampling: SamplingPolicy = SamplingPolicy()
    recorder: RecorderPolicy = RecorderPolicy()
    sinks: SinkPolicy = SinkPolicy()
    recovery: RecoveryPolicy = RecoveryPolicy()
    forensics: ForensicsPolicy = ForensicsPolicy()
    replicas: ReplicasPolicy = ReplicasPolicy()
    report: ReportPolicy = ReportPolicy()

    @model_validator(mode="after")
    def _windows(self) -> Policy:
        if self.spike.min_history > self.spike.window:
            raise ValueError("spike.min_history must be <= spike.window")
        return self

    @classmethod
    def load(cls, source: PolicyLike) -> Policy:
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
            data = _yaml_load(text)
    except PolicyError as e:
        raise PolicyError(f"cannot parse policy {origin}: {e}") from None
    except RecursionError:
        raise PolicyError(f"cannot parse policy {origin}: nested too deeply") from None
    except Exception as e:  # parser errors differ per format; one line with a position is what the user needs
        raise PolicyError(f"cannot parse policy {origin}: {_parse_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy {origin} must hold a mapping, got {type(data).__name__}")
    return data


def _yaml_load(text: str) -> Any:
    """YAML through a safe loader that refuses a key given twice in one mapping (the last value
    would win silently): PolicyError naming the key and both lines."""
    import yaml

    class _UniqueKeyLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise PolicyError(f"duplicate key {key!r} at line {line} (first given at line {first})")
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    _UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


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


def _source_mapping(source: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(mapping, origin) of a preset name or a policy file path."""
    text = os.fspath(source)
    if "\0" in text:
        raise PolicyError("policy path contains a NUL byte")
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml", ".toml", ".json") or os.sep in text or path.exists():
        return _read_mapping(path), f"policy {path}"
    names = preset_names()
    if text not in names:
        raise PolicyError(
            f"unknown policy preset {text!r} (presets: {', '.join(names)}; or give a .yaml/.toml/.json path)"
        )
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

                dumped = yaml.safe_dump(
                    {name: list(value) if isinstance(value, tuple) else value}, default_flow_style=True, sort_keys=False
                ).strip()
                if dumped.startswith("{") and dumped.endswith("}"):
                    dumped = dumped[1:-1]
                lines.append(f"{pad}{dumped}")

    emit(policy, 0)
    return "\n".join(lines) + "\n"


def validate_policy_file(path: str | os.PathLike[str]) -> list[str]:
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
