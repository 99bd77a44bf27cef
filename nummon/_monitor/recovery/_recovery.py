"""Recovery for one Monitor: reports skips, keeps snapshots, decides and performs rollbacks.

Every decision is made from the records the Monitor evaluates, which are identical on every rank
under torch.distributed (the guard's norm is maxed over ranks too), so every rank skips the same
updates, snapshots at the same steps and restores the same one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._core.errors import NummonError
from ..._core.types import Alert, AlertKind, Health, Severity, StepRecord
from ..._engine.outcome import RecoveryAction, RecoveryReport, recovery_alert, rollback_message
from ..._policy.runtime import RecoveryPolicy
from ..recorder import FlightRecords
from ._guard import GradientGuard, SkipDecision
from ._snapshot import Snapshot

__all__ = ["Recovery", "RecoveryReport"]

log = logging.getLogger("nummon")

# non-finite values only here mean the forward/backward of a skipped step went bad, not the weights
_SKIP_COVERS = {"loss", "gradients", "activations", "input"}


def _lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def _set_lr(group: dict, value: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)  # a tensor lr (capturable / compiled optimizers) stays a tensor
    else:
        group["lr"] = value


class Recovery:
    """Opt-in self-repair of a run (policy section `recovery`), given the model, the optimizer,
    the distributed reducer (or None), where flight records go, and `step_of()`: the step the
    next optimizer update belongs to (the Monitor's next post_step).

    `log` holds one dict per action (skip, rollback, budget spent); `skipped_batches` the
    fingerprints of skipped updates' batches; `suspect_batches` those seen between a snapshot and
    the rollback to it (fingerprints exist when the loop passes `batch=` to post_step).
    """

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None,
        policy: RecoveryPolicy,
        dist: Any,
        flight_records: FlightRecords,
        *,
        step_of: Callable[[], int],
    ) -> None:
        if model is None or optimizer is None:
            raise NummonError("policy.recovery.enabled needs Monitor(model, optimizer): it restores both")
        opt = optimizer
        self.policy = policy
        self.model, self.optimizer = model, opt
        self.flight_records = flight_records
        self._step_of = step_of
        start = step_of()
        self.guard = GradientGuard(opt, self.policy, step_of, dist=dist)
        self.log: list[dict[str, Any]] = []
        self.skipped_batches: list[str] = []
        self.suspect_batches: list[str] = []
        self.rollbacks = 0
        self._skip_steps: deque[int] = deque()
        self._skip_warned_at: int | None = None
        self._last_unhealthy = start - 1  # the last step with a warning or a non-healthy record
        self._since_snapshot: list[str] = []
        self._stale_through = start - 1  # records of steps launched before the last rollback
        self.snapshot = Snapshot.take(model, opt, start - 1)  # the start: always something to go back to
        self.snapshots_taken = 1
        self._transient: Any = None  # the Verdict of the record being decided (forensics)

    def close(self) -> None:
        self.guard.uninstall()

    # ------------------------------------------------------------------ per record
    def on_record(
        self, rec: StepRecord, health: Health, alerts: Sequence[Alert], verdict: Any = None
    ) -> RecoveryReport:
        """What recovery did about this record (given its alerts and the re-run's verdict, if
        any): the actions it took, whether the record's critical alerts were handled (the update
        was skipped, or the run rolled back) and whether the engine must re-baseline."""
        logged = len(self.log)
        self._transient = verdict
        if self.rollbacks and rec.step <= self._stale_through:
            # launched before the last rollback (lagged mode): evidence of the old run, not a trigger
            return RecoveryReport(handled=True, rebaseline=True)
        actions, covered, handled, rebaseline = self._decide(rec, health, alerts)
        return RecoveryReport(tuple(actions), handled, rebaseline, covered, tuple(self.log[logged:]))

    def _decide(
        self, rec: StepRecord, health: Health, alerts: Sequence[Alert]
    ) -> tuple[list[RecoveryAction], bool, bool, bool]:
        """(actions taken, covered, handled, rebaseline)."""
        actions: list[RecoveryAction] = []
        covered = False
        skip = self.guard.skips.pop(rec.step, None)
        trigger: tuple[AlertKind, str] | None = None
        if skip is not None:
            actions.append(self._report_skip(rec, skip))
            if self._transient is not None and not self._transient.reproducible:
                actions.extend(self._retry(rec))
            trigger = self._escalate(rec, skip, actions)
            # the weights never saw it
            covered = not rec.is_finite() and set(rec.nonfinite_parts) <= _SKIP_COVERS
        if trigger is None:
            trigger = self._trigger(rec, health, alerts, covered)
        if rec.fingerprint:
            self._since_snapshot.append(rec.fingerprint)
        if trigger is not None:
            act = self._rollback(rec, *trigger) if self.policy.rollback else None
            if act is not None:
                return [*actions, act], covered, True, True
            return [*actions, self._budget_spent(rec, *trigger)], covered, False, False
        warned = any(a.action == "skips_warning" for a in actions)
        if health is not Health.HEALTHY or warned or any(self._loud(a, covered) for a in alerts):
            self._last_unhealthy = rec.step
        self._maybe_snapshot(rec)
        return actions, covered, covered, False

    @staticmethod
    def _loud(a: Alert, covered: bool) -> bool:
        """A warning or worse that still stands (a covered non-finite alert is turned to info)."""
        if covered and a.kind is AlertKind.NONFINITE and a.severity is Severity.CRITICAL:
            return False
        return a.severity.rank >= Severity.WARNING.rank and not a.cleared

    def _trigger(
        self, rec: StepRecord, health: Health, alerts: Sequence[Alert], skipped: bool
    ) -> tuple[AlertKind, str] | None:
        if health is Health.NONFINITE and not skipped:
            where = rec.nonfinite_location or ", ".join(rec.nonfinite_parts) or "a statistic"
            return AlertKind.NONFINITE, f"non-finite values in {where}"
        for a in alerts:
            if a.severity is Severity.CRITICAL and not a.cleared and a.kind.value in self.policy.triggers:
                if a.kind is AlertKind.NONFINITE and skipped:
                    continue
                return a.kind, f"critical {a.kind.value} on {a.metric}"
        return None

    # ------------------------------------------------------------------ skips
    def _report_skip(self, rec: StepRecord, skip: SkipDecision) -> RecoveryAction:
        if rec.fingerprint:
            self.skipped_batches.append(rec.fingerprint)
        self._skip_steps.append(rec.step)
        entry = {
            "action": "skip",
            "step": rec.step,
            "grad_norm": skip.grad_norm,
            "reason": skip.reason,
            "batch_fingerprint": rec.fingerprint,
        }
        self.log.append(entry)
        kind = AlertKind.NONFINITE if skip.nonfinite else AlertKind.EXPLOSION
        facts = {
            "grad_norm": skip.grad_norm,
            "limit": skip.limit,
            "reason": skip.reason,
            "skips": len(self._skip_steps),
        }
        return RecoveryAction("skip", rec.step, kind, facts)

    def _retry(self, rec: StepRecord) -> list[RecoveryAction]:
        """A skipped update whose failure did not repeat (a transient fault): made again from the
        re-run's gradients (single process), so the batch is not lost and the LR stays."""
        v = self._transient
        if v is None or v.grads is None or not self.guard.retry(v.grads):
            return []
        self._skip_steps.pop()  # a transient fault is no sign the gradients keep going bad
        self.log.append({"action": "retry", "step": rec.step, "suspect": v.where(), "rerun_loss": v.rerun_loss})
        facts = {"rerun_loss": v.rerun_loss, "verdict": v.verdict, "suspect": v.where()}
        return [RecoveryAction("retry", rec.step, AlertKind.NONFINITE, facts)]

    def _escalate(self, rec: StepRecord, skip: SkipDecision, out: list[RecoveryAction]) -> tuple[AlertKind, str] | None:
        p = self.policy
        while self._skip_steps and self._skip_steps[0] <= rec.step - p.skip_window:
            self._skip_steps.popleft()
        n = len(self._skip_steps)
        kind = AlertKind.NONFINITE if skip.nonfinite else AlertKind.EXPLOSION
        if n > 2 * p.max_skips:
            return kind, f"{n} updates skipped in the last {p.skip_window} steps"
        if n > p.max_skips and (self._skip_warned_at is None or rec.step - self._skip_warned_at >= p.skip_window):
            self._skip_warned_at = rec.step
            facts = {"skips": n, "max_skips": p.max_skips, "window": p.skip_window}
            out.append(RecoveryAction("skips_warning", rec.step, kind, facts))
        return None

    # ------------------------------------------------------------------ snapshots and rollbacks
    def _maybe_snapshot(self, rec: StepRecord) -> None:
        every = self.policy.snapshot_every
        if rec.step % every or rec.step - self._last_unhealthy < every:
            return
        # the weights now hold every update up to the step before the Monitor's next one
        self.snapshot = Snapshot.take(self.model, self.optimizer, self._step_of() - 1)
        self.snapshots_taken += 1
        self._since_snapshot = []

    def _rollback(self, rec: StepRecord, kind: AlertKind, cause: str) -> RecoveryAction | None:
        if self.rollbacks >= self.policy.max_rollbacks:
            return None
        snap, opt = self.snapshot, self.optimizer
        before = _lrs(opt)
        snap.restore(self.model, opt)
        # a failure that did not repeat on re-run is a fault of the machine, not of the LR
        transient = self._transient is not None and not self._transient.reproducible
        factor = 1.0 if transient else self.policy.lr_factor
        for group, lr in zip(opt.param_groups, before):
            _set_lr(group, lr * factor)
        after = _lrs(opt)
        self.rollbacks += 1
        self.guard.history.clear()  # the lower lr changes the gradients' scale: re-baseline
        self.guard.skips.clear()
        self._skip_steps.clear()
        self.suspect_batches.extend(self._since_snapshot)
        suspects, self._since_snapshot = len(self._since_snapshot), []
        self._stale_through = self._step_of() - 1
        self._last_unhealthy = rec.step
        facts: dict[str, Any] = {
            "to_step": snap.step,
            "cause": cause,
            "lr_before": before,
            "lr_after": after,
            "suspect_batches": suspects,
            "rollbacks_left": self.policy.max_rollbacks - self.rollbacks,
        }
        if transient:
            facts["verdict"] = "not_reproducible"
        # every rollback gets its own flight record, holding the alert that reports it
        act = RecoveryAction("rollback", rec.step, kind, facts)
        path = self.flight_records.write(recovery_alert(act), rollback=self.rollbacks)
        record = str(path) if path is not None else None
        self.log.append({"action": "rollback", "step": rec.step, **facts, "flight_record": record})
        log.warning("nummon: step %d: %s", rec.step, rollback_message(facts))
        return RecoveryAction("rollback", rec.step, kind, {**facts, "flight_record": record})

    def _budget_spent(self, rec: StepRecord, kind: AlertKind, cause: str) -> RecoveryAction:
        why = (
            "recovery.rollback is off"
            if not self.policy.rollback
            else f"the retry budget of {self.policy.max_rollbacks} rollbacks is spent"
        )
        self.log.append({"action": "gave_up", "step": rec.step, "cause": cause})
        return RecoveryAction("gave_up", rec.step, kind, {"cause": cause, "why": why, "rollbacks": self.rollbacks})
