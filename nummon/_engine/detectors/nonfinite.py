"""Non-finite values anywhere: critical, with the first place they appeared."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.alert_text import sci
from ..._core.maths import median, robust_center
from ..._core.text import fmt_num
from ..._core.types import AlertKind, Finding, Severity, StepRecord
from ..._policy.sections import NonfinitePolicy

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["NonfiniteDetector"]

# the scalars of a record that are gradient statistics
_GRAD_PARTS = {"grad_norm", "grad_max"}
# a log's skipped step is one amid ordinary gradient norms: the last finite one within this factor
# of the median of the `_NORM_HISTORY` before it (a runaway ending in inf is no skip)
_RUN_UP = 10.0
_NORM_HISTORY = 20
# A scaler's skipped step leaves the forward loss as it was: the reading holds only where the loss
# at that record is within its own noise: no higher above its median than the highest of the last
# `_LOSS_HISTORY` records (their spread), or than `_NOISE_Z` robust standard deviations (1.4826 MAD
# of log10 loss) if that is more; for Gaussian noise a loss lands beyond 4 sigma about once in
# 30,000 records, and the spread covers a sigma that a few records underestimate. `_MIN_BAND` (log10 1.1, 10%)
# keeps a printed-smooth loss from calling every wobble a jump, and with fewer than
# `_MIN_LOSSES` earlier losses the spread is unknown: only a jump beyond `_SHORT_FACTOR` counts.
_NOISE_Z = 4.0
_LOSS_HISTORY = 50
_MIN_LOSSES = 5
_MIN_BAND = math.log10(1.1)
_SHORT_FACTOR = 4.0
# a loss whose median over the `_SHIFT_RECORDS` finite records after a skip stays more than
# `_NOISE_Z` of that median's standard deviations (0.67 sigma for three records) above the level
# before: a level shift, which a skipped step cannot cause either
_SHIFT_RECORDS = 3
_MEDIAN_OF_3 = 0.67


def _batch_findings(rec: StepRecord) -> list[Finding]:
    """What a record says about its step's batch and loss scaler: a GradScaler's skipped step
    (info) and non-finite values in the input batch (critical)."""
    out: list[Finding] = []
    if rec.scaler_skipped:
        # dynamic loss scaling calibrates by overflowing: the weights were protected
        out.append(
            Finding(
                AlertKind.NONFINITE,
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
                AlertKind.NONFINITE,
                Severity.CRITICAL,
                "input",
                float(rec.input_nonfinite),
                0.0,
                f"{rec.input_nonfinite} non-finite values in the input batch (a data problem, not the model)",
                location="input batch",
            )
        )
    return out


def _nonfinite_parts(rec: StepRecord) -> tuple[list[str], bool]:
    """(the statistics of `rec` that went non-finite, whether they were read off a log): records
    from traces carry no parts, so they are found among its values."""
    parts = list(rec.nonfinite_parts)
    from_log = not parts
    if from_log and not rec.is_finite():
        parts = [k for k, v in rec.scalars().items() if not math.isfinite(v)]
        parts += [f"grad of {k}" for k, v in rec.layer_grad_norms.items() if not math.isfinite(v)][:3]
    return parts, from_log


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
        self._losses: deque[float] = deque(maxlen=_LOSS_HISTORY)  # log10 of the last finite positive losses
        # after a skip reading: (its step, the loss's log10 median and band then, the log10 losses since)
        self._shift: tuple[int, float, float, list[float]] | None = None

    def update(self, rec: StepRecord) -> list[Finding]:
        out = _batch_findings(rec)
        g = rec.grad_norm
        if g is not None and math.isfinite(g) and g > 0:
            self._norms.append(g)
        parts, from_log = _nonfinite_parts(rec)
        if not parts:
            shifted = self._on_finite(rec)
            if shifted is not None:
                out.append(shifted)
            return out
        gap = self._finite_run if self._since is not None else 0  # finite records since the last non-finite one
        self._finite_run = 0
        self._records += 1
        self._shift = None
        jump = self._loss_jump(rec.loss)
        skip = self._skipped_in_log(rec, parts, from_log, jump)
        self._note_loss(rec.loss)
        if self._first is None:
            metric = parts[0]
            self._first = (metric, rec.nonfinite_location or metric)
            self._since = rec.step
        # (on a skip the first non-finite is kept: the loss may follow at the next record)
        out.append(skip if skip is not None else self._critical(rec, parts, jump, gap))
        return out

    def quiet(self, plan: QuietPlan) -> bool:
        """Silent on a finite record (the only kind a quiet region admits) outside an episode
        and with no level shift being watched: such a record only books its values."""
        return self._first is None and self._shift is None

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book finite records `quiet` promised silence on, as `_on_finite` would, in bulk."""
        norms, isfinite = self._norms, math.isfinite
        for rec in records:
            g = rec.grad_norm
            if g is not None and isfinite(g) and g > 0:
                norms.append(g)
            self._note_loss(rec.loss)
        self._skips = 0
        self._finite_run += len(records)
        if self._finite_run >= self._p.clear_records:
            self._first, self._since, self._records = None, None, 0

    def _on_finite(self, rec: StepRecord) -> Finding | None:
        """Book a record with no non-finite statistic; a level shift after a skip reading, if one shows."""
        self._skips = 0
        self._note_loss(rec.loss)
        shifted = self._level_shift(rec)
        # (a record non-finite elsewhere, e.g. only in its input batch, ends no episode)
        self._finite_run = self._finite_run + 1 if rec.is_finite() else 0
        if self._finite_run >= self._p.clear_records:  # the episode is over
            self._first, self._since, self._records = None, None, 0
        return shifted

    def _critical(self, rec: StepRecord, parts: list[str], jump: tuple[float, float] | None, gap: int) -> Finding:
        """The critical finding of a non-finite record: what went non-finite, where it first did, and
        how often it came back (`gap`: finite records since the last non-finite one)."""
        assert self._first is not None
        metric, location = self._first
        n = rec.nonfinite_count
        # the count is of the tensor the location names
        count = f", {sci(n)} non-finite element{'' if n == 1 else 's'} in it" if n else ""
        where = f"first non-finite tensor: {location}{count}"
        if rec.rank is not None:
            where = f"first non-finite: rank {rec.rank}, {location}{count}"
        named = list(dict.fromkeys(parts))
        again = ""
        if jump is not None:
            again += (
                f"; beside it the loss is {jump[0]:.3g}x its recent median {fmt_num(jump[1])}, beyond its noise "
                "(a loss scaler's skipped step leaves the loss as it was)"
            )
        if gap:
            again = (
                f"; non-finite again after {gap} finite record{'' if gap == 1 else 's'} "
                f"({self._records} non-finite records since step {self._since})"
            )
        return Finding(
            AlertKind.NONFINITE,
            Severity.CRITICAL,
            "nonfinite",
            float(rec.nonfinite_count or len(parts)),
            0.0,
            f"non-finite values in {', '.join(named)}; {where}{again}",
            location=location,
            details={
                "parts": named,
                "since": self._since,
                "last": rec.step,
                "records": self._records,
                **({"elements": int(n)} if n else {}),
            },
        )

    def _note_loss(self, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss) and loss > 0:
            self._losses.append(math.log10(loss))

    def _loss_jump(self, loss: float | None) -> tuple[float, float] | None:
        """(ratio to the recent median, that median) when `loss` stands above its own noise
        (see `_NOISE_Z`); None when it is within it, or there is no finite loss to judge."""
        if loss is None or not math.isfinite(loss) or loss <= 0 or not self._losses:
            return None
        if len(self._losses) < _MIN_LOSSES:
            m, band = median(self._losses), math.log10(_SHORT_FACTOR)
        else:
            m, band = self._band()
        up = math.log10(loss) - m
        return (10.0**up, 10.0**m) if up > band else None

    def _level_shift(self, rec: StepRecord) -> Finding | None:
        """Critical when the loss has stayed above its band over the records after a skip reading."""
        if self._shift is None or rec.loss is None or not math.isfinite(rec.loss) or rec.loss <= 0:
            return None
        at, m, band, since = self._shift
        since.append(math.log10(rec.loss))
        if len(since) < _SHIFT_RECORDS:
            return None
        self._shift = None
        up = median(since) - m
        if up <= band or self._first is None:
            return None
        metric, location = self._first
        ratio = 10.0**up
        return Finding(
            AlertKind.NONFINITE,
            Severity.CRITICAL,
            "nonfinite",
            ratio,
            10.0**band,
            f"non-finite {metric} at step {at}, and the loss has stayed {ratio:.3g}x its median before it "
            f"({fmt_num(10.0**m)}) over the {len(since)} records since: a level shift, not a loss scaler's skipped step",
            location=location,
            details={
                "parts": [metric],
                "since": self._since,
                "last": at,
                "records": self._records,
                "ratio": ratio,
                "rule": "log_skip_level_shift",
            },
        )

    def _skipped_in_log(
        self, rec: StepRecord, parts: list[str], from_log: bool, jump: tuple[float, float] | None = None
    ) -> Finding | None:
        """A log's non-finite gradient norm beside a finite loss, with no word of a scaler: what
        an fp16 loss scaler's skipped step looks like (Hugging Face logs its grad_norm as inf or
        nan). Info, a warning from `log_skip_warning` records in a row, and from `log_skip_records`
        None: critical."""
        grads_only = all(p in _GRAD_PARTS or p.startswith("grad of ") for p in parts)
        if not (
            from_log
            and rec.scaler_skipped is None
            and grads_only
            and rec.loss is not None
            and math.isfinite(rec.loss)
            and jump is None
            and not self._running_away()
        ):
            self._skips = 0
            return None
        self._skips += 1
        self._shift = self._shift_reference(rec.step)
        if self._skips >= self._p.log_skip_records:
            return None
        in_a_row = "" if self._skips == 1 else f" ({self._skips} records in a row)"
        return Finding(
            AlertKind.NONFINITE,
            Severity.WARNING if self._skips >= self._p.log_skip_warning else Severity.INFO,
            parts[0],
            None,
            None,
            f"non-finite {', '.join(dict.fromkeys(parts))} beside a finite loss {self._loss_words(rec.loss)}{in_a_row}: "
            "in a log, "
            "the mark of a loss scaler (fp16 AMP) skipping the step; critical if the loss jumps or shifts after it, or "
            f"if it lasts {self._p.log_skip_records} records",
            location=parts[0],
            details={"parts": list(dict.fromkeys(parts)), "records": self._skips, "rule": "log_skip"},
        )

    def _loss_words(self, loss: float) -> str:
        """How the loss beside a skip reading stands: within its noise, or (fewer than
        `_MIN_LOSSES` earlier losses) against a history too short to measure a noise."""
        n = len(self._losses)
        if n >= _MIN_LOSSES:
            return "within its noise"
        if n == 0:
            return "(no earlier loss: no history to measure its noise)"
        ratio = loss / median([10.0**x for x in self._losses])
        return (
            f"({ratio:.3g}x the median of the {n} loss{'es' if n != 1 else ''} before it: too few to measure its noise)"
        )

    def _shift_reference(self, step: int) -> tuple[int, float, float, list[float]] | None:
        """The loss's level and band before a skip (the skip record's own loss left out), to tell a
        level shift after it (called before the skip record's own loss joins the history); None
        while the history is too short to have a band."""
        if len(self._losses) < _MIN_LOSSES:
            return None
        m, sigma = self._noise()
        return (step, m, max(_NOISE_Z * _MEDIAN_OF_3 * sigma, _MIN_BAND), [])

    def _noise(self) -> tuple[float, float]:
        """(median, robust sigma) of the recent log10 losses; sigma from n records may be well
        under the truth (the MAD's standard error is about 1.16 sigma / sqrt(n)), so an
        underestimate of two standard errors is divided out."""
        m, sigma = robust_center(self._losses)
        return m, sigma / max(0.3, 1.0 - 2.32 / math.sqrt(len(self._losses)))

    def _band(self) -> tuple[float, float]:
        """(median, band) of the recent log10 losses: how far above its median one record's loss
        still stands within its own noise (see `_NOISE_Z`)."""
        m, sigma = self._noise()
        return m, max(_NOISE_Z * sigma, max(self._losses) - m, _MIN_BAND)

    def _running_away(self) -> bool:
        """Whether the last finite gradient norm stood `_RUN_UP` x above the ones before it: then a
        non-finite one ends a blow-up, not a scaler's calibration amid ordinary gradients."""
        if len(self._norms) < 2:
            return False
        *before, last = self._norms
        return last >= _RUN_UP * sorted(before)[len(before) // 2]
