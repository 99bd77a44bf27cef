"""Explaining a non-finite step without ever breaking training (the engine puts the
explanation into the step's alerts: nummon/_engine/outcome.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ._explain import explain_in
from ._explanation import NonfiniteReport

__all__ = ["explain_quietly"]

log = logging.getLogger("nummon")


def explain_quietly(recompute: Callable[[], Any], model: Any = None) -> NonfiniteReport | None:
    """The cause of the first non-finite value of the step `recompute` re-runs, its modules named
    as in `model` (None when it could not be explained). Never raises: forensics must never
    break training."""
    try:
        return explain_in(model, recompute)
    except Exception as e:  # forensics must never break training
        log.warning("nummon: could not explain the non-finite step (%s: %s)", type(e).__name__, e)
        return None
