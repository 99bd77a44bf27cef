"""The statistic families, one module each in this folder (`family.py` says what each one
holds: its segments with their cross-rank rules, its launch and its decoders). The collector
launches and the decoder decodes from this one list, in its order (later families read what
earlier ones noted or set: the clip ratio needs the gradient norm, the update ratio the parameter
norm), so a family cannot be launched without being decoded. A new statistic is a new module
here and its line in `FAMILIES`."""

from __future__ import annotations

from . import activations, gradients, inputs, loss, mechanism_stats, optimizer, parameters
from .family import Decode, StatFamily

__all__ = ["FAMILIES", "StatFamily", "decoders", "declared_rules"]

FAMILIES: tuple[StatFamily, ...] = (
    loss.FAMILY,
    gradients.FAMILY,
    parameters.FAMILY,
    optimizer.FAMILY,
    activations.FAMILY,
    mechanism_stats.FAMILY,
    inputs.FAMILY,
)


def decoders(families: tuple[StatFamily, ...] = FAMILIES) -> tuple[Decode, ...]:
    """Every family's decoders, flattened in the families' order (what `Decoder` runs)."""
    return tuple(d for f in families for d in f.decode)


def declared_rules(segment: str, families: tuple[StatFamily, ...] = FAMILIES) -> frozenset[str] | None:
    """The rules the family that declares `segment` gives it, or None when no family does."""
    return next((r for f in families if (r := f.rules_for(segment)) is not None), None)
