"""Gradient statistics before clipping: a plain loop with clip_grad_norm_ reports the norm
clip_grad_norm_ saw, and how much it clipped."""

import math

import pytest
import torch
from helpers.models import CNN, data
from torch import nn

from nummon import Monitor


@pytest.mark.parametrize("accumulate", [1, 4])
def test_grad_norm_is_the_unclipped_norm_clip_grad_norm_returned(accumulate):
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = Monitor(model, opt, policy={"recorder": {"write": False}, "alerts": {"stop_on_critical": False}})
    x, y = data(n=32)
    for _ in range(3):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (nn.functional.cross_entropy(model(xs * 30), ys) / accumulate).backward()
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        rec = mon.post_step(torch.tensor(0.0)).record
        assert total > 1.0  # it did clip: the gradients now have norm 1
        assert rec.grad_norm == pytest.approx(total, rel=1e-5)
        assert rec.clip_ratio == pytest.approx(1.0 / total, rel=1e-4)
        if rec.step % 10 == 0:  # max |g| on the parameters' cadence (sampling.params_every)
            assert rec.grad_max == pytest.approx(
                max(float(p.grad.abs().max()) for p in model.parameters()) * total, rel=1e-4
            )
        else:
            assert rec.grad_max is None
    mon.close()


def test_without_clipping_the_ratio_is_one_and_norms_match_the_gradients():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt)
    opt.zero_grad()
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    rec = mon.post_step(1.0).record
    mon.close()
    assert rec.clip_ratio == pytest.approx(1.0)
    for name, p in model.named_parameters():
        assert rec.layer_grad_norms[name] == pytest.approx(float(p.grad.norm()), rel=1e-6)


@pytest.mark.parametrize("how", ["in place", "replaced", "one dropped"])
def test_the_clip_ratio_follows_what_the_loop_did_to_the_gradients_after_the_backward(how):
    # clipping in place (clip_grad_norm_), by new tensors (p.grad = p.grad * c), or a gradient
    # set to None after the backward: the ratio is read from today's gradients each time
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy={"recorder": {"write": False}})
    x, y = data(n=16)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))
        if how == "in place":
            for p in params:
                p.grad.mul_(0.25)
        elif how == "replaced":
            for p in params:
                p.grad = p.grad * 0.25
        else:  # the smallest gradient (one the ratio is measured on) is gone
            min(params, key=lambda p: p.numel()).grad = None
        opt.step()
        rec = mon.post_step(1.0).record
        assert rec.grad_norm == pytest.approx(total, rel=1e-5)  # before any of it
        if how == "one dropped":
            assert rec.clip_ratio is not None and rec.clip_ratio < 1.0
        else:
            assert rec.clip_ratio == pytest.approx(0.25, rel=1e-5)
    mon.close()


def test_an_unclipped_step_reads_a_clip_ratio_of_exactly_one():
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, opt, policy={"recorder": {"write": False}})
    x, y = data(n=16)
    ratios = []
    for _ in range(12):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ratios.append(mon.post_step(1.0).record.clip_ratio)
    mon.close()
    assert ratios == [1.0] * 12


def test_a_step_without_a_backward_measures_the_gradients_as_they_are():
    model = nn.Linear(2, 1)
    mon = Monitor(model)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    rec = mon.post_step(1.0).record
    mon.close()
    assert rec.layer_grad_norms["weight"] == pytest.approx(5.0) and rec.clip_ratio is None


def test_readme_loop_with_clipping_warns_of_the_gradient_explosion_before_the_nan():
    """The README's loop plus clip_grad_norm_(..., 1.0): clipping caps every update, yet the
    unclipped gradient norm nummon sees runs away, and it says so before the loss is lost."""
    import math

    from nummon import Severity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 2.0**k)  # a warm-up to a peak far too high
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    mon = Monitor(model, opt, policy={"alerts": {"stop_on_critical": False}})
    first_bad, grad_warning = None, None
    for step in range(60):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        report = mon.post_step(loss)
        if grad_warning is None and any(
            a.metric in ("grad_norm", "grad_max") and a.severity.rank >= Severity.WARNING.rank for a in report.alerts
        ):
            grad_warning = step
        value = loss.item()
        if not math.isfinite(value) or value > 65504:
            first_bad = step
            break
    mon.close()
    assert first_bad is not None, "the run must be lost for the test to mean something"
    assert grad_warning is not None and grad_warning < first_bad, (grad_warning, first_bad)
