"""What a log may hold and the report must survive: markup in any field (escaped, never markup),
fields of the wrong type (left out with one warning, never a traceback), values beyond the
doubles (an overflow, drawn)."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nummon._cli import main
from nummon._report import build_report

EVIL = "<b id=evil>x</b>"


def _log(path, alert=None, event_step=30, losses=None):
    """A Monitor-style event log: a runaway to NaN, its incident events and two alerts."""
    losses = losses or [2.0 * 0.99**i for i in range(30)] + [2.0 * 6**k for k in range(1, 7)] + ["NaN"]
    lines = [{"type": "step", "step": i, "loss": v} for i, v in enumerate(losses)]
    n = len(losses) - 1
    lines += [
        {"type": "incident", "step": event_step, "state": "open", "number": 1, "opened_step": event_step},
        {"type": "incident", "step": n, "state": "nonfinite", "number": 1, "opened_step": event_step},
        {"type": "alert", "step": 31, "severity": "warning", "kind": "explosion", "metric": "loss", "message": "m"},
        {"type": "alert", "step": n, "severity": "critical", "kind": "nonfinite", "metric": "loss", "message": "nan"},
    ]
    if alert is not None:
        lines[-1] = {**lines[-1], **alert}
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_an_alert_whose_step_is_markup_never_lands_on_the_page_as_markup(tmp_path):
    """An incident event without a usable step and an alert whose step is a script: neither is
    placed, nothing of them is markup."""
    log = tmp_path / "events.jsonl"
    _log(log, alert={"step": "<script>alert(1)</script>"}, event_step="<script>alert(2)</script>")
    html = build_report(log)
    assert "<script" not in html.lower()


_TEXT_FIELDS = ["severity", "kind", "metric", "message", "hint", "location", "flight_record"]
_DETAIL_FIELDS = ["why", "batch_fingerprint", "verdict"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(_TEXT_FIELDS + [f"details.{k}" for k in _DETAIL_FIELDS] + ["details.cause", "details.suspect"]),
    st.sampled_from([EVIL, [EVIL], {"cause": EVIL, "op": EVIL, "rank": EVIL, "host": EVIL}]),
)
def test_markup_in_any_field_of_an_alert_is_escaped(tmp_path, field, value):
    alert: dict = {"details": {"parts": [EVIL], "worst_samples": [EVIL], "verdict": "not_reproducible"}}
    if field.startswith("details."):
        alert["details"][field.split(".", 1)[1]] = value
    else:
        alert[field] = value
    log = _log(tmp_path / "events.jsonl", alert=alert)
    html = build_report(log)
    assert "id=evil>" not in html and "<b id" not in html


BAD_FIELDS = {
    "details a string": {"details": "abc"},
    "details a list": {"details": [1, 2]},
    "range of strings": {"details": {"steps_to_overflow": 5, "steps_to_overflow_range": ["a", "b"]}},
    "range with null": {"details": {"steps_to_overflow": 5, "steps_to_overflow_range": [None, 3]}},
    "parts a number": {"details": {"parts": 5}},
    "worst_samples a number": {"details": {"worst_samples": 5}},
    "suspect a string": {"details": {"verdict": "not_reproducible", "suspect": "x"}},
}


@pytest.mark.parametrize("bad", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_a_field_of_the_wrong_type_is_left_out_with_one_warning(tmp_path, capsys, bad):
    log = _log(tmp_path / "events.jsonl", alert=bad)
    assert main(["report", str(log)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wrong type left out" in err[0] and str(log) in err[0]
    html = (tmp_path / "nummon-report.html").read_text()
    assert "Run lost at step 36" in html  # the rest of the run is told


def test_a_loss_swinging_across_the_doubles_is_drawn(tmp_path, capsys):
    log = tmp_path / "trace.jsonl"
    log.write_text("".join(json.dumps({"step": i, "loss": (-1) ** i * 1e308}) + "\n" for i in range(60)))
    assert main(["report", str(log), "-o", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    ys = [float(y) for y in re.findall(r'<path d="M[\d.]+,([-\d.]+)', html)]
    assert ys and all(0 <= y <= 2000 for y in ys)  # every curve inside its panel


def test_an_integer_loss_of_400_digits_is_an_overflow(tmp_path, capsys):
    log = tmp_path / "trace.jsonl"
    rows = [{"step": i, "loss": 2.0 * 0.99**i} for i in range(40)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + f'{{"step": 40, "loss": {10**400}}}\n')
    assert main(["report", str(log), "-o", str(tmp_path / "r.html")]) == 0
    assert "first NaN/Inf</span><b>step 40</b>" in (tmp_path / "r.html").read_text()
