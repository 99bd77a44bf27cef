"""What is measured every step and what on the sampling cadence: gradient norms, the loss and
the clip ratio every step; parameter and optimizer-state norms and max |g| every
`sampling.params_every` steps, every step while the run is watched closely, and max |g| every
step for float16 gradients."""

import math

import pytest
import torch
from torch import nn

from nummon import Monitor

QUIET = {"recorder": {"write": False}, "alerts": {"stop_on_critical": False}}


def _deep(n_layers=15, width=6, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)]).to(dtype)


def _step(model, opt, mon, x, clip=None, scale=1.0, update=True):
    opt.zero_grad()
    loss = model(x).float().square().mean() * scale
    loss.backward()
    total = float(nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else None
    if update:
        opt.step()
    return mon.post_step(loss).record, total


def test_parameters_state_and_max_grad_on_the_cadence_norms_and_clip_ratio_every_step():
    model = _deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, policy={**QUIET, "sampling": {"params_every": 4, "optimizer_every": 4}})
    x = torch.randn(5, 6)
    recs = [_step(model, opt, mon, x, clip=1e-3, scale=1e12) for _ in range(9)]  # gradients set the headroom
    mon.close()
    for rec, total in recs:
        sampled = rec.step % 4 == 0
        assert (rec.param_norm is not None) is sampled and (rec.optim_state_norm is not None) is sampled
        assert (rec.grad_max is not None) is sampled
        assert rec.grad_norm == pytest.approx(total, rel=1e-5)  # before clipping, every step
        # 8 of the 30 gradients measured again after clipping: clip_grad_norm_'s one factor
        assert rec.clip_ratio == pytest.approx(1e-3 / total, rel=1e-4)
        # between samples the largest gradient norm bounds max |g| for the headroom
        bound = max(rec.layer_grad_norms.values()) if not sampled else rec.grad_max
        assert rec.headroom == pytest.approx(math.log10(torch.finfo(torch.float32).max / bound), rel=1e-6)


def test_every_step_is_measured_in_full_after_a_non_finite_step():
    model = _deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # default cadence for the parameters (every 10 steps); the activations every step, to name the NaN's module
    mon = Monitor(model, opt, policy={**QUIET, "sampling": {"activations_every": 1}})
    x, bad = torch.randn(5, 6), torch.randn(5, 6)
    bad[1, 2] = math.nan
    # one batch with a NaN (its update skipped, as a GradScaler would): the step after is clean again
    recs = [_step(model, opt, mon, bad if i == 2 else x, update=(i != 2))[0] for i in range(6)]
    mon.close()
    assert recs[2].nonfinite_parts and recs[2].nonfinite_location == "output of `0` (forward)"
    assert recs[2].grad_max is None  # not measured on this step: the NaN norms said it
    # step 2 measured its parameters on the failure path (an update may have made them
    # non-finite: recovery must know); every later step is measured in full
    assert [r.param_norm is not None for r in recs] == [True, False, True, True, True, True]
    assert math.isfinite(recs[2].param_norm) and "parameters" not in recs[2].nonfinite_parts
    assert all(r.grad_max is not None and math.isfinite(r.grad_max) for r in recs[3:])


def test_float16_gradients_have_their_max_measured_every_step():
    model = _deep(dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = Monitor(model, opt, policy=QUIET)
    x = torch.randn(5, 6, dtype=torch.float16)
    recs = [_step(model, opt, mon, x)[0] for _ in range(4)]
    mon.close()
    assert all(r.grad_max is not None for r in recs)  # the first step's gradients tell the dtype
    for r in recs:
        assert r.headroom_dtype == "float16"
        assert r.headroom <= math.log10(65504.0 / r.grad_max) + 1e-9  # the closest family (activations may be)


def test_a_large_output_is_read_in_part_until_a_non_finite_value_asks_for_all_of_it():
    """Of a module output over ACT_BUDGET elements only its first ACT_BUDGET (the first samples)
    are read on an ordinary step; after a non-finite step every output is read whole, so the
    first non-finite module is named exactly."""
    from nummon._stats.probes import ACT_BUDGET

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = Monitor(model, opt, policy={**QUIET, "sampling": {"activations_every": 1}})
    x = torch.randn(2 * ACT_BUDGET // 64, 64)
    x[-1, 0] = 1e4  # the largest activation, in the last sample: outside the part read
    bad = x.clone()
    bad[-1, 1] = math.nan
    recs = [_step(model, opt, mon, xb, update=False)[0] for xb in (x, bad, bad)]
    mon.close()
    with torch.no_grad():
        first = model[0](x)
    assert recs[0].layer_activation_max["0"] == pytest.approx(
        float(first.reshape(-1)[:ACT_BUDGET].abs().max()), rel=1e-6
    )
    assert recs[0].layer_activation_max["0"] < float(first.abs().max())
    assert recs[1].nonfinite_location == "output of `1` (forward)"  # the NaN sat outside the part read
    assert recs[2].nonfinite_location == "output of `0` (forward)"  # read whole: the first module
