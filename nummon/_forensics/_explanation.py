"""The answer to "why did it go non-finite?": one frozen record, printable as one paragraph."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CAUSES", "NonfiniteReport"]

# The five roots of a non-finite value, in the vocabulary of the README's "Why did it go NaN?".
CAUSES = ("overflow", "log_of_zero", "division_by_zero", "invalid_operation", "nonfinite_input")


def _short_path(location: str) -> str:
    """`location` with its path made relative to the working directory when it lies below it."""
    path, sep, line = location.rpartition(":")
    if not sep:
        return location
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return location
    return f"{path if rel.startswith('..') else rel}:{line}"


@dataclass(frozen=True)
class NonfiniteReport:
    """Where and why the first non-finite value of one step appeared.

    op: the ATen operator that produced it (e.g. "aten::exp"); stage: "forward" or "backward";
    forward_op: for the backward stage, the forward operator whose gradient went non-finite;
    cause: one of CAUSES; location: "file:line" of the user's call (for backward: the call of
    forward_op); source: that line's code; module: the dotted module path the call ran in
    (None outside any module); input_ranges: the numbers that explain it; remedy: one line.
    """

    op: str
    stage: str
    cause: str
    location: str | None
    module: str | None
    input_ranges: str
    remedy: str
    forward_op: str | None = None
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def headline(self) -> str:
        """One line for people: "overflow in `aten::convolution` (forward) inside `conv2` at
        model.py:30: inputs span ..." (no remedy: that is the hint)."""
        op = f"`{self.op}` ({self.stage})"
        if self.stage == "backward" and self.forward_op:
            op = f"`{self.op}` (the backward of `{self.forward_op}`)"
        inside = f" inside `{self.module}`" if self.module else ""
        at = f" at {self.location}" if self.location else ""
        return f"{self.cause.replace('_', ' ')} in {op}{inside}{at}: {self.input_ranges}"

    def __str__(self) -> str:
        if self.stage == "backward":
            what = f"{self.cause} in {self.op} during the backward of {self.forward_op or 'an unknown op'}"
        else:
            what = f"{self.cause} in {self.op} during the forward"
        where = ""
        if self.location:
            where = f" at {_short_path(self.location)}"
            if self.source:
                where += f" (`{self.source}`)"
        inside = f" inside {self.module}" if self.module else ""
        return f"{what}{where}{inside}: {self.input_ranges}. Remedy: {self.remedy}"
