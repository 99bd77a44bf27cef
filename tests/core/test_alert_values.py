"""Every value an alert prints carries its name and unit: the terminal line, the
alert body and the incident text (Slack, webhook and Alertmanager texts are made from them)."""

import re

import pytest

from nummon import Alert, AlertKind, Severity, StepRecord, load_policy
from nummon._core.alert_text import alert_text
from nummon._core.text import plain_text
from nummon._engine.engine import HealthEngine
from nummon._engine.incidents import IncidentTracker

#: one alert of every kind, as its detector fills it (value, threshold, details)
EXAMPLES = {
    AlertKind.NONFINITE: dict(
        metric="nonfinite",
        value=1626000.0,
        threshold=0.0,
        location="output of `fc1` (forward)",
        details={"parts": ["activation"], "elements": 1626000},
    ),
    AlertKind.EXPLOSION: dict(
        metric="grad_norm", value=3e6, threshold=1.1e6, details={"ratio": 27.3, "baseline": 1.1e5}
    ),
    AlertKind.RUNAWAY: dict(
        metric="loss",
        value=6.428e8,
        threshold=1e3,
        details={"growth": 1e6, "rate_per_step": 368.0, "steps_to_overflow": 3.0},
    ),
    AlertKind.LOSS_SPIKE: dict(metric="loss", value=48.42, threshold=20.0, details={"ratio": 12.1, "baseline": 4.0}),
    AlertKind.DIVERGENCE: dict(metric="loss", value=16.7, threshold=4.0),
    AlertKind.EXTREME: dict(
        metric="loss", value=3.743, threshold=4.0, details={"dtype": "float32", "magnitude": 6.0e34}
    ),
    AlertKind.STALL: dict(metric="loss", value=0.6931, threshold=0.001),
    AlertKind.OSCILLATION: dict(metric="loss", value=0.42, threshold=0.1),
    AlertKind.VANISHING: dict(metric="layer_grad_norm", value=1e-9, threshold=1e-6),
    AlertKind.ATTENTION_LOGITS: dict(metric="attention_logit_max", value=310.0, threshold=100.0),
    AlertKind.ATTENTION_COLLAPSE: dict(metric="attention_entropy", value=0.02, threshold=0.1),
    AlertKind.OUTPUT_LOGITS: dict(metric="output_logsumexp_mean", value=1.542e5, threshold=50.0),
    AlertKind.ADAM_SECOND_MOMENT: dict(metric="adam_ratio_rms", value=570.0, threshold=31.6),
    AlertKind.REPLICA_MISMATCH: dict(
        metric="replica_fingerprint", value=1.0, threshold=0.0, location="parameters", details={"suspect_ranks": [1]}
    ),
}
# a number with nothing to say what it is: "= 3.743", or a label followed by a number alone
BARE = re.compile(r"=\s*[-+]?\d|(value|threshold|limit):\s*[-+]?[\d.]+(e[-+]?\d+)?\s*($|\s\s|\n)", re.M)


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(AlertKind)


@pytest.mark.parametrize("kind", list(AlertKind), ids=lambda k: k.value)
def test_every_alert_kind_renders_its_value_with_a_name(kind):
    a = Alert(step=150, kind=kind, severity=Severity.CRITICAL, message="m", **EXAMPLES[kind])
    (event,) = IncidentTracker(50).update(150, [a])
    texts = {"terminal": str(a), "body": alert_text(a), "incident": plain_text(event.summary())}
    for where, text in texts.items():
        assert not BARE.search(text), f"{where}: {text}"
    line = next(l for l in texts["incident"].splitlines() if l.startswith("- critical"))
    assert "`" not in line and re.search(r"[a-z]", line.split(":", 1)[1]), line


def test_headroom_says_the_value_and_the_decades_left():
    eng = HealthEngine(load_policy("default"))
    for i in range(5):
        eng.step(StepRecord(step=i, loss=2.0))
    got = eng.step(StepRecord(step=150, loss=6.0e34))
    (a,) = [a for a in got.alerts if a.kind is AlertKind.EXTREME]
    assert a.message.startswith("loss 6.0e34: only 3.8 decades of float32 headroom left (limit 4 decades)")
    text = plain_text(got.incidents[0].summary())
    assert "- critical extreme: loss 6.0e34 (3.8 decades of float32 headroom left) (step 150)" in text
    assert (
        "value: loss 6.0e34 (3.8 decades of float32 headroom left)  limit: 4 decades of float32 headroom"
        in alert_text(a)
    )


def test_non_finite_alerts_say_what_their_number_counts():
    eng = HealthEngine(load_policy("default"))
    rec = StepRecord(
        step=80,
        loss=1.0,
        nonfinite_count=1626000,
        nonfinite_parts=("activation",),
        nonfinite_location="output of `fc1` (forward)",
    )
    got = eng.step(rec)
    text = plain_text(got.incidents[0].summary())
    assert "- critical nonfinite: 1.6e6 non-finite elements in output of fc1 (forward) (step 80)" in text
    assert "output of `fc1` (forward), 1.6e6 non-finite elements in it" in got.alerts[0].message
    # a log's NaN loss: no count, the value is named for what it is
    got = HealthEngine(load_policy("default")).step(StepRecord(step=3, loss=float("nan")))
    line = next(l for l in plain_text(got.incidents[0].summary()).splitlines() if l.startswith("- "))
    assert line == "- critical nonfinite: non-finite loss (step 3)"
