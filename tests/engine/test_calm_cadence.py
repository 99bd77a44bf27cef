"""The mechanism probes' calm cadence: once the run is past `calm_after`, while the detectors hold a
quiet region and the probes' values hold still, they sample every `every` x `calm_multiple`
steps. The rule itself, and the claim its description makes about a mechanism that moves alone
while everything else stays calm."""

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from nummon import AlertKind, Policy, Severity, StepRecord
from nummon._core.types import MECHANISM_FIELDS, MECHANISM_LAYER_FIELDS
from nummon._engine.engine import HealthEngine
from nummon._policy.mechanism_sections import MechanismsPolicy


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.integers(1, 6), st.integers(0, 300), st.integers(0, 2000), st.booleans())
def test_the_calm_cadence_keeps_to_the_base_cadence_and_thins_only_when_calm(every, multiple, after, step, calm):
    m = MechanismsPolicy(every=every, calm_multiple=multiple, calm_after=after)
    due = m.due(step, calm)
    assert not due or step % every == 0  # never off the base cadence
    if not calm or step < after or multiple == 1:
        assert due == (step % every == 0)  # the cadence as it always was
    else:
        assert due == (step % (every * multiple) == 0)


def _record(step, logit, noise):
    """A calm run (a loss that falls as a healthy one does, gradients and activations steady,
    within minibatch noise) whose attention logits and output log Z are `logit` and `logit / 4`."""
    return StepRecord(
        step=step,
        loss=2.0 / math.sqrt(1 + step / 200) * noise,
        grad_norm=1.0 * noise,
        activation_max=3.0 * noise,
        lr=1e-3,
        attention_logit_max=logit,
        attention_entropy=0.8,
        layer_attention_logit_max={"blocks.0.attn": logit},
        layer_attention_entropy={"blocks.0.attn": 0.8},
        output_logsumexp_mean=logit / 4,
        output_logit_max=logit,
    )


_BLANK: dict[str, object] = {f: None for f in MECHANISM_FIELDS} | {f: {} for f in MECHANISM_LAYER_FIELDS}


def _first_mechanism_warnings(records, multiple):
    """Replay as the Monitor samples: the probes' fields only on the steps `due` (calm: the engine's
    word after the step before), a detector's confirmation and an open incident."""
    policy = Policy.model_validate({"mechanisms": {"calm_multiple": multiple}})
    engine = HealthEngine(policy)
    calm, confirm, first, calm_seen = False, False, {}, 0
    for rec in records:
        sampled = confirm or engine.incident_state.active or policy.mechanisms.due(rec.step, calm)
        if not sampled:
            rec = dataclasses.replace(rec, **_BLANK)
        got = engine.step(rec)
        calm_seen += engine.calm
        for a in got.alerts:
            if a.kind in (AlertKind.ATTENTION_LOGITS, AlertKind.OUTPUT_LOGITS) and a.severity is not Severity.INFO:
                first.setdefault(a.kind, rec.step)
        calm, confirm = engine.calm, engine.wants_sample()
    return first, calm_seen


@settings(max_examples=30, deadline=None)
@given(
    st.integers(120, 300),  # the step the logits start to grow (past calm_after)
    st.floats(1.015, 1.3),  # their growth per step
    st.floats(1.0, 8.0),  # their level before
    st.integers(0, 10**6),  # the minibatch noise's seed
)
def test_a_mechanism_that_moves_alone_warns_of_the_same_kinds_at_most_three_samples_later(start, rate, level, seed):
    """What `calm_multiple`'s description claims. Sampled every 20 steps, the first sample of a rise
    is up to 10 steps later; near the growth rule's threshold the recent level (the median of the
    samples of the last 80 steps) holds one sample fewer, and a sighting can fail to confirm (or
    confirm sooner) once or twice more (on a grid of 360 such first warnings: 295 at the same step, 47 within 10 steps,
    18 by 12 to 30 steps later, none missed)."""
    p = MechanismsPolicy()
    n = start + math.ceil(math.log(100 / level) / math.log(rate)) + 20  # past the absolute warning level (50)
    records = [_record(i, level * rate ** max(0, i - start), 1.0 + 0.02 * math.sin(seed + 1.7 * i)) for i in range(n)]
    full, _ = _first_mechanism_warnings(records, multiple=1)
    calm, calm_seen = _first_mechanism_warnings(records, multiple=p.calm_multiple)
    assert calm_seen > start // 2  # the run was calm before the logits grew: the sparse cadence was in force
    assert full  # the growth warned at the full cadence ...
    assert set(calm) == set(full)  # ... and warns of the same kinds at the calm one
    for kind, step in full.items():
        assert calm[kind] <= step + 3 * p.every, kind  # (earlier, too: the median moves both ways)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1e-2, 1e4), st.lists(st.floats(-0.15, 0.15), min_size=2, max_size=12), st.floats(1.7, 10.0)
)  # (above 1.44 x the noisiest level)
def test_probe_values_hold_still_within_noise_of_their_level_and_not_past_it(level, noise, jump):
    from collections import deque

    from nummon._engine.quiet import steady

    recent: dict[str, deque] = {}
    held = [steady(recent, {"attention_logit_max": level * (1 + n)}) for n in noise]
    assert held == [False] + [True] * (len(noise) - 1)  # a first sample has no level; noise stays near it
    assert not steady(recent, {"attention_logit_max": level * jump})  # a jump leaves it
    assert not steady({}, {"attention_logit_max": math.nan}) and not steady(recent, {"adam_ratio_rms": 1.0})
    kept = list(recent["attention_logit_max"])
    assert not steady(recent, {"attention_logit_max": math.inf})
    assert list(recent["attention_logit_max"]) == kept  # a non-finite value is kept out of the level


def test_the_adam_rules_noise_far_below_their_absolute_warning_holds_still():
    """The Adam detector declares floors at half its absolute warning levels: below them a fraction
    or update ratio may move by any factor (minibatch noise), above them it must hold near its level."""
    from collections import deque

    from nummon._engine.quiet import steady

    policy = Policy.model_validate({"adam_moment": {"warning_update_ratio": 0.4}})
    floors = HealthEngine(policy)._quiet.floors
    assert (
        floors["update_ratio_max"] == 0.2
        and floors["adam_small_grad_fraction"] == policy.adam_moment.small_fraction / 2
    )
    recent: dict[str, deque] = {}
    held = [steady(recent, {"update_ratio_max": v}, floors) for v in (0.001, 0.01, 0.003, 0.15)]
    assert held == [False, True, True, True]
    assert not steady(recent, {"update_ratio_max": 0.25}, floors)  # past the floor, 25x its level
