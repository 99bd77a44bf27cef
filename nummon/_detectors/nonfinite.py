"""Non-finite values anywhere: critical, with the first place they appeared."""
from __future__ import annotations

import math
from collections import deque

from .._policy import NonfinitePolicy
from .._types import AlertKind, Finding, Severity, StepRecord

__all__ = ["NonfiniteDetector"]

# the scalars of a record that are gradient statistics
_GRAD_PARTS = {"grad_norm", "grad_max"}
# a log's skipped step is one amid ordinary gradient norms: the last finite one within this factor
# of the median of the `_NORM_HISTORY` before it (a runaway ending in inf is no skip)
_RUN_UP = 10.0
_NORM_HISTORY = 20


class NonfiniteDetector:
    """Critical on the first NaN/Inf anywhere; keeps the first location while the condition holds.

    One condition (an episode) lasts from the first non-finite record until `clear_records`
    finite records in a row: NaNs that come back every few records are one condition, its
    first location kept and each return counted (the engine holds it open just as long).
    """

    section = "nonfinite"
    kinds = (AlertKind.NONFINITE,)
    needs = ()

    def __init__(self, p: NonfinitePolicy) -> None:
        self._p = p
        self._first: tuple[str, str] | None = None  # (metric, location) of the first non-finite step
        self._skips = 0  # log records in a row with non-finite gradients beside a finite loss
        self._norms: deque[float] = deque(maxlen=_NORM_HISTORY)  # the last finite gradient norms
        self._finite_run = 0  # finite records in a row since the last non-finite one
        self._since: int | None = None  # step of the episode's first non-finite record
        self._records = 0  # non-finite records in the episode

    def update(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        kind = AlertKind.NONFINITE
        if rec.scaler_skipped:
            # dynamic loss scaling calibrates by overflowing: the weights were protected
            out.append(
                Finding(
                    kind,
                    Severity.INFO,
                    "scaled_gradients",
                    None,
                    None,
                    "scaled gradients overflowed and the GradScaler skipped this step (loss scale lowered)",
                    location="GradScaler",
                )
            )
        if rec.input_nonfinite:
            out.append(
                Finding(
                    kind,
                    Severity.CRITICAL,
                    "input",
                    float(rec.input_nonfinite),
                    0.0,
                    f"{rec.input_nonfinite} non-finite values in the input batch (a data problem, not the model)",
                    location="input batch",
                )
            )
        g = rec.grad_norm
        if g is not None and math.isfinite(g) and g > 0:
            self._norms.append(g)
        parts = list(rec.nonfinite_parts)
        from_log = not parts
        if from_log and not rec.is_finite():  # records from traces carry no parts: find them
            parts = [k for k, v in rec.scalars().items() if not math.isfinite(v)]
            parts += [f"grad of {k}" for k, v in rec.layer_grad_norms.items() if not math.isfinite(v)][:3]
        if not parts:
            self._skips = 0
            # (a record non-finite elsewhere, e.g. only in its input batch, ends no episode)
            self._finite_run = self._finite_run + 1 if rec.is_finite() else 0
            if self._finite_run >= self._p.clear_records:  # the episode is over
                self._first, self._since, self._records = None, None, 0
            return out
        gap = self._finite_run if self._since is not None else 0  # finite records since the last non-finite one
        self._finite_run = 0
        self._records += 1
        skip = self._skipped_in_log(rec, parts, from_log)
        if self._first is None:
            metric = parts[0]
            self._first = (metric, rec.nonfinite_location or metric)
            self._since = rec.step
        if skip is not None:  # (the first non-finite is kept: the loss may follow at the next record)
            out.append(skip)
            return out
        metric, location = self._first
        count = f" ({rec.nonfinite_count} values)" if rec.nonfinite_count else ""
        where = f"first non-finite tensor: {location}"
        if rec.rank is not None:
            where = f"first non-finite: rank {rec.rank}, {location}"
        named = list(dict.fromkeys(parts))
        again = ""
        if gap:
            again = (f"; non-finite again after {gap} finite record{'' if gap == 1 else 's'} "
                     f"({self._records} non-finite records since step {self._since})")
        out.append(
            Finding(
                kind,
                Severity.CRITICAL,
                "nonfinite",
                float(rec.nonfinite_count or len(parts)),
                0.0,
                f"non-finite values in {', '.join(named)}{count}; {where}{again}",
                location=location,
                details={"parts": named, "since": self._since, "last": rec.step, "records": self._records},
            )
        )
        return out

    def _skipped_in_log(self, rec: StepRecord, parts: list[str], from_log: bool) -> Finding | None:
        """A log's non-finite gradient norm beside a finite loss, with no word of a scaler: what
        an fp16 loss scaler's skipped step looks like (Hugging Face logs its grad_norm as inf or
        nan). Info, a warning from `log_skip_warning` records in a row, and from `log_skip_records`
        None: critical."""
        grads_only = all(p in _GRAD_PARTS or p.startswith("grad of ") for p in parts)
        if not (from_log and rec.scaler_skipped is None and grads_only and rec.loss is not None
                and math.isfinite(rec.loss) and not self._running_away()):
            self._skips = 0
            return None
        self._skips += 1
        if self._skips >= self._p.log_skip_records:
            return None
        in_a_row = "" if self._skips == 1 else f" ({self._skips} records in a row)"
        return Finding(
            AlertKind.NONFINITE,
            Severity.WARNING if self._skips >= self._p.log_skip_warning else Severity.INFO,
            parts[0],
            None,
            None,
            f"non-finite {', '.join(dict.fromkeys(parts))} beside a finite loss{in_a_row}: in a log, the mark of a loss "
            "scaler (fp16 AMP) skipping the step, harmless while the losses after it stay finite; critical if it "
            f"lasts {self._p.log_skip_records} records",
            location=parts[0],
            details={"parts": list(dict.fromkeys(parts)), "records": self._skips, "rule": "log_skip"},
        )

    def _running_away(self) -> bool:
        """Whether the last finite gradient norm stood `_RUN_UP` x above the ones before it: then a
        non-finite one ends a blow-up, not a scaler's calibration amid ordinary gradients."""
        if len(self._norms) < 2:
            return False
        *before, last = self._norms
        return last >= _RUN_UP * sorted(before)[len(before) // 2]
