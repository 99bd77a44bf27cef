"""What the Lightning and Hugging Face callbacks share: the policy override, the run's own
event log, and the loss of one optimizer step gathered from its micro-batches.

Imports neither framework (and not torch at module level), so both callbacks can use it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Any

from nummon import ConsoleSink, JsonlSink, Policy, Severity, StepReport, load_policy
from nummon._support import PolicyLike, clip_ratio, plain_text

__all__ = [
    "EVENTS_FILE",
    "ConsoleLogger",
    "StepAsMetric",
    "StepLoss",
    "bars_cleared",
    "clip_ratio",
    "console_log",
    "console_sinks",
    "events_sink",
    "loss_of",
    "resolve_policy",
    "restore_engine",
    "saved_state",
    "start_line",
    "stop_line",
    "summary_line",
    "with_class_count",
]

EVENTS_FILE = "nummon-events.jsonl"


def resolve_policy(policy: PolicyLike, stop_on_critical: bool | None) -> Policy:
    """The policy, with `alerts.stop_on_critical` overridden when the callback was given one."""
    pol = load_policy(policy)
    if stop_on_critical is None:
        return pol
    alerts = pol.alerts.model_copy(update={"stop_on_critical": bool(stop_on_critical)})
    return pol.model_copy(update={"alerts": alerts})


def events_sink(run_dir: str | os.PathLike[str], policy: Policy, distributed: bool) -> JsonlSink:
    """The run's event log in the framework's run folder (one per rank when every rank writes)."""
    name = EVENTS_FILE
    if distributed and not policy.sinks.rank0_only:
        name = "nummon-events-rank{rank}.jsonl"
    return JsonlSink(Path(run_dir) / name)


def saved_state(state: Any, origin: str) -> dict[str, Any] | None:
    """A callback's saved `{"engine": {...}, "step": int}`, or None with one warning when it is
    something else (an edited or truncated checkpoint, another tool's entry): the run starts cold."""
    if not state:
        return None
    engine = state.get("engine") if isinstance(state, dict) else None
    step = state.get("step", 0) if isinstance(state, dict) else None
    if isinstance(engine, dict) and isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return {"engine": engine, "step": step}
    warn_cold_start(
        origin,
        f"not a saved state (a {type(state).__name__}"
        + (f" with engine {type(engine).__name__} and step {step!r})" if isinstance(state, dict) else ")"),
    )
    return None


def warn_cold_start(origin: str, why: str) -> None:
    """The one warning of a resume whose nummon state cannot be used."""
    console_log.warning("nummon: %s is %s; the health engine starts cold", origin, why)


def restore_engine(monitor: Any, restored: dict[str, Any] | None, origin: str, cold_step: int) -> bool:
    """Load a checked `saved_state` into a fresh Monitor's engine; on a StateError (nothing was
    changed) warn once and start cold at `cold_step`. True when the state was loaded."""
    from nummon import StateError

    if not restored:
        return False
    try:
        monitor.load_engine_state(restored["engine"], origin=origin)
    except StateError as e:
        warn_cold_start(origin, f"unusable ({str(e).removeprefix(origin + ': ')})")
        monitor.step = cold_step
        return False
    return True


def with_class_count(policy: Policy, classes: int | None) -> Policy:
    """The policy with `stall.chance_loss` = ln(classes) when the task's class count is known and
    the policy names no chance loss: only then may a stall say "chance level"."""
    if classes is None or classes < 2 or policy.stall.chance_loss is not None:
        return policy
    stall = policy.stall.model_copy(update={"chance_loss": math.log(classes)})
    return policy.model_copy(update={"stall": stall})


#: A LightningModule or Hugging Face model that sets this attribute in its training step (a tensor
#: of per-sample losses) gets the worst samples named in nummon's records and alerts.
PER_SAMPLE_ATTR = "nummon_per_sample_loss"


def take_per_sample(module: Any) -> Any:
    """The per-sample losses a module left for this step (then cleared), or None."""
    for m in (module, getattr(module, "module", None)):  # DDP / DataParallel wrappers
        v = getattr(m, PER_SAMPLE_ATTR, None) if m is not None else None
        if v is not None:
            try:
                setattr(m, PER_SAMPLE_ATTR, None)
            except AttributeError:
                pass
            return v
    return None


def console_sinks(console: bool, policy: Policy) -> list[ConsoleSink]:
    """The callback's console: one line per incident event on the "nummon" logger, written on
    the training thread (so it comes before the trainer's next log line) and on a line of its
    own when a progress bar is open (`console_log`), as `ConsoleSink` does in a loop; none when `console` is off or the policy adds one already (`sinks.console`)."""
    if not console or policy.sinks.console:
        return []
    return [ConsoleSink(logger=console_log, min_severity=Severity.WARNING)]  # type: ignore[arg-type]


def bars_cleared() -> Any:
    """A context in which any open tqdm progress bar is cleared and redrawn after (what
    `tqdm.write` does): a console line written inside it starts on its own line instead of being
    glued to the bar (`...[00:02<02:06, 2.57s/it]nummon: run lost`)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return contextlib.nullcontext()
    if not getattr(tqdm, "_instances", None):
        return contextlib.nullcontext()
    return tqdm.external_write_mode()


class ConsoleLogger:
    """The "nummon" logger as the callbacks write to it: each line with open progress bars
    cleared first (`bars_cleared`); handlers, levels and filters are the logger's own."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("nummon")

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        with bars_cleared():
            self.logger.log(level, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)


console_log = ConsoleLogger()


def _count(n: float) -> str:
    """1234 -> "1.2k", 3_400_000 -> "3.4M" (parameters)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def start_line(model: Any, policy: Policy, events_path: Path, run_dir: str | os.PathLike[str]) -> str:
    """What the callback watches and where its files go: one line at the start of training."""
    params = [p for p in model.parameters()] if model is not None else []
    trainable = sum(p.numel() for p in params if p.requires_grad)
    s = policy.sampling
    return (
        f"nummon: watching {type(model).__name__} ({_count(trainable)} trainable parameters in {len(params)} tensors), "
        f"policy {policy.name} (stop on critical: {'yes' if policy.alerts.stop_on_critical else 'no'}); "
        f"gradients every step, parameters every {s.params_every} and optimizer state every {s.optimizer_every} "
        f"steps, activations {f'every {s.activations_every} steps' if s.activations else 'off'}; events in {events_path}, "
        f"flight records in {run_dir}"
    )


def summary_line(monitor: Any, first_step: int, events_path: Path) -> str:
    """The end of a run as nummon saw it: steps, incidents (count, worst state), the worst moment
    (the first step at the worst state, and what), and where the files are."""
    steps = monitor.step - first_step
    opened = [e for e in monitor.incidents if e.state.rank >= 1]
    text = f"nummon: finished watching {steps} step{'s' if steps != 1 else ''}"
    if not opened:
        text += ": no incident"
    else:
        count = len({e.number for e in opened})
        worst = max(opened, key=lambda e: (e.state.rank, -e.step))
        what = worst.title.removeprefix("nummon: ")
        where = next(
            (a.location for a in monitor.alerts if a.step == worst.step and a.kind.value == "nonfinite" and a.location),
            None,
        )
        text += (
            f": {count} incident{'s' if count != 1 else ''}, worst state {worst.state.value}; "
            f"the worst moment: step {worst.step}, {what}" + (f" in {plain_text(where)}" if where else "")
        )
        last = monitor.incidents[-1]
        text += (
            f"; incident {last.number} ended at step {last.step}"
            if last.state.value == "resolved"
            else f"; incident {last.number} still open at the end"
        )
    text += f"; events in {events_path}"
    if monitor.flight_record is not None:
        text += f", flight record {monitor.flight_record}"
    return text


def stop_line(report: StepReport) -> str:
    """The console line of a stop: the step, the incident and the critical alert behind it."""
    event = report.incidents[-1] if report.incidents else None
    crit = next((a for a in report.alerts if a.severity is Severity.CRITICAL), None)
    text = f"nummon: stopping training at step {report.step}"
    if event is not None:
        text += f": incident {event.number}, {event.title.removeprefix('nummon: ')}"
    if crit is not None:
        text += f" ({crit})"
    return text


def loss_of(output: Any) -> Any:
    """The loss in what a training step returned: a tensor, or a mapping / object with `loss`."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", output)


class StepLoss:
    """The loss of one optimizer step, added up from its micro-batches as detached tensors
    (no host sync): `mean` of the micro-batch losses, or their `sum` when each micro-batch loss
    is already a share of the step's loss (e.g. divided by the step's token count)."""

    def __init__(self) -> None:
        self._total: Any = None
        self._count = 0
        self._mode = "mean"

    def add(self, loss: Any, share: bool = False) -> None:
        value = loss.detach().float().reshape(()) if hasattr(loss, "detach") else float(loss)
        self._total = value if self._total is None else self._total + value
        self._count += 1
        self._mode = "sum" if share else "mean"

    @property
    def empty(self) -> bool:
        return self._count == 0

    def take(self) -> Any:
        """This step's loss (a 0-d tensor or float), and start the next step."""
        if self._count == 0:
            raise ValueError("no loss was recorded for this step")
        total = self._total if self._mode == "sum" else self._total / self._count
        self._total, self._count = None, 0
        return total

    def reset(self) -> None:
        self._total, self._count = None, 0


class StepAsMetric:
    """A W&B run shared with a framework's logger, seen through nummon's eyes: `log(data,
    step=s)` becomes `log({**data, "nummon/step": s})` with `nummon/*` charted against
    `nummon/step`.

    Lightning's `WandbLogger` and the HF `WandbCallback` log without `step=`, so W&B's own step
    counter runs ahead of the optimizer step whenever they log twice in one step (train and
    validation metrics); W&B then drops every later row logged with a smaller `step=`.
    Everything else (alert, config, dir, ...) goes to the run unchanged.
    """

    STEP_KEY = "nummon/step"

    def __init__(self, run: Any) -> None:
        self._run = run
        self._defined: set[str] = set()

    def log(self, data: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is None:
            self._run.log(data, **kwargs)
            return
        # keys defined one by one: an exact definition wins over the framework's "*" glob
        new = [k for k in data if k not in self._defined]
        if new:
            if not self._defined:
                self._run.define_metric(self.STEP_KEY)
                self._defined.add(self.STEP_KEY)
            for key in new:
                self._run.define_metric(key, step_metric=self.STEP_KEY)
                self._defined.add(key)
        self._run.log({**data, self.STEP_KEY: step}, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)
