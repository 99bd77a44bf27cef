"""Putting an explanation into the alerts of the step it explains."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from .._types import Alert, AlertKind
from ._explain import explain_nonfinite
from ._report import NonfiniteReport

__all__ = ["explain_into"]

log = logging.getLogger("nummon")


def explain_into(recompute: Callable[[], Any], alerts: list[Alert]) -> tuple[NonfiniteReport | None, list[Alert]]:
    """Explain the step `recompute` re-runs; its non-finite alerts then say why (message),
    what to do (hint) and carry the report (details["cause"]). Never raises."""
    try:
        report = explain_nonfinite(recompute)
    except Exception as e:  # forensics must never break training
        log.warning("nummon: could not explain the non-finite step (%s: %s)", type(e).__name__, e)
        return None, alerts
    if report is None:
        return None, alerts
    out = []
    for a in alerts:
        if a.kind is AlertKind.NONFINITE and not a.cleared:
            a = dataclasses.replace(
                a,
                message=f"{a.message}; why: {report}",
                hint=report.remedy,
                details={**a.details, "cause": report.to_dict(), "why": report.headline()},
            )
        out.append(a)
    return report, out
