"""The detector tester the detector tests share (in the spirit of torchmetrics' `MetricTester`):
records made from plain numbers, a detector or a whole HealthEngine built from a policy and fed
them, and the alerts (or findings) a test asks about."""

from collections.abc import Iterable, Sequence
from typing import Any

from nummon import Alert, Policy, Severity, StepRecord, load_policy
from nummon._engine.detectors import shared_values
from nummon._engine.engine import HealthEngine

DEFAULT_POLICY = load_policy("default")


def loss_records(
    losses: Iterable[float | None],
    grad_norms: Iterable[float | None] | None = None,
    *,
    every: int = 1,
    first: int = 0,
) -> list[StepRecord]:
    """One record per loss (and gradient norm, where given) at steps first, first + every, ...;
    a None is a value the log did not hold."""
    losses = list(losses)
    norms = list(grad_norms) if grad_norms is not None else [None] * len(losses)
    return [StepRecord(step=first + every * i, loss=v, grad_norm=g) for i, (v, g) in enumerate(zip(losses, norms))]


def log_records(rows: Iterable[tuple[float | None, float | None]], *, first: int = 0) -> list[StepRecord]:
    """One record per (loss, grad_norm) row of a log, at steps first, first + 1, ..."""
    rows = list(rows)
    return loss_records([loss for loss, _ in rows], [g for _, g in rows], first=first)


def loss_records_at(points: Iterable[tuple[int, float | None]]) -> list[StepRecord]:
    """One record per (step, loss) point."""
    return [StepRecord(step=s, loss=v) for s, v in points]


def feed(engine: HealthEngine, recs: Iterable[StepRecord]) -> list[Any]:
    """What `engine` concludes from each record (its alerts, health and incident events), in order."""
    return [engine.step(r) for r in recs]


def engine_steps(recs: Iterable[StepRecord], policy: Policy | str | dict = DEFAULT_POLICY) -> list[Any]:
    """What a fresh HealthEngine under `policy` (a Policy, a preset name or a mapping) concludes
    from each record, in order."""
    return feed(HealthEngine(load_policy(policy)), recs)


def engine_alerts(recs: Iterable[StepRecord], policy: Policy | str | dict = DEFAULT_POLICY) -> list[Alert]:
    """Every alert a fresh HealthEngine under `policy` raises over the records, in order."""
    return [a for got in engine_steps(recs, policy) for a in got.alerts]


def is_loud(alert: Alert) -> bool:
    """A warning or a critical alert (a "cleared" alert is info)."""
    return alert.severity.rank >= Severity.WARNING.rank


def loud(recs: Iterable[StepRecord], policy: Policy | str | dict = DEFAULT_POLICY) -> list[Alert]:
    """The warning and critical alerts a fresh HealthEngine under `policy` raises over the records."""
    return [a for a in engine_alerts(recs, policy) if is_loud(a)]


def alert_keys(alerts: Iterable[Alert]) -> list[tuple[int, str, str, bool]]:
    """The alerts as comparable tuples (step, kind, severity, cleared), their texts left out."""
    return [(a.step, a.kind.value, a.severity.value, a.cleared) for a in alerts]


def make_detector(cls: Any, policy: Policy = DEFAULT_POLICY) -> Any:
    """A detector as build_detectors makes it: its own policy section plus the shared values it needs."""
    shared = shared_values(policy)
    return cls(getattr(policy, cls.section), **{n: shared[n] for n in cls.needs})


def detector_findings(det: Any, values: Sequence[Any], field: str = "loss", **extra: Any) -> list[list[Any]]:
    """The findings of `det` at each record step=i, `field`=values[i] (plus the `extra` fields)."""
    return [det.update(StepRecord(step=i, **{field: v}, **extra)) for i, v in enumerate(values)]


def unit_noise(seed: int, n: int) -> list[float]:
    """n deterministic values in [-1, 1] (a cheap LCG: hypothesis draws the seed, not 300 floats)."""
    out, x = [], seed or 1
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(2 * x / 2**31 - 1)
    return out
