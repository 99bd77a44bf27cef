"""Remediation hints: one specific hint per alert kind, specialised by optimizer and dtype."""
import pytest

from nummon import AlertKind, Severity
from nummon._hints import hint_for
from nummon._types import Finding


@pytest.mark.parametrize("kind", list(AlertKind))
def test_every_alert_kind_has_a_specific_hint(kind):
    h = hint_for(Finding(kind, Severity.WARNING, "loss", 1.0, 1.0, "m"))
    assert h and len(h) > 30
    assert hint_for(Finding(AlertKind.RUNAWAY, Severity.CRITICAL, "loss", 1.0, 1.0, "m"), {"optimizer": "sgd_momentum"}).startswith("momentum SGD")
    assert "bfloat16" in hint_for(Finding(AlertKind.EXTREME, Severity.WARNING, "headroom", 0.5, 1.0, "m", details={"dtype": "float16"}))
