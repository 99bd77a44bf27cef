"""Monitor: the one object a training loop touches."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._core.errors import NummonError
from .._core.events import IncidentEvent, StepReport
from .._core.maths import clip_ratio
from .._core.types import Alert, Health, StepRecord
from .._engine.engine import HealthEngine
from .._engine.outcome import FlightRecordRef, StepEvidence, StepOutcome, rerun_due
from .._policy.policy import PolicyLike, load_policy
from .._report.live import LiveReport
from .._stats import Pending, StatsCollector
from . import shutdown as _shutdown
from .checks import check_clip_norm, check_loss, check_parts, check_per_sample
from .recorder import FlightRecorder, FlightRecords, RunFolder
from .sink_wiring import histogram_cadences, policy_sinks, sink_dispatcher

__all__ = ["Monitor"]

log = logging.getLogger("nummon")


def _reducer(process_group: Any) -> Any:
    """The one-collective-per-step reducer under torch.distributed, else None."""
    if process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from .._stats.distributed import DistributedReducer

    return DistributedReducer(process_group)


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

    alerts: list[Alert]  # every routed alert, oldest first
    incidents: list[IncidentEvent]  # every incident transition (opened, escalated, resolved, acted on)
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
        self.policy = load_policy(policy)
        sink_list = policy_sinks(self.policy, sinks)
        self._dist = _reducer(process_group)
        self.rank = self._dist.rank if self._dist else 0
        self.stats = StatsCollector(model, optimizer, self.policy, dist=self._dist, grad_scaler=grad_scaler)
        self._replicas = self._replica_check(model)
        self.engine = HealthEngine(self.policy, context={"optimizer": self.stats.optimizer_kind()})
        self.recorder = FlightRecorder(self.policy.recorder.steps)
        # every rank resolves the same folder from the same arguments, before rank-0-only sinks are dropped
        self.run_folder = RunFolder(self.policy.recorder.directory, run_dir, sink_list)
        self.flight_records = FlightRecords(
            self.recorder, self.run_folder, enabled=self.policy.recorder.write, rank=self.rank if self._dist else None
        )
        self._sinks = sink_dispatcher(self.policy, sink_list, self._dist, self.rank, self.run_folder.known)
        self._start_run_state(start_step)
        self._hist_every, self._hist_early = histogram_cadences(self.policy, sink_list, self._sinks.wants_histograms)
        if self._hist_every:
            self.stats.want_activation_histograms(self._hist_due(self.step))
        self.recovery = self._recovery()
        # forensics: the weights a failing step's re-run needs; installed at the first post_step given a
        # `recompute` (a loop without one pays nothing: no hooks, no per-step check)
        self._evidence: Any = None
        # the HTML incident report (policy `report`, rank 0): written on a critical escalation and at close only
        self._report = LiveReport(self.run_folder.path) if self.policy.report.enabled and self.rank == 0 else None
        self._arm_mechanisms()
        _shutdown.register(self, self.policy.sinks.handle_sigterm)

    def _start_run_state(self, start_step: int) -> None:
        self.alerts = []
        self.incidents = []  # one per opened / escalated / resolved incident
        self.step = start_step  # the step the next post_step is for
        self.flight_record: Path | None = None
        self._pending: tuple[Pending, float | None] | None = None  # lagged mode: (statistics, clip_norm)
        self._recompute: Callable[[], Any] | None = None  # this step's way to re-run its loss (forensics)
        self._step_loss: Any = None  # this step's loss as passed (the verdict compares its re-run with it)
        self.verdicts: list[Any] = []  # every re-run's Verdict (nummon/_forensics/verdict.py), oldest first
        self.cause: Any = None  # the NonfiniteReport of the first non-finite step, when it could be explained
        self._lock = threading.RLock()  # post_step from several threads: one step number each
        self._closed = False
        self._stop = False
        self._sample_next = False  # the engine's directive: sample the mechanism probes at the next step

    def _recovery(self) -> Any:
        """Recovery (opt-in, policy `recovery`): guard on optimizer.step, snapshots, rollbacks."""
        if not self.policy.recovery.enabled:
            return None
        from .recovery import Recovery

        return Recovery(
            self.stats.model,
            self.stats.optimizer,
            self.policy.recovery,
            self._dist,
            self.flight_records,
            step_of=lambda: self.step,
        )

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
        clip_norm = check_clip_norm(clip_norm)
        per_sample_loss = check_per_sample(per_sample_loss)
        if recompute is not None and not callable(recompute):
            raise NummonError(f"recompute must be a function returning the loss, got {type(recompute).__name__}")
        with _shutdown.safe_point(), self._lock:  # a SIGTERM within it is acted on after it
            if self._closed:
                raise NummonError("post_step on a closed Monitor")
            self._recompute, self._step_loss = recompute, loss
            if recompute is not None and self._evidence is None:
                self._evidence = self._step_evidence()
            report = None
            try:
                report = self._post_step(loss, batch, clip_norm, per_sample_loss)
                return report
            finally:
                self._recompute = self._step_loss = None
                if self._evidence is not None:
                    self._evidence.step_done()
                    # the host generators are kept at each forward only while something is open
                    self._evidence.keep_host = report is not None and report.health is not Health.HEALTHY

    def _post_step(self, loss: Any, batch: Any, clip_norm: float | None, per_sample_loss: Any = None) -> StepReport:
        s = self.step
        sp = self.policy.sampling
        if per_sample_loss is not None and self.stats.mechanisms is not None:
            self.stats.mechanisms.per_sample(per_sample_loss)
        pending = self.stats.launch(
            s, loss, batch, params_due=sp.params_due(s), optim_due=sp.optimizer_due(s), clip_norm=clip_norm
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
            previous, self._pending = self._pending, (pending, clip_norm)
            if previous is None:  # nothing measured yet: say so rather than guess "healthy"
                self._arm_mechanisms()
                return StepReport(step=s, health=None, should_stop=self._stop, pending=True)
            report = self._evaluate(*previous)
        else:
            report = self._evaluate(pending, clip_norm)
            if report.incidents and hist is None and self._hist_every:
                # the moment of trouble: histograms of this step's parameters and gradients too
                self._sinks.histograms(s, self.stats.histograms())
        self._arm_mechanisms()
        return report

    def _arm_mechanisms(self) -> None:
        """Sample the mechanism probes at the next step when it is due, when a detector must
        confirm what it saw, or while an incident is open."""
        probes = self.stats.mechanisms
        if probes is None:
            return
        mp = self.policy.mechanisms
        probes.arm(self.step % mp.every == 0 or self._sample_next)

    def flush(self) -> StepReport | None:
        """Evaluate a step still in flight (lagged mode) and wait (bounded) for the sinks to write."""
        with _shutdown.safe_point(), self._lock:
            report = None
            if self._pending is not None:
                pending, self._pending = self._pending, None
                report = self._evaluate(*pending)
            self._sinks.flush(timeout=self.policy.sinks.flush_timeout_s)
            return report

    def close(self) -> None:
        """Evaluate what is in flight, then flush and close every sink (within
        `sinks.close_timeout_s`) and remove the hooks. Called at exit and on SIGTERM too."""
        with _shutdown.safe_point(), self._lock:
            if self._closed:
                return
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._evaluate(*pending)
            for ev in self.engine.close(self.step - 1):  # an incident whose run became healthy again ends
                self.incidents.append(ev)
                self._sinks.incident(ev)
            self._closed = True
            self.stats.remove_hooks()
            if self.recovery is not None:  # recovery: give optimizer.step back
                self.recovery.close()
            if self._evidence is not None:
                self._evidence.close()
            self._sinks.close(timeout=self.policy.sinks.close_timeout_s)
            self._write_report_at_close()
            _shutdown.unregister(self)

    def _write_report_at_close(self) -> None:
        """The whole run's report (from the event log when the run folder has one), when the run
        has a folder of its own or had an incident (no folder is made for a healthy run)."""
        if self._report is None or not self.recorder.records:
            return
        if self.run_folder.known is None and not self.incidents:
            return
        report = self._report
        path = report.from_folder(lambda: report.from_memory(self.recorder.records, self.alerts, self.incidents))
        if path is not None:
            log.info("nummon: incident report: %s", path)

    @property
    def report_path(self) -> Path | None:
        """The HTML incident report written into the run folder (None until one is)."""
        return self._report.path if self._report is not None else None

    def __enter__(self) -> Monitor:
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
    #: With the default cadence, histograms at these early steps too: a short run and its start are visible
    EARLY_HISTOGRAM_STEPS = frozenset({0, 1, 2, 5, 10, 20, 50, 100, 200, 500})

    def _hist_due(self, step: int) -> bool:
        if getattr(self, "_hist_early", False) and step in self.EARLY_HISTOGRAM_STEPS:
            return True
        return any(step % k == 0 for k in self._hist_every)

    def _evaluate(self, pending: Pending, clip_norm: float | None = None) -> StepReport:
        """The pipeline of one step: statistics -> health engine -> torch-side evidence (cause,
        verdict, recovery) -> the engine's outcome -> dispatch."""
        rec = self._resolve(pending, clip_norm)
        found = self._replicas.take() if self._replicas is not None else ()
        got = self.engine.step(rec, replicas=found)  # the record is frozen from here on
        self.stats.watch_all_modules(got.detail_on)  # every module's output while an incident is open
        self.recorder.add(rec, got.health)
        outcome = self._write_files(self.engine.finish(got, self._gather(rec, got)))
        self._sample_next = outcome.sample_next
        self._stop = self._stop or outcome.stop
        if outcome.flight_record is not None:
            self.flight_record = Path(outcome.flight_record)
        self._dispatch(rec, outcome)
        return StepReport(
            step=rec.step,
            health=outcome.health,
            alerts=outcome.alerts,
            should_stop=self._stop,
            record=rec,
            incidents=outcome.incidents,
        )

    def _gather(self, rec: StepRecord, got: StepOutcome) -> StepEvidence:
        """What only torch can tell or do about this step: the cause of its first non-finite
        value, a re-run's verdict, recovery's actions."""
        cause = verdict = unavailable = recovery = None
        forensics = self._recompute is not None and self.policy.forensics.enabled
        if forensics and not rec.is_finite() and self.cause is None:
            cause = self.cause = self._cause()
        if self._recompute is not None and self._evidence is not None and rerun_due(got.alerts):
            verdict, unavailable = self._verdict(rec)
        if self.recovery is not None:
            recovery = self.recovery.on_record(rec, got.health, got.alerts, verdict)
        return StepEvidence(
            rec,
            cause=cause,
            verdict=verdict,
            verdict_unavailable=unavailable,
            recovery=recovery,
            distributed=self._dist is not None,
            flight_record=str(self.flight_record) if self.flight_record is not None else None,
        )

    def _dispatch(self, rec: StepRecord, outcome: StepOutcome) -> None:
        """Keep and send the step's record, alerts and incident events, in that order."""
        self._sinks.step(rec, outcome.health, outcome.incident_state)
        for a in outcome.alerts:
            self.alerts.append(a)
            self._sinks.alert(a)
        for ev in outcome.incidents:
            self.incidents.append(ev)
            self._sinks.incident(ev)
        if outcome.critical:
            # the alert that precedes a crash is in the event log before post_step returns; the
            # other sinks (W&B, webhooks) get it asynchronously, so they never stall training
            self._sinks.flush(timeout=self.policy.sinks.critical_timeout_s, durable_only=True)

    def _resolve(self, pending: Pending, clip_norm: float | None) -> StepRecord:
        rec = self.stats.resolve(pending)
        if clip_norm is not None and rec.clip_ratio is None and not rec.frozen:
            ratio = clip_ratio(rec.grad_norm, clip_norm)
            if ratio is not None:
                rec = dataclasses.replace(rec, clip_ratio=ratio)
        return rec

    def _cause(self) -> Any:
        """The cause of this step's first non-finite value (a NonfiniteReport), or None."""
        from .._forensics import explain_quietly

        assert self._recompute is not None  # post_step explains only a step that has a way to re-run
        weights = self._evidence.forward_state() if self._evidence is not None and self._evidence.faithful else None
        with self.stats.hooks_paused(), weights or contextlib.nullcontext():  # the re-run is not a training forward
            return explain_quietly(self._recompute, self.stats.model)

    def _replica_check(self, model: Any) -> Any:
        """Replica checks (policy `replicas`) under data parallelism: on for DDP models unless set."""
        rp = self.policy.replicas
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self._dist is None or not (rp.enabled if rp.enabled is not None else ddp):
            return None
        from .._forensics.replicas import ReplicaCheck

        self.stats.replicas = ReplicaCheck(rp.every, self.stats.watched)
        return self.stats.replicas

    def _step_evidence(self) -> Any:
        """The pre-update evidence a verdict needs (forensics on, a model and an optimizer)."""
        if not (self.policy.forensics.enabled and self.stats.model is not None and self.stats.optimizer is not None):
            return None
        from .._forensics.verdict import ForwardState

        return ForwardState(self.stats.model, self.stats.optimizer, guarded=self.recovery is not None)

    def _verdict(self, rec: StepRecord) -> tuple[Any, str | None]:
        """A critical step re-run for its verdict: reproducible (data, optimisation) or not (a
        fault); (None, why) when it could not be re-run."""
        from .._forensics.verdict import gather_verdict

        assert self._recompute is not None and self._evidence is not None
        with self.stats.hooks_paused():  # the re-run is not a training forward
            v, why = gather_verdict(
                self._recompute, rec, self._step_loss, self._evidence, self.rank, current=rec.step == self.step - 1
            )
        if v is not None:
            self.verdicts.append(v)
        return v, why

    def _write_files(self, outcome: StepOutcome) -> StepOutcome:
        """Write the files the outcome says are due (the run's first flight record, the HTML
        report); the outcome then names them."""
        for due in outcome.flight_record_due:
            path = self.flight_records.write(due.alert)
            if path is not None:  # a failed write is tried again for the step's next critical alert
                ref = FlightRecordRef(str(path), [r["step"] for r in self.recorder.records], self.recent(8))
                outcome = outcome.with_flight_record(due, ref)
                break
        if outcome.report_due and self._report is not None:
            alerts, events = [*self.alerts, *outcome.alerts], [*self.incidents, *outcome.incidents]
            report = self._report.from_memory(self.recorder.records, alerts, events)
            if report is not None:
                outcome = outcome.with_report(str(report))
        return outcome

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The flight recorder's last `n` step records (plain dicts)."""
        recs = self.recorder.records
        return recs if n is None else recs[-n:]
