"""Recovery for one Monitor: reports skips, keeps snapshots, decides and performs rollbacks.

Every decision is made from the records the Monitor evaluates, which are identical on every rank
under torch.distributed (the guard's norm is maxed over ranks too), so every rank skips the same
updates, snapshots at the same steps and restores the same one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import NummonError
from .._policy import RecoveryPolicy
from .._recorder import FlightRecords
from .._types import Alert, AlertKind, Health, Severity, StepRecord
from ._guard import GradientGuard, SkipDecision
from ._snapshot import Snapshot

__all__ = ["Recovery", "RecoveryOutcome"]

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


@dataclass(frozen=True)
class RecoveryOutcome:
    """What recovery concluded from one record."""

    alerts: tuple[Alert, ...]  # the record's alerts, with recovery's own (skips, rollbacks, budget spent)
    handled: bool = False  # its critical alerts were handled (update skipped, or rolled back): no need to stop
    rebaseline: bool = False  # the health engine must start its detectors afresh (a rollback happened)
    actions: tuple[dict[str, Any], ...] = ()  # the entries this record added to `Recovery.log`


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
        self._transient: Any = None
        self.verdict: Any = None  # the Verdict of the record being decided (forensics), set just before it

    def close(self) -> None:
        self.guard.uninstall()

    # ------------------------------------------------------------------ per record
    def on_record(self, rec: StepRecord, health: Health, alerts: list[Alert] | tuple[Alert, ...]) -> RecoveryOutcome:
        """This record's alerts plus recovery's own, whether its critical alerts were handled
        (the update was skipped, or the run rolled back) and whether the engine must re-baseline."""
        logged = len(self.log)
        out, handled, rebaseline = self._decide(rec, health, list(alerts))
        return RecoveryOutcome(tuple(out), handled, rebaseline, tuple(self.log[logged:]))

    def _decide(self, rec: StepRecord, health: Health, alerts: list[Alert]) -> tuple[list[Alert], bool, bool]:
        out = list(alerts)
        handled = False
        self._transient, self.verdict = self.verdict, None
        if self.rollbacks and rec.step <= self._stale_through:
            # launched before the last rollback (lagged mode): evidence of the old run, not a trigger
            return out, True, True
        skip = self.guard.skips.pop(rec.step, None)
        trigger: tuple[AlertKind, str] | None = None
        if skip is not None:
            out.extend(self._report_skip(rec, skip))
            if self._transient is not None and not self._transient.reproducible:
                out.extend(self._retry(rec))
            trigger = self._escalate(rec, skip, out)
            if not rec.is_finite() and set(rec.nonfinite_parts) <= _SKIP_COVERS:
                out = [self._covered(a) for a in out]  # the weights never saw it
                handled = True
        if trigger is None:
            trigger = self._trigger(rec, health, out, handled)
        if rec.fingerprint:
            self._since_snapshot.append(rec.fingerprint)
        if trigger is not None:
            alert = self._rollback(rec, *trigger) if self.policy.rollback else None
            if alert is not None:
                out.append(alert)
                return out, True, True
            out.append(self._budget_spent(rec, *trigger))
            return out, False, False
        if health is not Health.HEALTHY or any(a.severity.rank >= Severity.WARNING.rank and not a.cleared for a in out):
            self._last_unhealthy = rec.step
        self._maybe_snapshot(rec)
        return out, handled, False

    def _trigger(
        self, rec: StepRecord, health: Health, alerts: list[Alert], skipped: bool
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
    def _report_skip(self, rec: StepRecord, skip: SkipDecision) -> list[Alert]:
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
        return [
            Alert(
                step=rec.step,
                kind=AlertKind.NONFINITE if skip.nonfinite else AlertKind.EXPLOSION,
                severity=Severity.INFO,
                metric="grad_norm",
                value=skip.grad_norm,
                threshold=skip.limit,
                location="optimizer.step",
                message=f"recovered: skipped the update of step {rec.step}: {skip.reason}; "
                "weights and optimizer state untouched, gradients zeroed",
                details={"recovery": "skip", "skips": len(self._skip_steps)},
            )
        ]

    def _retry(self, rec: StepRecord) -> list[Alert]:
        """A skipped update whose failure did not repeat (a transient fault): made again from the
        re-run's gradients (single process), so the batch is not lost and the LR stays."""
        v = self._transient
        if v is None or v.grads is None or not self.guard.retry(v.grads):
            return []
        self._skip_steps.pop()  # a transient fault is no sign the gradients keep going bad
        self.log.append({"action": "retry", "step": rec.step, "suspect": v.where(), "rerun_loss": v.rerun_loss})
        return [
            Alert(
                step=rec.step,
                kind=AlertKind.NONFINITE,
                severity=Severity.INFO,
                metric="recovery",
                value=v.rerun_loss,
                location="optimizer.step",
                message=f"recovered: retried the update of step {rec.step} from its re-run (loss "
                f"{v.rerun_loss:.6g}, finite): the failure did not repeat, a transient fault on {v.where()}; "
                "lr unchanged",
                details={"recovery": "retry", "verdict": v.verdict, "suspect": v.where()},
            )
        ]

    def _escalate(self, rec: StepRecord, skip: SkipDecision, out: list[Alert]) -> tuple[AlertKind, str] | None:
        p = self.policy
        while self._skip_steps and self._skip_steps[0] <= rec.step - p.skip_window:
            self._skip_steps.popleft()
        n = len(self._skip_steps)
        kind = AlertKind.NONFINITE if skip.nonfinite else AlertKind.EXPLOSION
        if n > 2 * p.max_skips:
            return kind, f"{n} updates skipped in the last {p.skip_window} steps"
        if n > p.max_skips and (self._skip_warned_at is None or rec.step - self._skip_warned_at >= p.skip_window):
            self._skip_warned_at = rec.step
            out.append(
                Alert(
                    step=rec.step,
                    kind=kind,
                    severity=Severity.WARNING,
                    metric="grad_norm",
                    value=float(n),
                    threshold=float(p.max_skips),
                    location="optimizer.step",
                    message=f"{n} updates skipped in the last {p.skip_window} steps (recovery.max_skips "
                    f"{p.max_skips}): the gradients keep going bad",
                    details={"recovery": "skip"},
                )
            )
        return None

    @staticmethod
    def _covered(a: Alert) -> Alert:
        if a.kind is not AlertKind.NONFINITE or a.severity is not Severity.CRITICAL:
            return a
        return dataclasses.replace(
            a,
            severity=Severity.INFO,
            message=a.message + " (this step's update was skipped: weights and optimizer state untouched)",
            details={**a.details, "recovery": "skip", "original_severity": "critical"},
        )

    # ------------------------------------------------------------------ snapshots and rollbacks
    def _maybe_snapshot(self, rec: StepRecord) -> None:
        every = self.policy.snapshot_every
        if rec.step % every or rec.step - self._last_unhealthy < every:
            return
        # the weights now hold every update up to the step before the Monitor's next one
        self.snapshot = Snapshot.take(self.model, self.optimizer, self._step_of() - 1)
        self.snapshots_taken += 1
        self._since_snapshot = []

    def _rollback(self, rec: StepRecord, kind: AlertKind, cause: str) -> Alert | None:
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
        to = "the start (before step 0)" if snap.step < 0 else f"step {snap.step}"
        left = self.policy.max_rollbacks - self.rollbacks
        lr_text = f"lr {before[0]:.4g} -> {after[0]:.4g}"
        if transient:
            lr_text = f"lr kept at {after[0]:.4g} (a transient fault: the step's failure did not repeat on re-run)"
        msg = f"recovered: rolled back to {to}, {lr_text} (cause: {cause}; {left} rollback{'s' if left != 1 else ''} left)"

        entry = {
            "action": "rollback",
            "step": rec.step,
            "to_step": snap.step,
            "cause": cause,
            "lr_before": before,
            "lr_after": after,
            "suspect_batches": suspects,
            "rollbacks_left": left,
        }
        if transient:
            entry["verdict"] = "not_reproducible"
        alert = Alert(
            step=rec.step,
            kind=kind,
            severity=Severity.WARNING,
            metric="recovery",
            value=float(snap.step),
            message=msg,
            location="model and optimizer state",
            details={"recovery": "rollback", **{k: v for k, v in entry.items() if k not in ("action", "step")}},
        )
        path = self.flight_records.write(alert, rollback=self.rollbacks)  # every rollback gets its own
        record = str(path) if path is not None else None
        entry["flight_record"] = record
        self.log.append(entry)
        log.warning("nummon: step %d: %s", rec.step, msg)
        return dataclasses.replace(alert, flight_record=record) if record else alert

    def _budget_spent(self, rec: StepRecord, kind: AlertKind, cause: str) -> Alert:
        why = (
            "recovery.rollback is off"
            if not self.policy.rollback
            else f"the retry budget of {self.policy.max_rollbacks} rollbacks is spent"
        )
        self.log.append({"action": "gave_up", "step": rec.step, "cause": cause})
        # critical: the run stops as it would without recovery (even if a cooldown kept other alerts quiet)
        return Alert(
            step=rec.step,
            kind=kind,
            severity=Severity.CRITICAL,
            metric="recovery",
            message=f"not recovered: {cause}, and {why}",
            location="model and optimizer state",
            details={"recovery": "gave_up", "rollbacks": self.rollbacks},
        )
