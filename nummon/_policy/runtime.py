"""The runtime sections of a policy: what happens around the detectors (the alert lifecycle,
sampling cadence, the flight recorder, sinks, recovery, forensics, replica checks, the incident
report), validated as strictly as every section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .sections import Factor, FractionOrAll, Records, Seconds, Steps, StepsOrZero, _Section

__all__ = [
    "AlertPolicy",
    "SamplingPolicy",
    "RecorderPolicy",
    "SinkPolicy",
    "RecoveryPolicy",
    "ForensicsPolicy",
    "ReplicasPolicy",
    "ReportPolicy",
]


class AlertPolicy(_Section):
    """Alert lifecycle: deduplication, cooldown, clearing."""

    cooldown_steps: StepsOrZero = Field(
        20,
        description="the same kind/metric/location is not re-alerted at the same or lower severity within this many steps of its last alert (steps)",
    )
    incident_quiet_steps: Steps = Field(
        50,
        description="an incident resolves after this many steps with no open warning or critical condition and no new alert (steps)",
    )
    emit_cleared: bool = Field(True, description="emit an info alert when a warning or critical condition clears")
    stop_on_critical: bool = Field(True, description="report.should_stop becomes true on a critical alert")


class SamplingPolicy(_Section):
    """How often each statistic is computed (the hot path reads gradients every step)."""

    params_every: Steps = Field(
        10,
        description="parameter L2 norms and max |g| every this many steps, and every step while an incident is open or after a non-finite value (gradient norms are measured every step; between samples the largest gradient norm bounds max |g|, except for float16/float8 gradients, whose max |g| is measured every step) (steps)",
    )
    optimizer_every: Steps = Field(
        10,
        description="optimizer-state norm every this many steps, and every step while an incident is open or after a non-finite value (steps)",
    )
    activations: bool = Field(
        True, description="max |activation| of modules with parameters via forward hooks (off: never)"
    )
    activations_every: Steps = Field(
        10,
        description="the activation hooks run on every this many steps only, on the step after one whose values rose well out of the band the detectors had declared quiet (above a bound a detector set, or 1.44x above the value's recent level), during a run's first records (while the detectors warm up), and every step while an incident is open, after a non-finite value or for histograms; no hook is registered on the other steps (a hook costs 2-20 µs per module per forward). "
        "Gives up activation maxima on every step (a runaway of activation_max shows on every sampled step; between samples the gradient norm, measured every step, sees the same blow-up) "
        "and naming the first non-finite module on a non-finite step that was not sampled (named from the next step on, or at once by forensics with recompute=) (steps)",
    )
    activations_exclude: tuple[str, ...] = Field(
        (),
        description="module names (fnmatch patterns) the activation hooks skip, e.g. a language model's vocabulary head, whose logits can be most of the bytes the hooks read",
    )
    activations_all_every: Steps = Field(
        50,
        description="on models with more than 64 watched modules, a measuring step hooks only the block boundaries; every watched module's output every this many steps (and while an incident is open) (steps)",
    )
    histogram_every: StepsOrZero = Field(
        0,
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

    def activations_due(self, step: int) -> bool:
        """Whether `step`'s forward measures the activation maxima on the cadence."""
        return self.activations and step % self.activations_every == 0

    def optimizer_due(self, step: int) -> bool:
        """Whether `step` measures the optimizer state on the cadence."""
        return step % self.optimizer_every == 0


class RecorderPolicy(_Section):
    steps: Steps = Field(64, description="steps of statistics kept by the flight recorder")
    directory: str | None = Field(
        None,
        description="where the flight record is written on the first critical alert (default: the Monitor's run_dir, else the first JsonlSink's folder, else nummon-runs/<timestamp>/)",
    )
    write: bool = Field(True, description="write the flight record to a JSON file on the first critical alert")


class SinkPolicy(_Section):
    queue_size: Records = Field(
        1024,
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
    critical_timeout_s: Seconds = Field(
        5.0,
        description="post_step waits at most this long for the durable event logs (JSONL) to write and flush a critical alert; the other sinks get it without being waited for (seconds)",
    )
    flush_timeout_s: Seconds = Field(
        30.0, description="Monitor.flush() waits at most this long for the sinks (seconds)"
    )
    close_timeout_s: Seconds = Field(
        30.0,
        description="Monitor.close() waits at most this long for the sinks to write, flush and close (seconds)",
    )
    flush_every_steps: Steps = Field(
        1,
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
    guard_factor: Factor = Field(
        10.0, description="an outlier is at least this multiple of the recent median grad norm (ratio)"
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
    lr_factor: FractionOrAll = Field(
        0.5, description="after a rollback every param group's learning rate is multiplied by this (ratio)"
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
    every: Steps = Field(
        50,
        description="compare every this many steps; a divergence persists in the parameters, so it is named within this many steps (steps)",
    )


class ReportPolicy(_Section):
    """The incident report (`nummon report`) the Monitor writes into its run folder."""

    enabled: bool = Field(
        True,
        description="write nummon-report.html into the run folder when an incident reaches critical, when it goes non-finite, and at close; never on a healthy step",
    )
