"""The verdict and the suspect rank/host reach the exported metrics (nummon_verdicts)."""

from nummon import Alert, AlertKind, Severity
from nummon._watch.metrics import _verdict_key


def _alert(kind=AlertKind.NONFINITE, severity=Severity.CRITICAL, **details):
    return Alert(step=3, kind=kind, severity=severity, message="m", metric="loss", details=details)


def test_a_not_reproducible_step_is_counted_with_its_suspect():
    a = _alert(verdict="not_reproducible", suspect={"rank": 2, "host": "node7", "device": "cuda:1"})
    assert _verdict_key(a) == ("not_reproducible", "2", "node7")
    assert _verdict_key(_alert(verdict="reproducible")) == ("reproducible", "", "")


def test_a_replica_mismatch_names_its_minority_and_other_alerts_are_not_counted():
    assert _verdict_key(_alert(AlertKind.REPLICA_MISMATCH, suspect_ranks=[1])) == ("replica_mismatch", "1", "")
    assert _verdict_key(_alert()) is None
    assert _verdict_key(_alert(severity=Severity.WARNING, verdict="reproducible")) is None
