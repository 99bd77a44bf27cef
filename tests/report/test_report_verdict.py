"""The report tells the re-run's verdict: hardware (a transient fault) or algorithm (it fails again)."""

from nummon._report.story import IncidentView, _sentences


def _view(details):
    alert = {"step": 45, "kind": "runaway", "severity": "critical", "message": "loss runs away", "details": details}
    return IncidentView(number=1, opened=40, end=52, critical=45, alerts=[alert])


def test_a_reproducible_failure_is_told_as_data_or_optimisation_with_its_batch():
    text = " ".join(_sentences(_view({"verdict": "reproducible", "batch_fingerprint": "ab12"}), 52))
    assert "Re-run at step 45" in text and "batch ab12" in text
    assert "reproducible, the data or the optimisation, not the hardware" in text


def test_a_transient_fault_names_rank_host_and_device():
    suspect = {"rank": 2, "host": "node-7", "device": "cuda:3"}
    text = " ".join(_sentences(_view({"verdict": "not_reproducible", "suspect": suspect}), 52))
    assert "not reproducible, a transient fault on rank 2, host node-7, device cuda:3" in text


def test_no_verdict_no_sentence():
    assert not any("Re-run" in s for s in _sentences(_view({}), 52))
