"""Remediation hints: one specific hint per alert kind, specialised by optimizer and dtype."""

import pytest

from nummon import AlertKind, Severity
from nummon._core.types import Finding
from nummon._engine.hints import hint_for


def _hint(kind, **kw):
    return hint_for(Finding(kind, Severity.WARNING, "loss", 1.0, 1.0, "m", **kw))


@pytest.mark.parametrize("kind", list(AlertKind))
def test_every_alert_kind_has_a_hint_of_its_own(kind):
    h = _hint(kind)
    assert h and len(h) > 30
    others = {k: _hint(k) for k in AlertKind if k is not kind}
    assert [k for k, other in others.items() if other == h] == []  # not a shared generic sentence


def test_hints_are_specialised_by_optimizer_and_dtype():
    runaway = Finding(AlertKind.RUNAWAY, Severity.CRITICAL, "loss", 1.0, 1.0, "m")
    assert hint_for(runaway, {"optimizer": "sgd_momentum"}).startswith("momentum SGD")
    assert hint_for(runaway, {"optimizer": "sgd_momentum"}) != hint_for(runaway, {"optimizer": "adam"})
    fp16 = _hint(AlertKind.EXTREME, details={"dtype": "float16"})
    assert "bfloat16" in fp16 and fp16 != _hint(AlertKind.EXTREME, details={"dtype": "bfloat16"})
