"""The statistics engine on real models: late-added parameters, dtypes, complex parameters,
argument checks."""
import math

import pytest
import torch
from torch import nn

from nummon import AlertKind, Health, Monitor, NummonError

QUIET = {"recorder": {"write": False}, "alerts": {"stop_on_critical": False}}


def _step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def test_a_module_added_after_the_monitor_is_watched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy=QUIET)
    x = torch.randn(8, 4)
    assert mon.post_step(_step(model, opt, x)).health is Health.HEALTHY
    model.append(nn.Linear(4, 2))
    opt.add_param_group({"params": model[1].parameters()})
    r = mon.post_step(_step(model, opt, x))
    assert "1.weight" in r.record.layer_grad_norms  # its output is hooked from the next forward on
    loss = _step(model, opt, x)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")  # after the step: only the new parameter is bad
    r = mon.post_step(loss)
    mon.close()
    assert r.health is Health.NONFINITE and r.record.nonfinite_location == "parameters (optimizer step)"
    assert "1" in r.record.layer_activation_max


def test_a_parameter_group_added_to_the_optimizer_only_is_watched():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy=QUIET)
    x = torch.randn(8, 4)
    mon.post_step(_step(model, opt, x))
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra]})
    loss = _step(model, opt, x)
    with torch.no_grad():
        extra[1] = float("inf")
    r = mon.post_step(loss)
    mon.close()
    assert r.health is Health.NONFINITE and math.isinf(r.record.param_norm)


def test_a_float64_loss_is_judged_against_float64():
    model = nn.Linear(4, 1).double()
    mon = Monitor(model, policy=QUIET)
    r = mon.post_step(torch.tensor(1.4e34, dtype=torch.float64))
    mon.close()
    assert r.record.headroom_dtype == "float64" and r.record.headroom > 200
    assert not [a for a in r.alerts if a.kind is AlertKind.EXTREME]


def test_a_float32_loss_near_its_limit_still_warns():
    mon = Monitor(nn.Linear(4, 1), policy=QUIET)
    r = mon.post_step(torch.tensor(1.4e37))
    mon.close()
    assert r.record.headroom_dtype == "float32" and r.record.headroom < 2


def test_complex_parameters_are_measured():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.SGD([w], lr=0.01, momentum=0.9)
    mon = Monitor(None, opt, policy=QUIET)
    x = torch.randn(5, 4, dtype=torch.complex64)
    for _ in range(2):
        opt.zero_grad()
        loss = (x @ w).abs().square().mean()
        loss.backward()
        opt.step()
        rec = mon.post_step(loss).record
    mon.close()
    assert rec.grad_norm == pytest.approx(torch.linalg.vector_norm(w.grad).item(), rel=1e-5)
    assert rec.param_norm == pytest.approx(torch.linalg.vector_norm(w.detach()).item(), rel=1e-5)
    assert rec.optim_state_norm == pytest.approx(torch.linalg.vector_norm(opt.state[w]["momentum_buffer"]).item(), rel=1e-5)
    assert rec.grad_max == pytest.approx(torch.view_as_real(w.grad).abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("scaler", ["x", 1.0, object()])
def test_a_grad_scaler_that_is_not_one_is_rejected_at_construction(scaler):
    with pytest.raises(NummonError, match="grad_scaler must be a torch.amp.GradScaler"):
        Monitor(nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), grad_scaler=scaler)


def test_dtype_name_is_the_one_table():
    from nummon._stats import dtype_name

    assert [dtype_name(d) for d in (torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.int8)] == [
        "float64", "bfloat16", "float16", "float32", "float32"]
