"""What every detector is: a small pure unit over host-side step records (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..._core.types import AlertKind, Finding, StepRecord

if TYPE_CHECKING:
    from ..quiet import QuietPlan

__all__ = ["Detector", "DetectorClass", "MAGNITUDE_FIELDS"]

#: Magnitude statistics: where runaway growth and dtype overflow show first.
MAGNITUDE_FIELDS = ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max")


class Detector(Protocol):
    """The contract: a detector reads only its own policy section (``section``, handed to
    ``__init__``) plus the shared values it names in ``needs``, and returns only findings of the
    ``kinds`` it declares."""

    # class attributes, read-only here (a detector declares `section = "spike"`, not a ClassVar)
    @property
    def section(self) -> str: ...  # the Policy attribute it is configured by

    @property
    def kinds(self) -> tuple[AlertKind, ...]: ...  # every kind its findings can have

    @property
    def needs(self) -> tuple[str, ...]: ...  # shared values passed as keyword arguments (see build_detectors)

    def update(self, rec: StepRecord) -> list[Finding]:
        """Findings active at this step."""
        ...

    def quiet(self, plan: QuietPlan) -> bool:
        """Narrow `plan` (the bands, steps and records of the next records, `_engine/quiet.py`)
        to a region where `update` provably returns no finding, whatever in-region records came
        before; False when no such region can be given now."""
        ...

    def absorb(self, records: Sequence[StepRecord]) -> None:
        """Book records of the region `quiet` gave, in order, leaving the state `update` would
        have left (the shared values, `level` and `trend`, are booked by the engine)."""
        ...


class DetectorClass(Protocol):
    """A detector's class, as `build_detectors` uses it: the section and shared values it names,
    and a constructor taking that section (its own policy model) and those values by keyword."""

    @property
    def section(self) -> str: ...

    @property
    def needs(self) -> tuple[str, ...]: ...

    # constructors differ (each takes its own section model and its own needs): any arguments
    def __call__(self, *args: Any, **kwargs: Any) -> Detector: ...
