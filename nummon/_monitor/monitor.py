"""Monitor: the one object a training loop touches (its setup, `post_step` and close; each step's
evaluation is the `StepPipeline`'s)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._core.errors import NummonError
from .._core.events import IncidentEvent, StepReport
from .._core.types import Alert
from .._policy.policy import Policy, PolicyLike, load_policy
from .._stats import Pending, StatsCollector
from . import shutdown as _shutdown
from .checks import check_clip_norm, check_loss, check_parts, check_per_sample
from .pipeline import StepPipeline
from .recorder import FlightRecorder, FlightRecords, RunFolder
from .sink_wiring import histogram_steps, policy_sinks, sink_dispatcher

if TYPE_CHECKING:
    from .._forensics import NonfiniteReport
    from .recovery import Recovery

__all__ = ["Monitor"]

log = logging.getLogger("nummon")


def _reducer(process_group: Any) -> Any:
    """The one-collective-per-step reducer under torch.distributed, else None."""
    if process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from .._stats.distributed import DistributedReducer

    return DistributedReducer(process_group)


def _replica_check(stats: StatsCollector, policy: Policy, dist: Any, model: Any) -> None:
    """Replica checks (policy `replicas`) under data parallelism: on for DDP models unless set."""
    rp = policy.replicas
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if dist is None or not (rp.enabled if rp.enabled is not None else ddp):
        return
    from .._forensics.replicas import ReplicaCheck

    stats.replicas = ReplicaCheck(rp.every, stats.watched)


def _recovery(
    stats: StatsCollector, policy: Policy, dist: Any, flight_records: FlightRecords, step_of: Callable[[], int]
) -> Recovery | None:
    """Recovery (opt-in, policy `recovery`): guard on optimizer.step, snapshots, rollbacks."""
    if not policy.recovery.enabled:
        return None
    from .recovery import Recovery

    return Recovery(stats.model, stats.optimizer, policy.recovery, dist, flight_records, step_of=step_of)


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

    What a loop reads off it (everything else is internal):

    - `step`: the step the next `post_step` is for;
    - `alerts`, `incidents`: every alert and incident event so far, oldest first;
    - `should_stop`: a critical alert nobody handled (under `alerts.stop_on_critical`);
    - `flight_record`: the path of the run's flight record (None until one is written);
    - `report_path`: the HTML incident report (None until one is written);
    - `cause`: why the first non-finite step went non-finite (a `NonfiniteReport`, given `recompute`);
    - `recoveries`, `skipped_batches`: what recovery did, and the fingerprints of the batches whose
      update it skipped;
    - `sink_stats`: errors and dropped step records per sink;
    - `recent(n)`: the flight recorder's last step records;
    - `engine_state()` / `load_engine_state(state)`: the health engine's state, for a checkpoint.
    """

    step: int  # the step the next post_step is for

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
        check_parts(model, optimizer)
        self._policy = load_policy(policy)
        sink_list = policy_sinks(self._policy, sinks)
        self._dist = _reducer(process_group)
        rank = self._dist.rank if self._dist else None  # None: a single process
        self._stats = StatsCollector(
            model, optimizer, self._policy, dist=self._dist, grad_scaler=grad_scaler, start_step=start_step
        )
        _replica_check(self._stats, self._policy, self._dist, model)
        # every rank resolves the same folder from the same arguments, before rank-0-only sinks are dropped
        folder = RunFolder(self._policy.recorder.directory, run_dir, sink_list)
        self._recorder = FlightRecorder(self._policy.recorder.steps)
        flight_records = FlightRecords(self._recorder, folder, enabled=self._policy.recorder.write, rank=rank)
        self._sinks = sink_dispatcher(self._policy, sink_list, self._dist, rank or 0, folder.known)
        self.step = start_step
        self._pending: tuple[Pending, float | None] | None = None  # lagged mode: (statistics, clip_norm)
        self._lock = threading.RLock()  # post_step from several threads: one step number each
        self._closed = False
        self._hist = histogram_steps(self._policy, sink_list, self._sinks.wants_histograms)
        if self._hist.every:
            self._stats.want_activation_histograms(self._hist.due(self.step))
        recovery = _recovery(self._stats, self._policy, self._dist, flight_records, step_of=lambda: self.step)
        self._steps = StepPipeline(self._policy, self._stats, self._sinks, flight_records, recovery, rank=rank)
        self._steps.arm_mechanisms(self.step)
        _shutdown.register(self, self._policy.sinks.handle_sigterm)

    # ------------------------------------------------------------------ public
    def post_step(
        self,
        loss: Any,
        batch: Any = None,
        *,
        recompute: Callable[[], Any] | None = None,
        clip_norm: float | None = None,
        per_sample_loss: Any = None,
    ) -> StepReport:
        """Record one optimizer step (call after `optimizer.step()`); returns this step's report.

        `loss` is a python float or a one-element tensor on any device. `batch` (optional: a
        tensor, tuple/list/dict of tensors) is checked for non-finite inputs and fingerprinted.
        `recompute` (optional: a function returning this batch's loss, e.g.
        `lambda: loss_fn(model(x), y)`; with gradient accumulation a `MicroBatches` of every
        micro-batch's) is called only on a non-finite or critical step, to name the
        operator, line and cause of the first NaN (policy `forensics`); the explanation is exact
        when the weights are still those of the failing forward: `post_step` called before
        `optimizer.step()`, or recovery skipped the poisoned update. `clip_norm` (optional: the
        max total gradient norm the loop clips to, e.g. Lightning's `gradient_clip_val`) gives
        the record its `clip_ratio`, min(1, clip_norm / grad_norm), when nummon did not see the
        clipping itself, and Adam's statistics the clipped gradient the optimizer will apply. `per_sample_loss` (optional: a tensor of this batch's losses per sample,
        any shape) puts the max/mean ratio and the indices of the worst samples into the record,
        and so into alerts, incidents and the flight record ("the batch that did it").
        """
        loss = check_loss(loss)
        if clip_norm is not None:
            clip_norm = check_clip_norm(clip_norm)
        if per_sample_loss is not None:
            per_sample_loss = check_per_sample(per_sample_loss)
        if recompute is not None and not callable(recompute):
            raise NummonError(f"recompute must be a function returning the loss, got {type(recompute).__name__}")
        with _shutdown.SAFE_POINT, self._lock:  # a SIGTERM within it is acted on after it
            if self._closed:
                raise NummonError("post_step on a closed Monitor")
            if recompute is None and self._steps.forward is None:  # no forensics: nothing to bracket
                return self._post_step(loss, batch, clip_norm, per_sample_loss)
            self._steps.begin(recompute, loss)
            report = None
            try:
                report = self._post_step(loss, batch, clip_norm, per_sample_loss)
                return report
            finally:
                self._steps.end(report)

    def _post_step(self, loss: Any, batch: Any, clip_norm: float | None, per_sample_loss: Any = None) -> StepReport:
        s = self.step
        sp = self._policy.sampling
        if per_sample_loss is not None and self._stats.mechanisms is not None:
            self._stats.mechanisms.per_sample(per_sample_loss)
        pending = self._stats.launch(
            s, loss, batch, params_due=sp.params_due(s), optim_due=sp.optimizer_due(s), clip_norm=clip_norm
        )
        hist = None
        if self._hist.every and self._hist.due(s):
            hist = self._stats.histograms()
        self.step += 1
        if self._hist.every:
            self._stats.want_activation_histograms(self._hist.due(self.step))
        if hist:
            self._sinks.histograms(s, hist)
        # lag only when the copy is asynchronous (CUDA); decided per step, so a model moved to
        # the GPU after the Monitor was made is handled too
        if sp.lag_one_step and pending.event is not None:
            previous, self._pending = self._pending, (pending, clip_norm)
            if previous is None:  # nothing measured yet: say so rather than guess "healthy"
                self._steps.arm_mechanisms(self.step)
                return StepReport(step=s, health=None, should_stop=self._steps.stop, pending=True)
            report = self._evaluate(*previous)
        else:
            report = self._steps.evaluate(pending, clip_norm, next_step=self.step)
            if report.incidents and hist is None and self._hist.every:
                # the moment of trouble: histograms of this step's parameters and gradients too
                self._sinks.histograms(s, self._stats.histograms())
        self._steps.arm_mechanisms(self.step)
        return report

    def _evaluate(self, pending: Pending, clip_norm: float | None = None) -> StepReport:
        return self._steps.evaluate(pending, clip_norm, next_step=self.step)

    def flush(self) -> StepReport | None:
        """Evaluate a step still in flight (lagged mode) and wait (bounded) for the sinks to write."""
        with _shutdown.SAFE_POINT, self._lock:
            report = None
            if self._pending is not None:
                pending, self._pending = self._pending, None
                report = self._evaluate(*pending)
            self._sinks.flush(timeout=self._policy.sinks.flush_timeout_s)
            return report

    def close(self) -> None:
        """Evaluate what is in flight, then flush and close every sink (within
        `sinks.close_timeout_s`) and remove the hooks. Called at exit and on SIGTERM too."""
        with _shutdown.SAFE_POINT, self._lock:
            if self._closed:
                return
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._evaluate(*pending)
            self._steps.close(self.step - 1)  # an incident whose run became healthy again ends
            self._closed = True
            self._stats.remove_hooks()
            self._steps.release()  # recovery gives optimizer.step back
            self._sinks.close(timeout=self._policy.sinks.close_timeout_s)
            path = self._steps.write_final_report()
            if path is not None:
                log.info("nummon: incident report: %s", path)
            _shutdown.unregister(self)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def alerts(self) -> list[Alert]:
        """Every routed alert, oldest first."""
        return self._steps.alerts

    @property
    def incidents(self) -> list[IncidentEvent]:
        """Every incident transition (opened, escalated, resolved, acted on), oldest first."""
        return self._steps.incidents

    @property
    def should_stop(self) -> bool:
        """A critical alert nobody handled (skip, rollback), under `alerts.stop_on_critical`."""
        return self._steps.stop

    @property
    def flight_record(self) -> Path | None:
        """The run's flight record (its first critical alert's), None until one is written."""
        return self._steps.flight_record

    @property
    def report_path(self) -> Path | None:
        """The HTML incident report written into the run folder (None until one is)."""
        return self._steps.report.path if self._steps.report is not None else None

    @property
    def cause(self) -> NonfiniteReport | None:
        """Why the run's first non-finite step went non-finite (operator, line, cause, remedy):
        given `post_step(recompute=...)` and when it could be explained, else None."""
        return self._steps.cause

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """What recovery did (skips, rollbacks, budget spent), oldest first; empty when it is off."""
        return list(self._steps.recovery.log) if self._steps.recovery is not None else []

    @property
    def skipped_batches(self) -> list[str]:
        """The fingerprints of the batches whose update recovery skipped (given `batch=`), oldest first."""
        return list(self._steps.recovery.skipped_batches) if self._steps.recovery is not None else []

    @property
    def sink_stats(self) -> dict[str, dict[str, int]]:
        """Errors and dropped step records per sink (two sinks of one class: `Name`, `Name#2`)."""
        return self._sinks.stats()

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The flight recorder's last `n` step records (plain dicts)."""
        recs = self._recorder.records
        return recs if n is None else recs[-n:]

    def engine_state(self) -> dict[str, Any]:
        """The health engine's state (the incident, the records that re-warm its detectors) as
        plain strict-JSON data, for a checkpoint: a resumed run does not start cold."""
        return self._steps.engine.state_dict()

    def load_engine_state(self, state: dict[str, Any], origin: str = "engine state") -> None:
        """Resume the health engine from `engine_state()`; StateError (nothing changed) when
        `state` is not one (`origin` names it in the message)."""
        self._steps.engine.load_state_dict(state, origin=origin)
