"""Forensics of a non-finite step: the operator, the stage, the user's line, the module and the
mathematical cause (overflow, log of zero, division by zero, invalid operation, non-finite input)
of the first NaN or inf, with the numbers that show it and a remedy.

May import: `_core`, `_policy`, `_stats`.
"""

from __future__ import annotations

from ._alerts import explain_quietly
from ._explain import explain_nonfinite
from ._explanation import CAUSES, NonfiniteReport

__all__ = ["CAUSES", "NonfiniteReport", "explain_quietly", "explain_nonfinite"]
