"""The mechanism detectors as pure units over host floats: property-based (hypothesis) and rules."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import AlertKind, Policy, Severity, StepRecord
from nummon._engine.detectors import AdamMomentDetector, AttentionDetector, OutputLogitsDetector
from nummon._engine.engine import HealthEngine
from nummon._policy.policy import AdamMomentPolicy, AttentionPolicy, OutputLogitsPolicy

logits = st.floats(min_value=0.01, max_value=19.9, allow_nan=False)


def _att(step, v, ent=0.9, loss=2.0):
    return StepRecord(
        step=step,
        loss=loss,
        attention_logit_max=v,
        attention_entropy=ent,
        layer_attention_logit_max={"blocks.0.attn": v},
        layer_attention_entropy={"blocks.0.attn": ent},
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(logits, min_size=1, max_size=60))
def test_attention_logits_below_the_floor_never_warn(values):
    d = AttentionDetector(AttentionPolicy())
    assert not any(d.update(_att(i, v)) for i, v in enumerate(values))


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=0.5, max_value=5), st.floats(min_value=1.3, max_value=2.0))
def test_geometric_attention_logit_growth_warns_before_the_critical_level(start, rate):
    d = AttentionDetector(AttentionPolicy())
    first = None
    v, step = start, 0
    while v < 1e4 and step < 200:
        got = d.update(_att(step, v))
        if got and first is None:
            first = (step, v, got[0])
        v *= rate
        step += 1
    assert first is not None
    step, v, f = first
    assert f.kind is AlertKind.ATTENTION_LOGITS and f.severity is Severity.WARNING and v < 100  # QK-clip's cap
    assert "blocks.0.attn" in f.message


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 10, 25, 50, 100]), st.floats(min_value=0.05, max_value=1.0))
def test_a_slow_steady_rise_of_the_logits_never_warns_at_any_cadence(every, start):
    """A healthy run's logits rise as it learns (Llama at lr 0.01: 0.2, 6.4 at step 100, 28 at
    200, 37 at 300): growth of 1.5x per 50 steps, below the warning level, warns at no cadence
    (the recent level spans the same steps at every cadence)."""
    d = AttentionDetector(AttentionPolicy())
    rate = 1.5 ** (1 / 50)
    assert not any(d.update(_att(step, min(start * rate**step, 45.0))) for step in range(0, 1500, every))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 5, 10, 20]), st.floats(min_value=1.0, max_value=5.0))
def test_fast_growth_warns_at_every_cadence_before_the_critical_level(every, start):
    """Sampled as the Monitor samples: on the cadence, and the next step whenever a condition
    waits for confirmation."""
    d = AttentionDetector(AttentionPolicy())
    rate = 3.0 ** (1 / 20)  # 3x per 20 steps
    first = next(
        (
            start * rate**step
            for step in range(400)
            if (step % every == 0 or d.wants_sample) and d.update(_att(step, start * rate**step))
        ),
        None,
    )
    assert first is not None and first < 100  # before the level where QK-clip caps them


def test_attention_critical_at_the_critical_level_and_collapse_at_chance_is_named():
    p = AttentionPolicy()
    d = AttentionDetector(p)
    for i in range(10):
        d.update(_att(i, 5.0, ent=0.9, loss=5.5 if i < 3 else 2.0))
    got = d.update(_att(10, 1.5 * p.critical_logit, ent=0.01, loss=5.6)) + d.update(
        _att(11, 1.6 * p.critical_logit, ent=0.01, loss=5.6)
    )
    kinds = {(f.kind, f.severity) for f in got}
    assert (AlertKind.ATTENTION_LOGITS, Severity.CRITICAL) in kinds
    collapse = [f for f in got if f.kind is AlertKind.ATTENTION_COLLAPSE]
    assert collapse and collapse[-1].severity is Severity.CRITICAL and "chance" in collapse[-1].message
    assert "back at or above its starting level" in collapse[-1].message  # 5.6 against a start of 2-5.5


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-30, max_value=30), st.lists(st.floats(min_value=-2, max_value=2), min_size=1, max_size=50))
def test_output_log_z_within_its_band_never_warns(base, noise):
    d = OutputLogitsDetector(OutputLogitsPolicy())
    for i, n in enumerate(noise):
        assert not d.update(StepRecord(step=i, output_logsumexp_mean=base + n, output_logit_max=abs(base) + 5))


def test_output_log_z_drift_warns_then_goes_critical():
    d = OutputLogitsDetector(OutputLogitsPolicy())
    sev = []
    for i in range(40):
        z = 5.5 + (0 if i < 5 else 2.0 * (i - 5))
        sev += [f.severity for f in d.update(StepRecord(step=i, output_logsumexp_mean=z))]
    assert sev[0] is Severity.WARNING and Severity.CRITICAL in sev


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=2.99), min_size=1, max_size=50))
def test_adam_ratio_below_the_warning_never_warns(values):
    d = AdamMomentDetector(AdamMomentPolicy())
    for i, v in enumerate(values):
        assert not d.update(
            StepRecord(step=20 + i, adam_ratio_rms=v, adam_small_grad_fraction=0.01, update_ratio_max=0.01)
        )


def test_adam_ratio_held_warns_and_names_the_tensor():
    d = AdamMomentDetector(AdamMomentPolicy())
    got = []
    for i in range(3):
        got += d.update(StepRecord(step=20 + i, adam_ratio_rms=30.0, layer_adam_ratio_rms={"w": 30.0, "b": 1.0}))
    assert got and got[0].kind is AlertKind.ADAM_SECOND_MOMENT and "`w`" in got[0].message


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([0.95, 0.98, 0.99, 0.999]),
    st.lists(st.floats(min_value=0.0, max_value=0.669), min_size=2, max_size=40),
)
def test_adam_ratio_below_two_thirds_of_its_bound_or_the_warning_never_warns(beta2, fractions):
    """With a long second-moment memory (AdamW's default beta2 0.999: bound 31.6) ratios of 3-4
    come and go in healthy runs: the warning asks for 0.67 of the bound (and at least 3)."""
    bound = 1 / math.sqrt(1 - beta2)
    d = AdamMomentDetector(AdamMomentPolicy())
    for i, f in enumerate(fractions):
        v = min(f * bound, 2.99) if bound * 0.67 < 3 else f * bound
        assert not d.update(
            StepRecord(step=20 + i, adam_ratio_rms=v, adam_ratio_bound=bound, adam_small_grad_fraction=0.01)
        )


@pytest.mark.parametrize("beta2,warn", [(0.95, 3.0), (0.99, 6.7), (0.999, 21.19)])
@pytest.mark.parametrize("critical_rms", [None, 25.0])
def test_adam_ratio_levels_follow_the_bound(beta2, warn, critical_rms):
    """Warning at max(3, 0.67 x bound); critical only where the policy sets a level (off by default)."""
    bound = 1 / math.sqrt(1 - beta2)

    def first(value):
        d = AdamMomentDetector(AdamMomentPolicy(critical_rms=critical_rms))
        got = [
            f
            for i in range(3)
            for f in d.update(
                StepRecord(step=20 + i, adam_ratio_rms=value, adam_ratio_bound=bound, layer_adam_ratio_rms={"w": value})
            )
        ]
        return got[0].severity if got else None

    assert first(warn * 0.98) is None and first(warn * 1.02) is Severity.WARNING
    assert first(bound) is (
        Severity.CRITICAL if critical_rms is not None and bound >= critical_rms else Severity.WARNING
    )


def test_unsampled_steps_keep_a_condition_open_and_raise_nothing_new():
    eng = HealthEngine(Policy())
    alerts = []
    for i in range(30):
        v = 5.0 if i < 10 else 80.0
        rec = _att(i, v) if i % 5 == 0 or i >= 10 else StepRecord(step=i, loss=2.0)
        alerts += eng.step(rec).alerts
    att = [a for a in alerts if a.kind is AlertKind.ATTENTION_LOGITS]
    assert len(att) == 1 and att[0].hint and "qk-layernorm" in att[0].hint
    assert not any(a.cleared for a in alerts)
    assert math.isfinite(att[0].value)


def test_logits_past_the_qk_clip_cap_warn_but_do_not_stop_a_run():
    """A healthy Llama's copy heads reach logits of 1.6e3 while its loss keeps falling: a
    warning (the state is worth knowing), never a critical alert that stops the run."""
    d = AttentionDetector(AttentionPolicy())
    sev = [
        f.severity
        for step in range(60)
        for f in d.update(_att(step, min(5.0 * 1.2**step, 1600.0)))
        if f.kind is AlertKind.ATTENTION_LOGITS
    ]
    assert Severity.WARNING in sev and Severity.CRITICAL not in sev
