"""The Monitor's per-step pipeline: statistics -> health engine -> torch-side evidence (the cause
of a non-finite value, a re-run's verdict, recovery's actions) -> the engine's outcome -> the files
it calls for -> the sinks; and the run's history it leaves (alerts, incidents, flight record,
cause, verdicts)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.events import IncidentEvent, StepReport
from .._core.maths import clip_ratio
from .._core.types import Alert, Health, StepRecord
from .._engine.engine import HealthEngine
from .._engine.outcome import FlightRecordRef, StepEvidence, StepOutcome, rerun_due
from .._policy.policy import Policy
from .._report.live import LiveReport
from .._sinks.dispatch import SinkDispatcher
from .._stats import Pending, StatsCollector
from .recorder import FlightRecords

if TYPE_CHECKING:
    from .._forensics import NonfiniteReport
    from .._forensics.forward_state import ForwardState
    from .._forensics.verdict import Verdict
    from .recovery import Recovery

__all__ = ["StepPipeline"]


class StepPipeline:
    """Evaluates each step the Monitor hands it and keeps what the run raised.

    Given the Monitor's parts: its policy, statistics collector, sinks, flight records (the
    recorder and the run folder), recovery (None when off) and, under torch.distributed, its
    `rank`. `begin` / `end` bracket one `post_step` (its way to re-run the loss, for forensics).
    """

    def __init__(
        self,
        policy: Policy,
        stats: StatsCollector,
        sinks: SinkDispatcher,
        flight_records: FlightRecords,
        recovery: Recovery | None,
        *,
        rank: int | None,
    ) -> None:
        self.policy, self.stats, self.sinks = policy, stats, sinks
        self.flight_records, self.recorder = flight_records, flight_records.recorder
        self.recovery = recovery
        self.rank = rank  # None: a single process
        self.engine = HealthEngine(policy, context={"optimizer": stats.optimizer_kind()})
        # the HTML incident report (policy `report`, rank 0): written on a critical escalation and at close only
        report_on = policy.report.enabled and not rank
        self.report = LiveReport(flight_records.folder.path) if report_on else None
        self.alerts: list[Alert] = []  # every routed alert, oldest first
        self.incidents: list[IncidentEvent] = []  # every incident transition
        self.flight_record: Path | None = None
        self.cause: NonfiniteReport | None = None  # the first non-finite step's, when it could be explained
        self.verdicts: list[Verdict] = []  # every re-run's, oldest first
        self.stop = False  # a critical alert nobody handled
        self.sample_next = False  # the engine's directive: sample the mechanism probes at the next step
        self.calm = False  # the engine's word on the last step: the probes' cadence may thin out
        # forensics: the weights a failing step's re-run needs; installed at the first step given a
        # `recompute` (a loop without one pays nothing: no hooks, no per-step check; while it is
        # None a step without a `recompute` needs no `begin` / `end`)
        self.forward: ForwardState | None = None
        self._recompute: Callable[[], Any] | None = None  # this step's way to re-run its loss
        self._step_loss: Any = None  # this step's loss as passed (the verdict compares its re-run with it)

    # ------------------------------------------------------------------ one post_step
    def begin(self, recompute: Callable[[], Any] | None, loss: Any) -> None:
        """A `post_step` starts: its way to re-run the loss (None: no forensics) and its loss."""
        self._recompute, self._step_loss = recompute, loss
        if recompute is not None and self.forward is None:
            self.forward = self._forward_state()

    def end(self, report: StepReport | None) -> None:
        """The `post_step` ended with `report` (None: it raised)."""
        self._recompute = self._step_loss = None
        if self.forward is not None:
            self.forward.step_done()
            # the host generators are kept at each forward only while something is open
            self.forward.keep_host = report is not None and report.health is not Health.HEALTHY

    def evaluate(self, pending: Pending, clip_norm: float | None, next_step: int) -> StepReport:
        """One step: statistics -> health engine -> torch-side evidence (cause, verdict,
        recovery) -> the engine's outcome -> its files -> dispatch. `next_step`: the Monitor's."""
        stats = self.stats
        rec = stats.resolve(pending)
        if clip_norm is not None:
            rec = self._clipped(rec, clip_norm)
        found = stats.replicas.take() if stats.replicas is not None else ()
        got = self.engine.step(rec, replicas=found)  # the record is frozen from here on
        if got.look_closer:  # a value rose well out of its quiet band (or the run is young)
            stats.cadence.measure_next()
        detail = got.detail_on
        if detail or stats.cadence.incident_open:  # every module's output while an incident is open
            stats.watch_all_modules(detail)
        self.recorder.add(rec, got.health)
        outcome = self.engine.finish(got, self._gather(rec, got, next_step))
        if outcome.flight_record_due or outcome.report_due:
            outcome = self._write_files(outcome)
        self.sample_next, self.calm = outcome.sample_next, outcome.calm
        self.stop = self.stop or outcome.stop
        if outcome.flight_record is not None:
            self.flight_record = Path(outcome.flight_record)
        self._dispatch(rec, outcome)
        return StepReport(
            step=rec.step,
            health=outcome.health,
            alerts=outcome.alerts,
            should_stop=self.stop,
            record=rec,
            incidents=outcome.incidents,
        )

    def arm_mechanisms(self, next_step: int) -> None:
        """Sample the mechanism probes at `next_step` when it is due (sparser while the run is
        calm), when a detector must confirm what it saw, or while an incident is open."""
        probes = self.stats.mechanisms
        if probes is not None:
            m = self.policy.mechanisms  # (the cadence's own test first: no call on 9 steps in 10)
            probes.arm(self.sample_next or (next_step % m.every == 0 and m.due(next_step, self.calm)))

    def close(self, last_step: int) -> None:
        """The run ended at `last_step`: an incident whose run became healthy again ends."""
        for ev in self.engine.close(last_step):
            self.incidents.append(ev)
            self.sinks.incident(ev)

    def release(self) -> None:
        """Give back what recovery and forensics hooked (optimizer.step, the forward's weights)."""
        if self.recovery is not None:
            self.recovery.close()
        if self.forward is not None:
            self.forward.close()

    def write_final_report(self) -> Path | None:
        """The whole run's report (from the event log when the run folder has one), when the run
        has a folder of its own or had an incident (no folder is made for a healthy run)."""
        if self.report is None or not self.recorder.records:
            return None
        if self.flight_records.folder.known is None and not self.incidents:
            return None
        report = self.report
        return report.from_folder(lambda: report.from_memory(self.recorder.records, self.alerts, self.incidents))

    # ------------------------------------------------------------------ the stages
    @staticmethod
    def _clipped(rec: StepRecord, clip_norm: float) -> StepRecord:
        """The record with the clip ratio the loop's `clip_norm` implies, when it has none."""
        if rec.clip_ratio is None and not rec.frozen:
            ratio = clip_ratio(rec.grad_norm, clip_norm)
            if ratio is not None:
                rec = dataclasses.replace(rec, clip_ratio=ratio)
        return rec

    def _gather(self, rec: StepRecord, got: StepOutcome, next_step: int) -> StepEvidence:
        """What only torch can tell or do about this step: the cause of its first non-finite
        value, a re-run's verdict, recovery's actions."""
        cause = verdict = unavailable = recovery = None
        forensics = self._recompute is not None and self.policy.forensics.enabled
        if forensics and not rec.is_finite() and self.cause is None:
            cause = self.cause = self._cause()
        if self._recompute is not None and self.forward is not None and rerun_due(got.alerts):
            verdict, unavailable = self._verdict(rec, current=rec.step == next_step - 1)
        if self.recovery is not None:
            recovery = self.recovery.on_record(rec, got.health, got.alerts, verdict)
        return StepEvidence(
            rec,
            cause=cause,
            verdict=verdict,
            verdict_unavailable=unavailable,
            recovery=recovery,
            distributed=self.rank is not None,
            flight_record=str(self.flight_record) if self.flight_record is not None else None,
        )

    def _write_files(self, outcome: StepOutcome) -> StepOutcome:
        """Write the files the outcome says are due (the run's first flight record, the HTML
        report); the outcome then names them."""
        for due in outcome.flight_record_due:
            path = self.flight_records.write(due.alert)
            if path is not None:  # a failed write is tried again for the step's next critical alert
                records = self.recorder.records
                outcome = outcome.with_flight_record(
                    due, FlightRecordRef(str(path), [r["step"] for r in records], records[-8:])
                )
                break
        if outcome.report_due and self.report is not None:
            alerts, events = [*self.alerts, *outcome.alerts], [*self.incidents, *outcome.incidents]
            path = self.report.from_memory(self.recorder.records, alerts, events)
            if path is not None:
                outcome = outcome.with_report(str(path))
        return outcome

    def _dispatch(self, rec: StepRecord, outcome: StepOutcome) -> None:
        """Keep and send the step's record, alerts and incident events, in that order."""
        self.sinks.step(rec, outcome.health, outcome.incident_state)
        for a in outcome.alerts:
            self.alerts.append(a)
            self.sinks.alert(a)
        for ev in outcome.incidents:
            self.incidents.append(ev)
            self.sinks.incident(ev)
        if outcome.alerts and outcome.critical:
            # the alert that precedes a crash is in the event log before post_step returns; the
            # other sinks (W&B, webhooks) get it asynchronously, so they never stall training
            self.sinks.flush(timeout=self.policy.sinks.critical_timeout_s, durable_only=True)

    # ------------------------------------------------------------------ forensics
    def _forward_state(self) -> ForwardState | None:
        """The pre-update evidence a verdict needs (forensics on, a model and an optimizer)."""
        if not (self.policy.forensics.enabled and self.stats.model is not None and self.stats.optimizer is not None):
            return None
        from .._forensics.forward_state import ForwardState

        return ForwardState(self.stats.model, self.stats.optimizer, guarded=self.recovery is not None)

    def _cause(self) -> NonfiniteReport | None:
        """The cause of this step's first non-finite value, or None."""
        from .._forensics import explain_quietly

        assert self._recompute is not None  # post_step explains only a step that has a way to re-run
        weights = self.forward.forward_state() if self.forward is not None and self.forward.faithful else None
        with self.stats.hooks_paused(), weights or contextlib.nullcontext():  # the re-run is not a training forward
            return explain_quietly(self._recompute, self.stats.model)

    def _verdict(self, rec: StepRecord, current: bool) -> tuple[Verdict | None, str | None]:
        """A critical step re-run for its verdict: reproducible (data, optimisation) or not (a
        fault); (None, why) when it could not be re-run. `current`: the weights are still those
        of the step's forward (it was not lagged)."""
        from .._forensics.verdict import gather_verdict

        assert self._recompute is not None and self.forward is not None
        with self.stats.hooks_paused():  # the re-run is not a training forward
            v, why = gather_verdict(
                self._recompute, rec, self._step_loss, self.forward, self.rank or 0, current=current
            )
        if v is not None:
            self.verdicts.append(v)
        return v, why
