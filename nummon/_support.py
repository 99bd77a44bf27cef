"""What the integrations (``nummon.integrations.*``) need beyond the public names, listed in one
place: re-exports of private helpers, nothing defined here but one lazy wrapper. An integration
imports public names from ``nummon`` and everything else from here, so a change to the package's
insides that reaches an integration shows in this list (tests/integrations/test_integration_imports.py).
Not a public API: no stability promise beyond the integrations shipped with nummon.

May import: `_core`, `_policy`, `_logs`, `_sinks`, `_stats`, `_engine`, `_forensics`, `_report`, `_monitor`, `_watch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._core.alert_text import alert_text
from ._core.lazy import require
from ._core.maths import clip_ratio
from ._core.text import plain_text
from ._core.types import HEALTH_LEGEND
from ._engine.incidents import escalated_to_critical
from ._logs.read_mlflow import nonfinite_marker
from ._policy.policy import PolicyLike
from ._report.page import SIGNALS
from ._report.svg import MARK_COLORS, MARK_WORDS
from ._sinks.layout import (
    DEFAULT_HISTOGRAM_EVERY,
    INCIDENT_LEGEND,
    LAYER_METRICS,
    TOP_K,
    VIEWS_LEGEND,
    TopOffenders,
    alert_tag,
    custom_scalars_layout,
    histogram_tags,
    incident_code,
    incident_tag,
    linear_histogram_readable,
    metric_sections,
    state_range_scalars,
    step_scalars,
)
from ._watch.metrics import FleetMetrics, WatchSnapshot

__all__ = [
    "DEFAULT_HISTOGRAM_EVERY",
    "FleetMetrics",
    "HEALTH_LEGEND",
    "INCIDENT_LEGEND",
    "LAYER_METRICS",
    "MARK_COLORS",
    "MARK_WORDS",
    "PolicyLike",
    "SIGNALS",
    "TOP_K",
    "TopOffenders",
    "VIEWS_LEGEND",
    "WatchSnapshot",
    "alert_tag",
    "alert_text",
    "clip_ratio",
    "custom_scalars_layout",
    "escalated_to_critical",
    "histogram_tags",
    "incident_code",
    "incident_tag",
    "linear_histogram_readable",
    "metric_sections",
    "nonfinite_marker",
    "plain_text",
    "require",
    "state_range_scalars",
    "step_scalars",
    "untraced",
]


def untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` kept out of `torch.compile`'s trace (``nummon._stats.compiled.untraced``). Imported
    on first call, not re-exported: that module imports torch, which the sinks (``nummon watch``'s
    Prometheus and W&B sinks among them) must not."""
    from ._stats.compiled import untraced as _untraced

    return _untraced(hook)
