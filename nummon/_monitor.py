"""Monitor: the one object a training loop touches."""
from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import _shutdown
from ._dispatch import SinkDispatcher
from ._engine import HealthEngine
from ._errors import NummonError
from ._policy import PolicyLike, load_policy
from ._recorder import FlightRecorder, RunFolder
from ._sinks import ConsoleSink, JsonlSink, RunContext
from ._stats import Pending, StatsEngine
from ._types import Alert, Health, Severity, StepRecord, StepReport

__all__ = ["Monitor"]

log = logging.getLogger("nummon")


def _check_loss(loss: Any) -> Any:
    """A python number or a one-element tensor; anything else is rejected without side effects."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise NummonError(f"loss must be a scalar (0-d or one-element) tensor, got shape {tuple(loss.shape)}")
        if loss.dtype == torch.bool or loss.is_complex():
            raise NummonError(f"loss tensor must be numeric, got dtype {loss.dtype}")
        return loss
    if isinstance(loss, numbers.Complex) and not isinstance(loss, numbers.Real):  # numpy complex has __float__
        raise NummonError(f"loss must be a real number, got {type(loss).__name__} {loss!r:.40}")
    # python and numpy numbers (anything with __float__), but not bools or strings
    if isinstance(loss, (bool, str, bytes)) or not hasattr(loss, "__float__"):
        raise NummonError(f"loss must be a float or a 0-d tensor, got {type(loss).__name__} {loss!r:.40}")
    try:
        return float(loss)
    except (TypeError, ValueError) as e:  # e.g. a numpy array with several elements
        raise NummonError(f"loss must be a single number, got {type(loss).__name__} ({e})") from None


def _check_per_sample(losses: Any) -> Any:
    """None, or a non-empty real tensor / sequence of per-sample losses; else rejected here."""
    if losses is None:
        return None
    if not isinstance(losses, torch.Tensor):
        try:
            losses = torch.as_tensor(losses, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise NummonError(f"per_sample_loss must be a tensor or a sequence of numbers, got {type(losses).__name__} ({e})") from None
    if losses.numel() == 0 or losses.dtype == torch.bool or losses.is_complex() or not (losses.is_floating_point() or losses.dtype in (torch.int32, torch.int64)):
        raise NummonError(f"per_sample_loss must be a non-empty real tensor, got dtype {losses.dtype} shape {tuple(losses.shape)}")
    return losses


class Monitor:
    """Watches a training run's numerical health, one `post_step` per optimizer step.

    >>> mon = Monitor(model, optimizer=opt, policy="default", sinks=[JsonlSink("runs/x/events.jsonl")])
    >>> report = mon.post_step(loss)        # after optimizer.step()
    >>> if report.should_stop: ...

    With AMP, pass `grad_scaler=scaler` (and call `post_step` after `scaler.step` / `update`):
    a step the scaler skipped for overflowing gradients is an info alert, not a critical one.

    On CUDA (policy.sampling.lag_one_step) the statistics of step t are read at step t+1 with a
    non-blocking copy, so the GPU never waits; alerts keep their true step; the first report is
    `pending` (no health yet); `flush()` forces. Files (flight records) go to `run_dir`, else the
    first `JsonlSink`'s folder, else `nummon-runs/<timestamp>/`.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        policy: PolicyLike = "default",
        sinks: Iterable[Any] = (),
        *,
        process_group: Any = None,
        grad_scaler: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
        start_step: int = 0,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise NummonError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise NummonError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.policy = load_policy(policy)
        sp = self.policy.sinks
        sink_list = list(sinks)
        if sp.jsonl:
            sink_list.append(JsonlSink(sp.jsonl))
        if sp.console:
            sink_list.append(ConsoleSink())
        self._dist = None
        if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            from ._distributed import DistributedReducer

            self._dist = DistributedReducer(process_group)
        self.rank = self._dist.rank if self._dist else 0
        self.stats = StatsEngine(model, optimizer, self.policy, dist=self._dist, grad_scaler=grad_scaler)
        self.engine = HealthEngine(self.policy, context={"optimizer": self.stats.optimizer_kind()})
        self.recorder = FlightRecorder(self.policy.recorder.steps)
        # every rank resolves the same folder from the same arguments, before rank-0-only sinks are dropped
        self.run_folder = RunFolder(self.policy.recorder.directory, run_dir, sink_list)
        if self._dist is not None and sp.rank0_only and self.rank != 0:
            sink_list = []  # sinks run on rank 0 only (the decisions are identical everywhere)
        self._sinks = SinkDispatcher(sink_list, sp.queue_size,
                                     block_timeout_s=sp.block_timeout_s if sp.when_full == "block" else None)
        world = self._dist.world if self._dist else 1
        self._sinks.bind(RunContext(rank=self.rank, world_size=world, run_dir=self.run_folder.known,
                                    flush_every_steps=sp.flush_every_steps))
        self.alerts: list[Alert] = []
        self.incidents: list[Any] = []  # IncidentEvents: one per opened / escalated / resolved incident
        self.step = start_step  # the step the next post_step is for
        self.flight_record: Path | None = None
        self._pending: Pending | None = None
        self._recompute: Callable[[], Any] | None = None  # this step's way to re-run its loss (forensics)
        self.cause: Any = None  # the NonfiniteReport of the first non-finite step, when it could be explained
        self._lock = threading.RLock()  # post_step from several threads: one step number each
        self._closed = False
        self._stop = False
        # histogram cadences: the policy's, and any sink's own (e.g. TensorBoardSink(histogram_every=50));
        # when neither sets one, the default of the sinks that draw them (cost bounded: nummon/_layout.py)
        cadences = [self.policy.sampling.histogram_every] + [getattr(s, "histogram_every", None) or 0 for s in sink_list]
        if not any(cadences):
            cadences = [getattr(s, "default_histogram_every", 0) or 0 for s in sink_list]
        self._hist_every = sorted({c for c in cadences if c > 0}) if self._sinks.wants_histograms else []
        if self._hist_every:
            self.stats.want_activation_histograms(self._hist_due(self.step))
        # recovery (issue 17, opt-in): guard on optimizer.step, snapshots, rollbacks; logic in _recovery/
        self.recovery = None
        if self.policy.recovery.enabled:
            from ._recovery import Recovery

            self.recovery = Recovery(self)
        self._arm_mechanisms()
        _shutdown.register(self, sp.handle_sigterm)

    # ------------------------------------------------------------------ public
    def post_step(self, loss: Any, batch: Any = None, *, recompute: Callable[[], Any] | None = None,
                  per_sample_loss: Any = None) -> StepReport:
        """Record one optimizer step (call after `optimizer.step()`); returns this step's report.

        `loss` is a python float or a one-element tensor on any device. `batch` (optional: a
        tensor, tuple/list/dict of tensors) is checked for non-finite inputs and fingerprinted.
        `recompute` (optional: a function returning this batch's loss, e.g.
        `lambda: loss_fn(model(x), y)`) is called only on a non-finite step, to name the
        operator, line and cause of the first NaN (policy `forensics`); the explanation is exact
        when the weights are still those of the failing forward: `post_step` called before
        `optimizer.step()`, or recovery skipped the poisoned update.
        `per_sample_loss` (optional: a tensor of this batch's losses per sample, any shape) puts
        the max/mean ratio and the indices of the worst samples into the record, and so into
        alerts, incidents and the flight record ("the batch that did it").
        """
        loss = _check_loss(loss)
        per_sample_loss = _check_per_sample(per_sample_loss)
        if recompute is not None and not callable(recompute):
            raise NummonError(f"recompute must be a function returning the loss, got {type(recompute).__name__}")
        with self._lock:
            if self._closed:
                raise NummonError("post_step on a closed Monitor")
            self._recompute = recompute
            try:
                return self._post_step(loss, batch, per_sample_loss)
            finally:
                self._recompute = None

    def _post_step(self, loss: Any, batch: Any, per_sample_loss: Any = None) -> StepReport:
        s = self.step
        sp = self.policy.sampling
        if per_sample_loss is not None and self.stats.mechanisms is not None:
            self.stats.mechanisms.per_sample(per_sample_loss)
        pending = self.stats.launch(
            s, loss, batch, params_due=s % sp.params_every == 0, optim_due=s % sp.optimizer_every == 0
        )
        hist = None
        if self._hist_every and self._hist_due(s):
            hist = self.stats.histograms()
        self.step += 1
        if self._hist_every:
            self.stats.want_activation_histograms(self._hist_due(self.step))
        if hist:
            self._sinks.histograms(s, hist)
        # lag only when the copy is asynchronous (CUDA); decided per step, so a model moved to
        # the GPU after the Monitor was made is handled too
        if self.policy.sampling.lag_one_step and pending.event is not None:
            previous, self._pending = self._pending, pending
            if previous is None:  # nothing measured yet: say so rather than guess "healthy"
                self._arm_mechanisms()
                return StepReport(step=s, health=None, should_stop=self._stop, pending=True)
            report = self._evaluate(previous)
        else:
            report = self._evaluate(pending)
        self._arm_mechanisms()
        return report

    def _arm_mechanisms(self) -> None:
        """Sample the mechanism probes at the next step when it is due, or while an incident is open."""
        probes = self.stats.mechanisms
        if probes is None:
            return
        mp = self.policy.mechanisms
        probes.arm(self.step % mp.every == 0 or self.engine.wants_sample()
                   or (mp.during_incident and self.engine.incidents.state.active))

    def flush(self) -> StepReport | None:
        """Evaluate a step still in flight (lagged mode) and wait (bounded) for the sinks to write."""
        with self._lock:
            report = None
            if self._pending is not None:
                pending, self._pending = self._pending, None
                report = self._evaluate(pending)
            self._sinks.flush(timeout=self.policy.sinks.flush_timeout_s)
            return report

    def close(self) -> None:
        """Evaluate what is in flight, then flush and close every sink (within
        `sinks.close_timeout_s`) and remove the hooks. Called at exit and on SIGTERM too."""
        with self._lock:
            if self._closed:
                return
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._evaluate(pending)
            self._closed = True
            self.stats.remove_hooks()
            if self.recovery is not None:  # recovery: give optimizer.step back
                self.recovery.close()
            self._sinks.close(timeout=self.policy.sinks.close_timeout_s)
            _shutdown.unregister(self)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def should_stop(self) -> bool:
        return self._stop

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """What recovery did (skips, rollbacks, budget spent), oldest first; empty when it is off."""
        return list(self.recovery.log) if self.recovery is not None else []

    @property
    def sink_stats(self) -> dict[str, dict[str, int]]:
        """Errors and dropped step records per sink (two sinks of one class: `Name`, `Name#2`)."""
        return self._sinks.stats()

    # ------------------------------------------------------------------ internals
    def _hist_due(self, step: int) -> bool:
        return any(step % k == 0 for k in self._hist_every)

    def _evaluate(self, pending: Pending) -> StepReport:
        rec = self.stats.resolve(pending)
        got = self.engine.step(rec)
        self.recorder.add(rec, got.health)
        alerts = list(got.alerts)
        if not rec.is_finite() and self.cause is None and self._recompute is not None and self.policy.forensics.enabled:
            alerts = self._explain(alerts)
        recovered = False  # recovery: True when this step's critical alerts were handled (skip/rollback)
        if self.recovery is not None:
            alerts, recovered = self.recovery.on_record(rec, got.health, alerts)
        routed = []
        critical = False
        for a in alerts:
            if a.severity is Severity.CRITICAL:
                critical = True
                if self.flight_record is None and self.policy.recorder.write:
                    a = self._dump_flight_record(a)
                if self.policy.alerts.stop_on_critical and not recovered:
                    self._stop = True
            if self._dist is not None and a.rank is None and rec.rank is not None:
                a = dataclasses.replace(a, rank=rec.rank)
            if rec.fingerprint and not a.cleared:  # "failed again with identical inputs" is evidence
                a = dataclasses.replace(a, details={**a.details, "batch_fingerprint": rec.fingerprint})
            if rec.sample_loss_top and not a.cleared:  # the batch that did it: which samples, how far out
                a = dataclasses.replace(a, details={**a.details, "worst_samples": list(rec.sample_loss_top),
                                                    "sample_loss_max_over_mean": rec.sample_loss_ratio})
            routed.append(a)
            self.alerts.append(a)
            self._sinks.alert(a)
        events = list(got.incidents)
        for a in alerts:  # every recovery (rollback, budget spent) is an incident event of its own
            if (a.details or {}).get("recovery") in ("rollback", "gave_up"):
                events.append(self.engine.incidents.acted(a.step, a, a.message))
        if self.flight_record is not None:
            events = [ev.with_flight_record(ev.flight_record or str(self.flight_record)) if ev.state.active else ev
                      for ev in events]
        for ev in events:
            self.incidents.append(ev)
            self._sinks.incident(ev)
        self._sinks.step(rec, got.health)
        if critical:  # the alert that precedes a crash is on disk before post_step returns
            self._sinks.flush(timeout=self.policy.sinks.critical_timeout_s)
        return StepReport(step=rec.step, health=got.health, alerts=tuple(routed), should_stop=self._stop,
                          record=rec, incidents=tuple(events))

    def _explain(self, alerts: list[Alert]) -> list[Alert]:
        """The cause of this step's first non-finite value, put into its non-finite alerts."""
        from ._forensics import explain_into

        with self.stats.hooks_paused():  # the re-run is not a training forward
            self.cause, alerts = explain_into(self._recompute, alerts)
        return alerts

    def _dump_flight_record(self, alert: Alert) -> Alert:
        name = f"nummon-flight-record-step{alert.step}" + (f"-rank{self.rank}" if self._dist else "") + ".json"
        try:
            path = self.recorder.dump(self.run_folder.path() / name, alert)
        except OSError as e:
            log.warning("nummon: could not write the flight record: %s", e)
            return alert
        self.flight_record = path
        details = dict(alert.details)
        details["flight_record_steps"] = [r["step"] for r in self.recorder.records]
        details["recent"] = self.recent(8)  # plain dicts, so sinks can show the trajectory
        return dataclasses.replace(alert, flight_record=str(path), details=details)

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The flight recorder's last `n` step records (plain dicts)."""
        recs = self.recorder.records
        return recs if n is None else recs[-n:]
