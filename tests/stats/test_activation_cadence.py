"""The activation maxima on their cadence (`sampling.activations_every`): the forward hooks are
registered only for the forwards that measure, and every step, every module, while the run is
watched closely (an open incident, after a non-finite value)."""

import math

import pytest
import torch
from helpers.models import Deep
from torch import nn

from nummon import Monitor

QUIET = {"recorder": {"write": False}, "alerts": {"stop_on_critical": False}}
#: steps measured every step while the detectors warm up (no quiet region yet): the cadence
#: shows from here on
WARM = 12
NO_MECHANISMS = {**QUIET, "mechanisms": {"enabled": False}}  # their root hook is no activation hook


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _forward_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def _run(model, mon, steps, poison=(), scale=None):
    """`steps` SGD steps on one batch; returns (records, forward hooks registered before each
    forward). At the steps in `poison` the middle Linear's output is made Inf (and the update
    skipped); `scale`: {step: factor} multiplies that step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    recs, hooks = [], []
    for _ in range(steps):
        step = mon.step
        hooks.append(_forward_hooks(model))
        bad = model[2].register_forward_hook(lambda m, a, o: o * math.inf, prepend=True) if step in poison else None
        opt.zero_grad()
        loss = model(x).square().mean() * (scale or {}).get(step, 1.0)
        loss.backward()
        if bad is not None:
            bad.remove()
        else:
            opt.step()
        recs.append(mon.post_step(loss).record)
    return recs, hooks


def test_the_activations_are_measured_on_their_cadence_with_no_hook_between():
    model = _mlp()
    mon = Monitor(model, policy=NO_MECHANISMS)  # the default cadence: every 10 steps
    recs, hooks = _run(model, mon, 45)
    mon.close()
    measured = [r.step for r in recs if r.activation_max is not None]
    # every step while the detectors warm up (no quiet region yet: the first ten records), then
    # on the cadence only
    assert measured == [*range(11), 20, 30, 40]
    assert [r.step for r in recs if r.layer_activation_max] == measured
    assert set(recs[20].layer_activation_max) == {"0", "2", "4"}
    # the three Linear layers hooked for the measuring forwards only; none at all between them
    assert hooks == [3 if step in measured else 0 for step in range(45)]
    assert _forward_hooks(model) == 0  # closed: none left


@pytest.mark.parametrize("jump,closer", [(1.6, True), (1.3, False)])
def test_a_value_rising_well_out_of_its_quiet_band_measures_the_next_step_too(jump, closer):
    model = _mlp()
    mon = Monitor(model, policy=NO_MECHANISMS)
    # step 24's loss (and gradients) 1.6x: more than the band's whole width (1.44x) above its
    # level, no alert: the activations are measured at 25 too. 1.3x is out of the band (judged
    # in full) but within minibatch noise of the level: they wait for their cadence
    recs, hooks = _run(model, mon, 40, scale={24: jump})
    mon.close()
    assert not mon.alerts
    measured = [r.step for r in recs if r.activation_max is not None]
    assert [s for s in measured if s > 10] == ([20, 25, 30] if closer else [20, 30])
    assert hooks[24] == 0 and hooks[25] == (3 if closer else 0) and hooks[26:30] == [0, 0, 0, 0]


def test_the_first_forward_is_measured_whatever_its_step():
    # (a model compiled after the Monitor traces its hooks there, and keeps them)
    model = _mlp()
    mon = Monitor(model, policy=NO_MECHANISMS, start_step=7)
    recs, hooks = _run(model, mon, 15)
    mon.close()
    measured = [r.step for r in recs if r.activation_max is not None]
    assert measured[0] == 7 and hooks[0] == 3
    assert measured[-1] == 20 and hooks[-1] == 0  # (warmed up: on the cadence)


def test_a_large_model_hooks_its_block_boundaries_on_the_cadence_and_every_module_on_the_detail_cadence():
    torch.manual_seed(0)
    model = Deep()
    policy = {**NO_MECHANISMS, "sampling": {"activations_every": 5, "activations_all_every": 10}}
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    mon = Monitor(model, opt, policy=policy)
    x = torch.randn(16, 4)
    hooks, recs = [], []
    for _ in range(WARM + 20):
        hooks.append(_forward_hooks(model))
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss).record)
    mon.close()
    every = len(recs[20].layer_activation_max)  # every watched module (2 + 2 x 40 Linears), the 32 blocks
    bounds = len(recs[15].layer_activation_max)  # the boundaries: inp, head and 32 of the 40 blocks
    assert every == 82 + 32 and bounds == 34
    expected = [bounds] + [0] * 4 + [every] + [0] * 4 + [bounds] + [0] * 4 + [every, 0]  # steps 15-31
    assert [len(r.layer_activation_max) for r in recs[15:]] == expected
    assert hooks[15:] == expected  # the hooks registered: those of the forwards that measure


def test_after_a_nan_on_an_unsampled_step_the_next_steps_measure_every_module():
    model = _mlp()
    mon = Monitor(model, policy=NO_MECHANISMS)
    recs, hooks = _run(model, mon, 18, poison={13, 15})
    mon.close()
    # step 13 was not sampled: the record says what went non-finite (the loss, the gradients),
    # not which module's output did
    assert recs[13].nonfinite_parts and "activations" not in recs[13].nonfinite_parts
    assert recs[13].activation_max is None and not recs[13].layer_activation_max
    assert "output of" not in (recs[13].nonfinite_location or "")
    # from the next step on every module is hooked, every step: a NaN there is named exactly
    assert hooks[14:] == [3, 3, 3, 3]
    for r in recs[14:]:
        assert set(r.layer_activation_max) == {"0", "2", "4"}, r.step
    assert recs[15].nonfinite_location == "output of `2` (forward)"
    assert math.isfinite(recs[14].activation_max) and math.isfinite(recs[16].activation_max)


def test_an_open_incident_hooks_every_module_on_every_step():
    model = _mlp()
    mon = Monitor(model, policy=NO_MECHANISMS)
    # a finite blow-up: the loss (and with it every gradient) 1e6 times larger at step 23
    recs, hooks = _run(model, mon, 30, scale={23: 1e6})
    mon.close()
    assert all(r.is_finite() for r in recs)  # not the after-non-finite rule
    assert mon.incidents and mon.incidents[0].step == 23
    assert [r.step for r in recs[WARM:23] if r.activation_max is not None] == [20]
    # the incident is open from step 23's record on: every later forward is hooked in full
    assert hooks[24:] == [3] * 6
    assert all(set(r.layer_activation_max) == {"0", "2", "4"} for r in recs[24:])


@pytest.mark.parametrize("every", [1, 3])
def test_the_cadence_follows_activations_every(every):
    model = _mlp()
    mon = Monitor(model, policy={**NO_MECHANISMS, "sampling": {"activations_every": every}})
    recs, hooks = _run(model, mon, WARM + 7)
    mon.close()
    steps = range(WARM, WARM + 7)  # (warmed up)
    assert [r.step for r in recs[WARM:] if r.activation_max is not None] == [s for s in steps if s % every == 0]
    assert hooks[WARM:] == [3 if step % every == 0 else 0 for step in steps]


def test_activations_off_hooks_nothing_even_while_watched_closely():
    model = _mlp()
    mon = Monitor(model, policy={**NO_MECHANISMS, "sampling": {"activations": False}})
    recs, hooks = _run(model, mon, 6, poison={2})
    mon.close()
    assert hooks == [0] * 6 and all(r.activation_max is None for r in recs)


def test_forensics_names_the_module_of_a_nan_on_an_unsampled_step_at_once():
    # the record of an unsampled step cannot name the module; the re-run under operator
    # interception (post_step(..., recompute=)) does, on that very step
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay those of the failing forward
    mon = Monitor(model, opt, policy=NO_MECHANISMS)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=gen)
    recs = []
    for step in range(WARM + 4):
        if step == WARM + 3:
            with torch.no_grad():
                model[2].weight[0, 0] = math.inf
        # a batch of its own each step: with the weights fixed, one batch would freeze the loss (a stall)
        xs = x * (1 + 0.02 * torch.randn(8, 6, generator=gen))
        opt.zero_grad()
        loss = model(xs).square().mean()
        loss.backward()
        opt.step()
        recs.append(mon.post_step(loss, recompute=lambda xs=xs: model(xs).square().mean()).record)
    mon.close()
    assert recs[-1].activation_max is None and "output of" not in (recs[-1].nonfinite_location or "")
    assert mon.cause is not None and mon.cause.module == "2" and mon.cause.stage == "forward"
