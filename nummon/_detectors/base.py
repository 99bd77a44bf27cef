"""What every detector is: a small pure unit over host-side step records (no torch)."""

from __future__ import annotations

from typing import ClassVar, Protocol

from .._types import AlertKind, Finding, StepRecord

__all__ = ["Detector", "MAGNITUDE_FIELDS"]

#: Magnitude statistics: where runaway growth and dtype overflow show first.
MAGNITUDE_FIELDS = ("loss", "grad_norm", "grad_max", "param_norm", "optim_state_norm", "activation_max")


class Detector(Protocol):
    """The contract: a detector reads only its own policy section (``section``, handed to
    ``__init__``) plus the shared values it names in ``needs``, and returns only findings of the
    ``kinds`` it declares."""

    section: ClassVar[str]  # the Policy attribute it is configured by
    kinds: ClassVar[tuple[AlertKind, ...]]  # every kind its findings can have
    needs: ClassVar[tuple[str, ...]]  # shared values passed as keyword arguments (see build_detectors)

    def update(self, rec: StepRecord) -> list[Finding]:
        """Findings active at this step."""
        ...
