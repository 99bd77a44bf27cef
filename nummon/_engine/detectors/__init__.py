"""Detectors: small, pure units over host-side step records (no torch).

Each detector declares the policy section it reads and the alert kinds it owns, takes one
`StepRecord` per step and returns the `Finding`s active at that step. Deduplication, cooldown
and routing are the lifecycle's and the monitor's business, not a detector's.
"""

from __future__ import annotations

from typing import Any

from ..._policy.policy import Policy
from .adam_moment import AdamMomentDetector
from .attention import AttentionDetector
from .base import MAGNITUDE_FIELDS, Detector, DetectorClass
from .divergence import DivergenceDetector
from .headroom import HeadroomDetector
from .nonfinite import NonfiniteDetector
from .oscillation import OscillationDetector
from .output_logits import OutputLogitsDetector
from .runaway import RunawayDetector
from .spike import SpikeDetector
from .stall import StallDetector
from .trend import LossTrend, StartLevel, TrendStats
from .vanishing import VanishingDetector

__all__ = [
    "AdamMomentDetector",
    "AttentionDetector",
    "OutputLogitsDetector",
    "DETECTORS",
    "Detector",
    "DivergenceDetector",
    "HeadroomDetector",
    "LossTrend",
    "MAGNITUDE_FIELDS",
    "NonfiniteDetector",
    "OscillationDetector",
    "RunawayDetector",
    "SpikeDetector",
    "StallDetector",
    "StartLevel",
    "TrendStats",
    "VanishingDetector",
    "build_detectors",
    "shared_values",
]

#: Every detector, in the order their findings are reported. Each names its own section.
DETECTORS: tuple[DetectorClass, ...] = (
    NonfiniteDetector,
    SpikeDetector,
    RunawayDetector,
    HeadroomDetector,
    DivergenceDetector,
    StallDetector,
    OscillationDetector,
    VanishingDetector,
    AttentionDetector,
    OutputLogitsDetector,
    AdamMomentDetector,
)


def shared_values(policy: Policy) -> dict[str, Any]:
    """The values more than one detector needs, built once per engine: the dtype assumed for
    records that do not name one, and the loss's starting level and trend window (one object
    each, so they are computed once per record however many detectors read them)."""
    level = StartLevel(policy.trend.baseline_records)
    return {
        "default_dtype": policy.headroom.default_dtype,
        "level": level,
        "trend": LossTrend(policy.trend, level),
    }


def build_detectors(policy: Policy, shared: dict[str, Any] | None = None) -> list[Detector]:
    """One instance of every detector the policy enables, each given only its own section and
    the shared values it declares in ``needs`` (from `shared`, else from `shared_values(policy)`)."""
    shared = shared_values(policy) if shared is None else shared
    out: list[Detector] = []
    for cls in DETECTORS:
        section = getattr(policy, cls.section)
        if section.enabled:
            out.append(cls(section, **{name: shared[name] for name in cls.needs}))
    return out
